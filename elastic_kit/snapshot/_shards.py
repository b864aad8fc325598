"""Sharded state (FSDP2 / DTensor) in the snapshot tier: parts, and the resharded restore.

A sharded state cannot be kept by one writer per node: each rank holds only its own
shards. So with sharded state every rank writes a *part*: the state tree with each
DTensor replaced by this rank's local tensor, as an ordinary flat snapshot (one copy
into a shared-memory file, hashed, manifest last: :mod:`elastic_kit.snapshot._slots`)
in its own directory ``<node dir>/p<local rank>/``, its manifest's metadata
describing every shard (:data:`PART_KEY`: the saving rank, world size and group, and
per DTensor its global shape, placements, box and digest partial). Each rank's part
is streamed to the next node like any snapshot (source ``<node>.p<local rank>``),
so a node's parts outlive the node.

Restoring (collective, :func:`load_parts`):

1. every node's local rank 0 lists the parts it holds, its own and its replicas;
   the ranks gather the lists and agree on the newest snapshot whose parts, one per
   saving rank of one group, are all held somewhere;
2. for each part one holder is chosen (this node's before a peer's), which maps it
   and verifies its chunks; a part that fails is chosen from its next holder, a
   snapshot without one is skipped for the next newest;
3. each rank fills the box it owns now of every DTensor from the parts' boxes that
   overlap it: read from the mapping where the part lies on its own node, else sent
   by the holder, point to point over the process group (only the overlapping
   range), whatever the saved and current world sizes;
4. every tensor's layout-independent digest (the store's, see
   :mod:`elastic_kit.store`) is computed from the new shards, summed over ranks and
   compared with the one recorded at save: a misassembled or corrupt restore is never
   returned (the durable store is used instead).

Without ``into`` (an unsharded state: a job that shards only at world size > 1, now
restarted on one node) every rank fills each sharded tensor *whole*, from the same
parts (the box is the whole tensor), and checks its digest on its own, as the
durable store reads a sharded checkpoint's tensors whole for a template without
DTensors. A snapshot is restored only from a part of every saving rank: parts that
do not cover the state are skipped, with a note naming the ranks missing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from elastic_kit.distributed import (
    DistInfo, all_gather_object, broadcast_object, exchange_tensors, is_dist_ready,
)
from elastic_kit._env import non_negative_from_env
from elastic_kit.errors import CheckpointError
from elastic_kit.store import (
    FlatCheckpoint, Layout, LoadedCheckpoint, Manifest, broadcast_state, combine_digest,
    digest_partial, is_dtensor, leaves, local_box, map_tree, open_flat, parse_step_dir, resolve_url,
)

__all__ = ["PART_KEY", "ROUND_BYTES", "ROUND_BYTES_ENV", "SHARD_MARK", "Listing", "add_partials",
           "describe", "exchange_rounds", "is_part",
           "listing", "load_parts", "local_tensors", "localize", "part_dir_name",
           "part_key", "part_source"]

log = logging.getLogger(__name__)

#: The metadata key, in a part's manifest, describing the part and its shards.
PART_KEY = "elastic_kit_part"
#: What stands for a DTensor in the tree a part's holder broadcasts.
SHARD_MARK = "__elastic_kit_shard__"
#: Snapshot steps tried, newest first, before a restore gives up on memory.
MAX_TRIES = 3
#: Bytes a resharding restore moves between ranks per round: each rank stages at most
#: about this much for one round's transfers (on the device, with NCCL), whatever the
#: state's size; ``$ELASTIC_KIT_RESHARD_ROUND_BYTES`` overrides it.
ROUND_BYTES = 512 << 20
ROUND_BYTES_ENV = "ELASTIC_KIT_RESHARD_ROUND_BYTES"


def round_bytes() -> int:
    """:data:`ROUND_BYTES`, or ``$ELASTIC_KIT_RESHARD_ROUND_BYTES`` when set (>= 1)."""
    value = non_negative_from_env(ROUND_BYTES_ENV, int, "a whole number of bytes",
                                  "not allowed: at least 1")
    if value == 0:
        raise ValueError(f"${ROUND_BYTES_ENV}=0: expected at least 1 byte per round")
    return ROUND_BYTES if value is None else value


def exchange_rounds(asked: list[list[Any]], cap: int) -> list[list[tuple[int, int]]]:
    """The ranges every rank asked for (``asked[rank]``: its requests, each ending with
    its byte count), as ``(requester, index)`` in the one order every rank lists them,
    cut into rounds of at most ``cap`` bytes (a range larger than ``cap`` is a round of
    its own). Every rank computes the same rounds from the same gathered requests, so
    the two ends of each transfer take part in the same round, in the same order."""
    rounds: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    used = 0
    for requester, reqs in enumerate(asked):
        for i, req in enumerate(reqs):
            nbytes = int(req[-1])
            if current and used + nbytes > cap:
                rounds.append(current)
                current, used = [], 0
            current.append((requester, i))
            used += nbytes
    if current:
        rounds.append(current)
    return rounds


def part_dir_name(local_rank: int) -> str:
    """The directory, in a node's snapshot directory, of its local rank's parts."""
    return f"p{int(local_rank)}"


def part_source(node: str, local_rank: int) -> str:
    """The name a part's replica stream carries: ``<node>.p<local rank>`` (a node's
    name has no dot, so the receiver can tell a node's parts apart)."""
    return f"{node}.{part_dir_name(local_rank)}"


