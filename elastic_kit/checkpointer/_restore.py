"""Where a restart resumes from: the newest state in any tier.

A restarted group may find its state in this node's memory, in a peer node's memory,
or in the durable store. Every rank must take the same branch (the loads are
collective), and the later state wins, not the faster tier; this module makes that
choice, rolls over an epoch the restored state had already finished, and says where
the state came from.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from elastic_kit._console import say
from elastic_kit.distributed import DistInfo, all_reduce_max
from elastic_kit.errors import CheckpointError
from elastic_kit.snapshot import SnapshotTier, agree_run_identity
from elastic_kit.store import copy_tensors, map_tree

if TYPE_CHECKING:
    from elastic_kit.checkpointer._store_like import StoreLike
    from elastic_kit.state import TrainState
    from elastic_kit.store import LoadedCheckpoint

__all__ = ["check_sampler", "make_snapshots", "load_newest", "Newest", "resume"]

log = logging.getLogger(__name__)

TIER_NAMES = {"memory": "this node's memory", "peer": "a peer node's memory",
              "store": "the checkpoint store", None: "nowhere"}


def check_sampler(sampler: Any, info: DistInfo) -> None:
    """A sampler built before the process group would deal another rank's share; one
    with ``drop_last=True`` leaves a tail whose accounting the checkpointer cannot
    keep (its audit counts every sample, and which samples are dropped would change
    with the world size a restart brings)."""
    if sampler is None:
        log.warning("TrainState has no sampler: a restart resumes at the start of the "
                    "saved epoch, not at the saved position inside it")
        return
    if getattr(sampler, "drop_last", False):
        raise ValueError(
            "the sampler has drop_last=True; the Checkpointer needs drop_last=False: the "
            "sampler then pads the tail of an epoch and the step's loss weights give the "
            "padding zero weight (ckpt.sample_weights), so every sample counts once "
            "whatever the world size after a restart")
    if (sampler.num_replicas, sampler.rank) != (info.world_size, info.rank):
        raise ValueError(
            f"sampler has num_replicas={sampler.num_replicas}, rank={sampler.rank}; "
            f"this worker is rank {info.rank} of {info.world_size} (build the sampler "
            "after ek.init_distributed())")


def resume(state: TrainState, info: DistInfo, loaded: LoadedCheckpoint | None,
           restored_step: int | None, restored_from: str | None, tier: SnapshotTier | None,
           finish_audit: Callable[[], Any]) -> int | None:
    """After the load: record the restart in ``state.history``, roll over an epoch
    the restored state had finished (collective), and say what was restored. Returns
    the epoch rolled over (its end-of-epoch work was not done), or None."""
    finished: int | None = None
    sampler = state.sampler
    if state.initial_world_size is None:
        state.initial_world_size = info.world_size
    state.history.append({"world_size": info.world_size, "step": state.step,
                          "restart": info.restart_count,
                          "restored_step": restored_step,
                          "restored_from": restored_from})
    if sampler is not None and loaded is not None:
        if isinstance(loaded.state, dict) and loaded.state.get("sampler") is None:
            # a checkpoint saved without a sampler (one added since): the sampler
            # starts the saved epoch, which it must not overwrite with its own
            sampler.set_epoch(state.epoch)
        if sampler.remaining == 0 or len(sampler) == 0:
            finished = sampler.epoch
            close_exhausted_epoch(state, info, finish_audit)
        state.epoch = sampler.epoch
    if sampler is not None:
        # The checkpointer names the sampler's epochs from here on (end_epoch() moves
        # it to the next): a pass after an epoch's end, before end_epoch() (an
        # evaluation over the training loader), repeats the epoch, never starts the
        # next one. The position stays: set_epoch() keeps it for the same epoch.
        # With nothing restored, the state's epoch is the script's (a run carried
        # over from torch.save sets it): the sampler starts there, at a position
        # given as its start_index.
        sampler.set_epoch(state.epoch if loaded is None else sampler.epoch)
    log_restore(state, info, loaded, restored_from, tier)
    return finished


def make_snapshots(store: StoreLike | None, info: DistInfo, every: int | str | None,
                   budget: float, *, sharded: bool = False) -> SnapshotTier | None:
    """The in-memory snapshot tier, or None where it is off (collective).

    ``"auto"`` is on only under torchrun: outside it nothing restarts the workers,
    so there is nothing for memory to outlive. With sharded state (FSDP2) every rank
    keeps its own shards (see :mod:`elastic_kit.snapshot`).
    """
    if store is None or every in (None, 0):
        return None
    if every == "auto":
        if not info.under_torchrun:
            return None
        every = None
    # a snapshot is trusted only with the identity the store holds now (collective)
    identity = agree_run_identity(store, info)
    if identity is None:
        return None
    # keyed by the URL as given: a node-local store's ``{node_rank}`` is torchrun's
    # group rank, which a re-rendezvous may change, and the node's snapshots (and its
    # peers' replicas) must still be found under the key they were written with
    key = getattr(store, "url_template", None) or store.url
    tier = SnapshotTier(str(key), info=info, every=every,  # type: ignore[arg-type]
                        budget=budget, identity=identity, sharded=sharded)
    # Every rank must take the same restore path (its loads are collective), so
    # snapshots are on only when every node can keep them.
    if all_reduce_max(int(not tier.enabled)):
        if tier.enabled and info.rank == 0:
            log.warning("in-memory snapshots are off: another node cannot keep them "
                        "(see its warning); restarts resume from the durable store")
        return None
    return tier


class Newest(NamedTuple):
    """What :func:`load_newest` restored: the checkpoint (or None), where it came from
    (``"memory"``, ``"peer"``, ``"store"`` or None), and whether it was read from the
    durable store (and verified there). A snapshot of the state the store's newest
    manifest names is not: nothing read the store's bytes, which may not verify, and
    the snapshot may then be the only good copy of that state."""

    loaded: LoadedCheckpoint | None
    source: str | None
    durable: bool


#: What a writer that could not list the store sends in the agreement on the newest
#: durable step (plus ``world_size - rank``: the maximum names the lowest such rank):
#: above any step, so every rank learns of the failure in that one all-reduce.
_LIST_FAILED = 1 << 62


def load_newest(store: StoreLike | None, tier: SnapshotTier | None, info: DistInfo,
                map_location: Any, *, into: Any = None) -> Newest:
    """The newest state in any tier, where it came from and whether it is durable.

    Every rank learns the newest snapshot step any node holds and the newest
    durable step, and all take the same branch (the loads are collective). A newest
    durable checkpoint that does not verify makes the store load an older one; a
    snapshot newer than that one is then taken instead.
    ``into``: the live state (or a function giving it) that a sharded checkpoint is
    loaded into (:meth:`CheckpointStore.load`).

    Raises:
        CheckpointError: a writer could not list the store (on every rank; the
            writer raises its own error).
    """
    if store is None:
        return Newest(None, None, False)
    if tier is None:
        loaded = load_durable(store, map_location, into)
        return Newest(loaded, "store" if loaded is not None else None, loaded is not None)
    tier.connect()
    mine = tier.newest_local()
    writer = getattr(store, "is_writer", info.rank == 0)
    step, epoch, consumed = (-1, -1, -1)
    error: BaseException | None = None
    if writer:
        try:
            step, epoch, consumed = newest_key(store)
        except Exception as e:  # every rank must learn it, in the agreement below
            error = e
    newest_snapshot = all_reduce_max(-1 if mine is None else mine)
    newest_durable = all_reduce_max(
        step if error is None else _LIST_FAILED + info.world_size - info.rank)
    if newest_durable >= _LIST_FAILED:
        if error is not None:
            raise error
        failed = _LIST_FAILED + info.world_size - newest_durable
        raise CheckpointError(f"rank {failed} could not list the checkpoint store "
                              f"{getattr(store, 'url', store)} (see its log); nothing was "
                              "restored")
    # the newest durable checkpoint's position, from a writer that holds it
    newest = step == newest_durable
    durable_key = (newest_durable, all_reduce_max(epoch if newest else -1),
                   all_reduce_max(consumed if newest else -1))
    tried: tuple[int, int, int] | None = None  # the key of the snapshot passed over
    if newest_snapshot >= 0 and newest_snapshot >= newest_durable:
        loaded = tier.load(map_location=map_location, into=into)
        # The later state wins, not the tier: a durable save made after end_epoch
        # is later than a snapshot of the same step taken inside the epoch.
        tried = (-1, -1, -1) if loaded is None else key(loaded.step, loaded.metadata)
        if loaded is not None and tried >= durable_key:
            return Newest(loaded, snapshot_source(tier, info), False)
        loaded = None  # one copy of the state at a time: this one goes before the next
    loaded = load_durable(store, map_location, into)
    # Every rank holds the step and metadata the store broadcast, and the same agreed
    # snapshot step: all take the branch below alike.
    got = (-1, -1, -1) if loaded is None else key(loaded.step, loaded.metadata)
    if got < durable_key and newest_snapshot > got[0] and (tried is None or tried > got):
        # The newest durable checkpoint did not verify and the store fell back to an
        # older one (or none): a snapshot after that one is later. One copy of the
        # state at a time: the store's goes first, and is read again in the rare case
        # that the snapshots fell back further still.
        loaded = None
        snapshot = tier.load(map_location=map_location, into=into)
        if snapshot is not None and key(snapshot.step, snapshot.metadata) > got:
            return Newest(snapshot, snapshot_source(tier, info), False)
        snapshot = None
        loaded = load_durable(store, map_location, into)
    return Newest(loaded, "store" if loaded is not None else None, loaded is not None)


def snapshot_source(tier: SnapshotTier, info: DistInfo) -> str:
    """``"memory"`` when rank 0's node held the snapshot just loaded, else ``"peer"``
    (a peer node's copy, or a replica a peer streamed here). Collective."""
    held = all_reduce_max(int(info.rank == 0 and tier.loaded_own))
    return "memory" if held else "peer"


def own_kept_state(state: TrainState, sd: dict[str, Any]) -> None:
    """Give the CPU tensors of ``sd`` (loaded from a snapshot: views of its mapped
    file) that the state may keep as given memory of their own, so that the
    snapshot's file is not held for the rest of the run (one state's size of shared
    memory, all of it held by any one tensor): the optimizer state of CPU parameters
    (``Optimizer.load_state_dict`` keeps a tensor already of the parameter's device
    and dtype; for CUDA parameters it copies to the device anyway, except the "step"
    of a non-fused optimizer and tensors in the param groups), and every tensor
    but the model's (which ``Module.load_state_dict`` copies into the parameters):
    ``extras`` (kept as given, or by a second optimizer's ``load_state_dict``), a
    scheduler's or a sampler's.

    The copies run in pieces on the shared thread pool: most of their time is the
    first touch of the new pages (about twice a copy's), which scales with the
    threads, and torchrun leaves torch's own copy one thread."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def own(_: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.device.type != "cpu":
            return v
        if v.layout != torch.strided or not v.is_contiguous() or v.nbytes < _POOL_MIN_BYTES:
            return v.clone()
        out = torch.empty(v.shape, dtype=v.dtype)
        pairs.append((out, v))
        return out

    opt = state.optimizer
    for key in list(sd):
        if key == "model":
            continue
        if key == "optimizer" and (opt is None or not any(
                p.device.type == "cpu" for g in opt.param_groups for p in g["params"])):
            # torch copies the state to the parameters' device, except what it keeps
            # as given: a non-fused, non-capturable optimizer's "step" (Adam's, on
            # the CPU whatever the parameters' device), and tensors in param_groups
            # (a tensor lr)
            opt_sd = sd[key]
            if isinstance(opt_sd, dict):
                for per_param in (opt_sd.get("state") or {}).values():
                    if isinstance(per_param, dict) and "step" in per_param:
                        per_param["step"] = map_tree(per_param["step"], own)
                if "param_groups" in opt_sd:
                    opt_sd["param_groups"] = map_tree(opt_sd["param_groups"], own)
            continue
        if key == "extras" and isinstance(sd[key], dict):
            # a module there (an EMA) copies into its own tensors, as the model does:
            # a copy here first would only cost its size in memory and time
            sd[key] = {k: v if isinstance(state.extras.get(k), torch.nn.Module)
                       else map_tree(v, own) for k, v in sd[key].items()}
            continue
        sd[key] = map_tree(sd[key], own)
    copy_tensors(pairs)


#: A tensor smaller than this is cloned on the calling thread (not worth the pool).
_POOL_MIN_BYTES = 1 << 20


def close_exhausted_epoch(state: TrainState, info: DistInfo,
                          finish_audit: Callable[[], Any]) -> None:
    """A restored state whose epoch has nothing left: move to the next epoch.

    Such a state (a save at the epoch's last step before ``end_epoch``, or a
    SIGTERM save there) would hand the script an empty pass, and a loop that
    calls ``next(iter(loader))`` first stops with ``StopIteration``. The epoch's
    audit is checked here (``finish_audit``) instead of in ``end_epoch``; the
    script's own end-of-epoch work for it is not redone. Collective (the audit).
    """
    sampler = state.sampler
    assert sampler is not None
    epoch = sampler.epoch
    finish_audit()
    sampler.set_epoch(epoch + 1)
    state.epoch = epoch + 1
    if info.is_main:
        say(log, "restored step %d finished epoch %d: resuming at epoch %d, position 0",
            state.step, epoch, epoch + 1)


def log_restore(state: TrainState, info: DistInfo, loaded: LoadedCheckpoint | None,
                restored_from: str | None, tier: SnapshotTier | None) -> None:
    """Say, on the main rank, what was restored from where (or that nothing was)."""
    if not info.is_main:
        return
    sampler = state.sampler
    ignored = tier.ignored_note() if tier is not None else ""
    if loaded is not None:
        done = f", {sampler.consumed}/{sampler.dataset_length} samples of it done" if (
            sampler is not None) else ""
        say(log, "restored checkpoint step %d (from %s): epoch %d%s; world size %s "
            "-> %d (restart %d)%s", state.step, TIER_NAMES[restored_from],
            state.epoch, done, loaded.metadata.get("world_size", "?"),
            info.world_size, info.restart_count, ignored)
    else:
        say(log, "no checkpoint to restore: starting at step %d, epoch %d, world "
                 "size %d%s", state.step, state.epoch, info.world_size, ignored)


def _int_or(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def key(step: int, metadata: dict[str, Any]) -> tuple[int, int, int]:
    """``(step, epoch, position)`` of a saved state: which of two states is later."""
    return (int(step), _int_or(metadata.get("epoch"), -1), _int_or(metadata.get("consumed"), -1))


def newest_key(store: StoreLike) -> tuple[int, int, int]:
    """:func:`key` of the store's newest committed checkpoint (manifests only), or
    ``(-1, -1, -1)`` without one. A store without ``list()`` gives its step only."""
    lister = getattr(store, "list", None)
    if lister is None:
        step = store.latest_step()  # type: ignore[attr-defined]
        return (-1, -1, -1) if step is None else (int(step), -1, -1)
    infos = lister()
    return key(infos[-1].step, infos[-1].metadata) if infos else (-1, -1, -1)


def load_durable(store: StoreLike, map_location: Any,
                 into: Any = None) -> LoadedCheckpoint | None:
    """Load the store's newest checkpoint; a node-local store's node that lacked it
    then keeps the broadcast copy (a store-like wrapper without ``keep_copy`` only
    loads). ``into`` is passed only when given (sharded state), so store-likes
    without it keep working for replicated state."""
    kw = {"into": into} if into is not None else {}
    loaded = store.load(map_location=map_location, **kw)
    keep_copy = getattr(store, "keep_copy", None)
    if keep_copy is not None:
        keep_copy(loaded)
    return loaded