def localize(state: Any) -> tuple[Any, list[dict[str, Any]]]:
    """``state`` with each DTensor replaced by this rank's local tensor (no copy), and
    each DTensor's description: path, global shape, dtype, placements, this rank's box
    and whether its copy is the one counted (see the store's ``local_box``)."""
    descs: list[dict[str, Any]] = []

    def leaf(path: str, value: Any) -> Any:
        if not is_dtensor(value):
            return value
        shape, offsets, owner = local_box(value)
        local = value.to_local()
        descs.append({"path": path, "shape": list(value.shape), "dtype": str(value.dtype),
                      "placements": [str(p) for p in value.placements],
                      "offsets": list(offsets), "local": list(shape), "owner": owner})
        return local

    return map_tree(state, leaf), descs


def local_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local tensor, other tensors as they are."""
    return [t.to_local() if is_dtensor(t) else t for t in tensors]


def describe(metadata: dict[str, Any], descs: list[dict[str, Any]], *, info: DistInfo,
             group: str) -> dict[str, Any]:
    """``metadata`` with the part's description added."""
    return {**metadata, PART_KEY: {"rank": info.rank, "world_size": info.world_size,
                                   "group": group, "tensors": descs}}


def is_part(metadata: dict[str, Any]) -> bool:
    return isinstance(metadata.get(PART_KEY), dict)


def add_partials(state: Any, metadata: dict[str, Any]) -> None:
    """Record, in the part's description, each owned shard's digest partial, computed
    from ``state`` (the staged copy, on the writer thread)."""
    part = metadata[PART_KEY]
    found = dict(leaves(state))
    for d in part["tensors"]:
        t = found.get(d["path"])
        value = 0
        if d["owner"] and isinstance(t, torch.Tensor):
            value = digest_partial(t, d["offsets"], d["shape"])
        d["partial"] = f"{value:016x}"


# ---------------------------------------------------------------------- restoring
@dataclass(frozen=True)
class Listing:
    """A committed part on one node: its step, the saving group, rank and world size,
    the later-than key and where it lies."""

    step: int
    group: str
    rank: int
    world_size: int
    key: tuple[int, int, int]
    path: str
    own: bool


def listing(path: str, manifest: Manifest, *, own: bool) -> Listing | None:
    """The listing of a committed part (None for a snapshot that is not a valid part)."""
    part = manifest.metadata.get(PART_KEY)
    if not isinstance(part, dict):
        return None
    r, w, g = part.get("rank"), part.get("world_size"), part.get("group")
    if type(r) is not int or type(w) is not int or not 0 <= r < w or not isinstance(g, str):
        return None
    return Listing(step=manifest.step, group=g, rank=r, world_size=w,
                   key=part_key(manifest.step, manifest.metadata), path=path, own=own)


@dataclass
class _Plan:
    """A snapshot whose parts are all held: for each saved rank, its holders as
    ``(lister rank, node, path, own)``."""

    step: int
    group: str
    world_size: int
    key: tuple[int, int, int]
    holders: dict[int, list[tuple[int, str, str, bool]]] = field(default_factory=dict)


def _plans(everyone: list[tuple[str, list[Listing]]]) -> list[_Plan]:
    """The snapshots whose every part some node holds, latest first."""
    plans: dict[tuple[int, str], _Plan] = {}
    for lister, (node, found) in enumerate(everyone):
        for f in found:
            p = plans.setdefault((f.step, f.group), _Plan(f.step, f.group, f.world_size, f.key))
            if f.world_size != p.world_size:
                continue  # parts that disagree on the world size: not one save
            p.holders.setdefault(f.rank, []).append((lister, node, f.path, f.own))
    complete = [p for p in plans.values()
                if sorted(p.holders) == list(range(p.world_size))]
    return sorted(complete, key=lambda p: p.key, reverse=True)


def _open(path: str, *, verify: bool) -> FlatCheckpoint:
    step = parse_step_dir(os.path.basename(path))
    if step is None:
        raise ValueError(f"{path} is not a step directory")
    fs, root = resolve_url(os.path.dirname(path))
    layout = Layout(fs, root, url=os.path.dirname(path))
    return open_flat(layout, layout.dir_of(step), verify=verify)


def part_key(step: int, metadata: dict[str, Any]) -> tuple[int, int, int]:
    """``(step, epoch, position)``: which of two snapshots is later."""
    def num(v: Any) -> int:
        return v if type(v) is int else -1
    return (int(step), num(metadata.get("epoch")), num(metadata.get("consumed")))


def _overlap(a_off: list[int], a_shape: list[int], b_off: list[int],
             b_shape: list[int]) -> tuple[list[int], list[int]] | None:
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a_off, a_shape, b_off, b_shape)]
    if any(x >= y for x, y in zip(lo, hi)):
        return None
    return lo, hi


def _box(t: torch.Tensor, off: list[int], lo: list[int], hi: list[int]) -> torch.Tensor:
    return t[tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, off))]


#: Called with ``(path, step, why)`` for a snapshot in memory that a restore passes
#: over (the tier's note for the restore line).
OnSkip = Callable[[str, int, str], None]


def load_parts(*, info: DistInfo, node: str, found: list[Listing], into: Any,
               device: torch.device | None, on_skip: OnSkip | None = None,
               newer_than: int = -1) -> tuple[LoadedCheckpoint | None, bool]:
    """The newest sharded snapshot held in memory anywhere, resharded onto ``into``'s
    DTensors (collective); ``(loaded, all_local)``, where ``all_local`` says no rank
    needed a range from another node. None when memory cannot cover the state (no
    complete snapshot, or its parts fail verification on every holder, or the
    restored content does not match its digests): every rank returns None alike, and
    ``on_skip`` (if given) hears why, on every rank.

    ``found``: the parts this node holds (local rank 0's listing; empty elsewhere).
    ``into``: the live state tree (or a function giving it) whose DTensors give the
    layout to restore into; None for an unsharded state: every sharded tensor is
    then restored whole, on every rank.
    ``newer_than``: only steps after this one are tried (a snapshot of the other
    kind, whole tensors, holds that step: an older part would roll training back
    past it).
    """
    distributed = is_dist_ready() and info.world_size > 1
    everyone = all_gather_object((node, found)) if distributed else [(node, found)]
    plans = [p for p in _plans(everyone) if p.step > newer_than][:MAX_TRIES]
    if on_skip is not None:  # the newest step held only in part, when passed over
        for step, path, why in _incomplete(everyone):
            if step > max(newer_than, max((p.step for p in plans), default=-1)):
                on_skip(path, step, why)
    if not plans:
        return None, False
    template = None if into is None else into() if callable(into) else into
    targets = {} if template is None else {p: v for p, v in leaves(template)
                                           if is_dtensor(v)}
    opened: dict[str, FlatCheckpoint] = {}
    try:
        for plan in plans:
            chosen = _choose(plan, everyone, info, opened, distributed)
            if chosen is None:
                if on_skip is not None:
                    on_skip(_a_path(plan), plan.step, "a part of it verifies on no node")
                continue
            result = _restore(plan, chosen, everyone, info, node, opened, targets, device,
                              distributed, whole=into is None)
            if result is not None:
                if result[0] is None and on_skip is not None:
                    on_skip(_a_path(plan), plan.step,
                            "its parts could not be restored (see the warning before)")
                return result
        return None, False
    finally:
        opened.clear()


def _a_path(plan: _Plan) -> str:
    """A part of ``plan`` (where its notes say it lies)."""
    return plan.holders[min(plan.holders)][0][2]


def _incomplete(everyone: list[tuple[str, list[Listing]]]) -> list[tuple[int, str, str]]:
    """``(step, path, why)`` of the newest snapshot held only in part (when none is
    held whole): no node holds some saving rank's part of it."""
    held: dict[tuple[int, str], tuple[Listing, set[int]]] = {}
    for _, found in everyone:
        for f in found:
            first, ranks = held.setdefault((f.step, f.group), (f, set()))
            if f.world_size == first.world_size:
                ranks.add(f.rank)
    if not held:
        return []
    first, ranks = max(held.values(), key=lambda fr: fr[0].key)
    missing = sorted(set(range(first.world_size)) - ranks)
    return [(first.step, first.path,
             f"a sharded snapshot of {first.world_size} ranks, and no node holds the part "
             f"of rank(s) {', '.join(map(str, missing))}")]


def _choose(plan: _Plan, everyone: list[tuple[str, list[Listing]]], info: DistInfo,
            opened: dict[str, FlatCheckpoint], distributed: bool
            ) -> dict[int, tuple[int, str, str, dict[str, Any]]] | None:
    """Per saved rank the holder whose part verified, with the part's description:
    ``{rank: (lister, node, path, part)}``; None when some part verifies nowhere."""
    bad: set[tuple[int, str]] = set()
    while True:
        pick: dict[int, tuple[int, str, str]] = {}
        for r, holders in plan.holders.items():
            # a holder's own part before a replica, the lowest rank first: every
            # rank computes the same choice from the same gathered lists
            ok = sorted((h for h in holders if (h[0], h[2]) not in bad),
                        key=lambda h: (not h[3], h[0]))
            if not ok:
                return None
            pick[r] = ok[0][:3]
        report: dict[int, Any] = {}
        for r, (lister, _, path) in pick.items():
            if lister != info.rank:
                continue
            try:
                if path not in opened:
                    opened[path] = _open(path, verify=True)
                report[r] = opened[path].manifest.metadata.get(PART_KEY)
            except (CheckpointError, OSError, ValueError) as e:
                log.warning("snapshot part %s cannot be used: %s", path, e)
                report[r] = None
        reports = all_gather_object(report) if distributed else [report]
        failed = False
        out: dict[int, tuple[int, str, str, dict[str, Any]]] = {}
        for r, (lister, node, path) in pick.items():
            part = reports[lister].get(r)
            if not isinstance(part, dict) or part.get("group") != plan.group or part.get(
                    "rank") != r or not isinstance(part.get("tensors"), list):
                bad.add((lister, path))
                failed = True
            else:
                out[r] = (lister, node, path, part)
        if not failed:
            return out


def _restore(plan: _Plan, chosen: dict[int, tuple[int, str, str, dict[str, Any]]],
             everyone: list[tuple[str, list[Listing]]], info: DistInfo, node: str,
             opened: dict[str, FlatCheckpoint], targets: dict[str, Any],
             device: torch.device | None, distributed: bool, whole: bool = False
             ) -> tuple[LoadedCheckpoint | None, bool] | None:
    """Fill this rank's boxes from the chosen parts, check the digests (collective).
    ``whole``: the state is unsharded, every rank fills each tensor whole."""
    problem: str | None = None
    fills: dict[str, torch.Tensor] = {}
    boxes: dict[str, tuple[list[int], list[int], bool]] = {}
    requests: list[tuple[int, int, str, list[int], list[int]]] = []
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    saved: dict[str, dict[str, Any]] = {}
    # each sharded tensor's description in every chosen part, by key path
    by_path: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for r, (_, _, _, part) in chosen.items():
        for d in part["tensors"]:
            by_path.setdefault(d["path"], []).append((r, d))
    tensors: dict[str, dict[str, torch.Tensor]] = {}  # part path -> key path -> tensor
    try:
        for path, ds in by_path.items():
            first = ds[0][1]
            target = targets.get(path)
            if target is None and whole:  # the whole tensor: one box, owned here
                saved[path] = first
                shape, offsets, owner = list(first["shape"]), [0] * len(first["shape"]), True
                local = torch.empty(shape, dtype=_dtype(first["dtype"]))
                fills[path], boxes[path] = local, (offsets, shape, owner)
            elif target is None:
                raise ValueError(f"snapshot holds a sharded tensor at {path}; the state to "
                                 "restore into holds no DTensor there")
            else:
                if (list(target.shape) != first["shape"]
                        or str(target.dtype) != first["dtype"]):
                    raise ValueError(f"snapshot tensor {path} is {first['dtype']}"
                                     f"{first['shape']}, the state to restore into has "
                                     f"{target.dtype}{list(target.shape)}")
                saved[path] = first
                shape, offsets, owner = local_box(target)
                local = torch.empty(shape, dtype=target.dtype)
                fills[path], boxes[path] = local, (list(offsets), list(shape), owner)
            for r, d in ds:
                if not d["owner"]:
                    continue  # a replicated copy: the owner's covers the same box
                ov = _overlap(list(offsets), list(shape), d["offsets"], d["local"])
                if ov is None:
                    continue
                lister, holder_node, part_path, _ = chosen[r]
                if holder_node == node:
                    part_t = _part_tensors(part_path, opened, tensors)[path]
                    _box(local, list(offsets), *ov).copy_(_box(part_t, d["offsets"], *ov))
                else:
                    buf = torch.empty([y - x for x, y in zip(*ov)], dtype=local.dtype)
                    requests.append((lister, r, path, ov[0], ov[1], buf.nbytes))
                    pending.append((_box(local, list(offsets), *ov), buf))
    except Exception as e:
        problem = f"{type(e).__name__}: {e}"
    asked = all_gather_object((problem, requests)) if distributed else [(problem, requests)]
    problems = [(r, p) for r, (p, _) in enumerate(asked) if p]
    if problems:
        log.warning("sharded snapshot step %d cannot be restored here (rank %d: %s); "
                    "the durable store is used", plan.step, *problems[0])
        return None, False
    all_local = all(not reqs for _, reqs in asked)
    # in rounds of bounded bytes: a node's lister serves every remote range of the
    # node's parts, which in one batch would stage all of them on its device at once
    for round_ in exchange_rounds([reqs for _, reqs in asked], round_bytes()):
        sends: list[tuple[int, torch.Tensor]] = []
        recvs: list[tuple[int, torch.Tensor]] = []
        for requester, i in round_:
            lister, r, path, lo, hi, _ = asked[requester][1][i]
            if lister == info.rank:
                d = next(d for saver, d in by_path[path] if saver == r)
                part_t = _part_tensors(chosen[r][2], opened, tensors)[path]
                sends.append((requester, _box(part_t, d["offsets"], lo, hi).contiguous()))
            if requester == info.rank:
                recvs.append((lister, pending[i][1]))
        exchange_tensors(sends, recvs)
    for dst, buf in pending:
        dst.copy_(buf)
    # the digest of every tensor's global content, from the new boxes
    mine = {p: (digest_partial(fills[p], boxes[p][0], saved[p]["shape"])
                if boxes[p][2] else 0) for p in fills}
    sums = all_gather_object(mine) if distributed else [mine]
    bad = []
    for path in fills:
        want = combine_digest([int(d["partial"], 16) for _, d in by_path[path]
                               if isinstance(d.get("partial"), str)])
        if path not in targets:  # whole on every rank: each rank's on its own
            if any(combine_digest([s[path]]) != want for s in sums):
                bad.append(path)
        elif combine_digest([s[path] for s in sums]) != want:
            bad.append(path)
    if bad:
        log.warning("sharded snapshot step %d: the restored content of %d tensor(s) does "
                    "not match the digest saved with it (%s); the durable store is used",
                    plan.step, len(bad), ", ".join(bad[:3]))
        return None, False
    loaded = _assemble(plan, chosen, info, opened, fills, targets, device, distributed)
    return loaded, all_local


def _dtype(name: str) -> torch.dtype:
    """The dtype a part's description names (``str(dtype)``: ``torch.float32``)."""
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"snapshot part names dtype {name!r}, expected a torch dtype")
    return found


def _local_part(path: str, opened: dict[str, FlatCheckpoint]) -> FlatCheckpoint:
    """A part on this node, mapped (verified by its holder, the node's local rank 0)."""
    if path not in opened:
        opened[path] = _open(path, verify=False)
    return opened[path]


def _part_tensors(path: str, opened: dict[str, FlatCheckpoint],
                  cache: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A part's tensors by key path (the tree walked once per part)."""
    if path not in cache:
        cache[path] = {k: v for k, v in leaves(_local_part(path, opened).state)
                       if isinstance(v, torch.Tensor)}
    return cache[path]


def _assemble(plan: _Plan, chosen: dict[int, tuple[int, str, str, dict[str, Any]]],
              info: DistInfo, opened: dict[str, FlatCheckpoint],
              fills: dict[str, torch.Tensor], targets: dict[str, Any],
              device: torch.device | None, distributed: bool) -> LoadedCheckpoint:
    """The replicated rest from part 0's holder (broadcast), with each DTensor made
    from this rank's filled box in the live tensor's mesh and placements."""
    from torch.distributed.tensor import DTensor

    lister, _, path, part = chosen[0]
    header = tree = None
    if lister == info.rank:
        src = opened[path]
        sharded = {d["path"] for d in part["tensors"]}
        tree = map_tree(src.state, lambda p, v: SHARD_MARK if p in sharded else v)
        header = {"path": path, "manifest": src.manifest.to_json()}
    if distributed:
        header = broadcast_object(header, src=lister)
        tree = broadcast_state(tree, src=lister, rank=info.rank,
                               device=device or torch.device("cpu"))
    elif device is not None:
        tree = map_tree(tree, lambda _, v: v.to(device) if isinstance(v, torch.Tensor) else v)
    assert header is not None
    manifest = Manifest.from_json(header["manifest"], where=header["path"])

    # part 0's holder has views of the part's mapping (the others got fresh tensors)
    own = lister == info.rank or not distributed

    def leaf(p: str, v: Any) -> Any:
        if isinstance(v, str) and v == SHARD_MARK and p in fills and p not in targets:
            # an unsharded state's: the whole tensor (filled here, not a view of a part)
            return fills[p] if device is None else fills[p].to(device)
        if not (isinstance(v, str) and v == SHARD_MARK and p in fills):
            if not isinstance(v, torch.Tensor):
                return v
            if device is not None and v.device.type != device.type:
                return v.to(device)  # the holder's own, as every other rank's
            # the holder's views of the mapping (on the CPU) are copied, also for a CPU
            # device given explicitly (as ElasticLoop gives it): else they hold the file
            return v.clone() if own and v.device.type == "cpu" else v
        t = targets[p]
        return DTensor.from_local(fills[p].to(t.to_local().device), t.device_mesh,
                                  t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())

    state = map_tree(tree, leaf)
    metadata = dict(manifest.metadata)
    metadata.pop(PART_KEY, None)
    loaded = LoadedCheckpoint.from_manifest(header["path"], manifest, state=state)
    loaded.metadata = metadata
    return loaded
