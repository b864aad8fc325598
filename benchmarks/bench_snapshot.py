"""In-memory snapshots: what a snapshot every K steps costs a training loop, against
the copy that is its physical limit and against DCP's ``async_save``.

Claim: the training thread pays only the copy of the state out of the live tensors
(a memory copy on the CPU, a pinned device-to-host copy on CUDA) and never waits for
the write. Goals: on 2 CPU cores, a snapshot every step of a 256 MiB state whose step
is mostly waiting costs <= 15% throughput and no step waits longer than two copies;
on an H100 with the ~400 M parameter AdamW model (4.83 GB), a snapshot every 10 steps
costs <= 3% throughput, blocks <= 1.5x the pinned copy and commits <= 0.3 s after it
was taken.

Setting: one process, an own loop over a stack of ``Linear(d, d)`` layers (+ GELU)
trained with AdamW; its state (parameters and the optimizer's two moments) is
``--state-mib`` (CPU, default 256 MiB, ``d = 1024``) or ``--layers`` x ``d = 4096``
(CUDA, default 24 layers: 403 M parameters, fused AdamW, bf16 autocast, 16,384
inputs per step: the model of the GPU measurements). On the CPU a step is a small
forward and backward pass, the optimizer step and ``--wait-s`` of sleep: what a GPU
step is to the CPU, mostly waiting. Snapshots go to ``/dev/shm`` (the tier's default).

Method: interleaved blocks of ``--block`` steps, each kind in turn in every round:

- ``plain``: the loop alone;
- ``ek``: the same loop with ``ek.Checkpointer(snapshot_every=K)`` (no durable saves;
  ``ckpt.step()`` after every optimizer step);
- ``dcp``: the loop with ``torch.distributed.checkpoint.async_save`` of the same state
  into ``/dev/shm`` every K steps (waiting for the previous one first, as DCP's docs
  do), with its default stager; on CUDA also ``dcp_pinned``: a
  ``DefaultStager(StagingOptions(pinned, shared, async staging, non-blocking))``
  (torch 2.11 raised ``KeyError`` on its second save: then it is reported as failed).

Every block ends by waiting for its last write (not timed), so no write spills into
the next block. Reported (the JSON's last line):

- ``ratio_ek_vs_plain``: throughput with snapshots over the plain loop's (total step
  time of the plain blocks over the ``ek`` blocks'), ``ratio_dcp_vs_plain`` likewise;
- ``ek_blocked_s``: the training thread's time per snapshot (``SnapshotTier.cost_s``:
  taking it, and the wait for its deferred copy before the next optimizer step; on
  CUDA that wait is the device's, ``ek_device_stall_s``, not the thread's),
  min/median/max, against ``copy_s`` (one copy of the state into reused buffers: a
  memory copy, or pinned device-to-host), as ``ratio_blocked_vs_copy`` (median);
- ``ratio_max_blocked_vs_two_copies``: the longest the training thread was blocked
  by one snapshot, against two copies (goal <= 1);
- ``ek_device_stall_s``: CUDA: how long the device waited, before the optimizer
  step, for a snapshot's copies on the side stream (they overlap the forward and
  backward pass; the training thread does not wait for them);
- ``ek_relay_bytes``: CUDA: the bytes of each snapshot that went through the device's
  relay at the end (``SnapshotTier.relay``: the part of the copy that outlasted the
  forward and backward pass, taken off the optimizer's path);
- ``ek_mirror_copy_s``, ``ek_mirror_bytes``: CUDA: the training stream's time in each
  snapshot's copy into the device's mirror of the file, and the mirror's size
  (``SnapshotTier.mirror``; 0 where the device had no room for it);
- ``ek_max_step_excess_s``: the longest an ``ek`` snapshot step took beyond the plain
  blocks' median step, against two copies (``ratio_max_excess_vs_two_copies``): unlike
  the blocked time it includes the background write's competition for the cores
  (and, on a shared machine, everything else running);
- ``ek_cpu_s_per_snapshot``: the CPU seconds (all threads) the ``ek`` blocks took
  beyond the plain blocks, per snapshot written: what the snapshots take from cores
  training may need (on a machine with few cores, the throughput they cost beyond
  the blocked time);
- ``ek_interval``: the agreed snapshot interval (first, last and median over the
  ``ek`` steps): with ``--every auto``, what the automatic interval chose;
- ``ek_warmup``: an untimed ``ek`` block of ``2K + 2`` steps run first (unless
  ``--no-warmup``), in which the snapshot files are made (and on CUDA registered as
  pinned memory), a cost paid once per run, longer where a large CUDA state skips its
  first snapshots until the writer made the first file: its wall time, longest step,
  the steps skipped, and each snapshot's blocked time and commit latency. The other figures are the steady
  state after it;
- ``ek_commit_s``: from taking a snapshot to its commit (median of those written);
  ``ek_written`` / ``ek_replaced`` / ``ek_skipped``: snapshots written, replaced by a
  newer one while they waited for a write, and skipped (a CUDA state over 256 MiB due
  while no snapshot file was free);
- ``ek_direct`` / ``ek_files_made``: snapshots the training thread copied straight
  into a snapshot file (the rest were staged while a write ran and copied into the
  file after), and snapshot files made (two when they are reused);
- ``ek_hash_s`` / ``ek_commit_write_s``: the writer thread's time per snapshot in
  the parallel checksums, and in the commit (payload, manifest, the older
  snapshot's release): where the commit latency goes;
- ``restore_s``: a new ``Checkpointer.restore()`` from this node's memory, against
  ``h2d_s`` (the copy back: memory copy, or pinned host-to-device); ``load_s``: the
  tier's load alone (map, verify the chunks, views or the copy to the device), as
  ``ratio_load_vs_h2d``, and ``load_phases``, where it went (``SnapshotTier.
  last_load_phases``: choosing, mapping and verifying; on CUDA allocating the
  device's tensors and the pinned buffers, and the copy through them);
- ``restart``: the restored run trained on until its first snapshot (the first to
  protect the restored steps): the steps until it was taken, the snapshots skipped
  before it, its blocked seconds (as ``ratio_restart_blocked_vs_blocked``, against
  the steady state's median), whether it went straight into a snapshot file, its
  commit latency and the writer's whole time on it (``write_s``: also deleting the
  restored snapshot, or taking its file over, and making the next file), the longest
  step, and the snapshot files made and of those reused;
- ``dcp_blocked_s`` / ``dcp_commit_s``: DCP's ``async_save`` call and its completion.

Usage::

    .venv/bin/python benchmarks/bench_snapshot.py                  # CPU, 256 MiB, K=1
    .venv/bin/python benchmarks/bench_snapshot.py --device cuda    # H100 model, K=10
    .venv/bin/python benchmarks/bench_snapshot.py --quick --results benchmarks/results/snapshot-cpu.md
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common  # noqa: E402

import elastic_kit as ek  # noqa: E402

log = logging.getLogger("bench_snapshot")


def build(device: str, *, d: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(d, d), nn.GELU()]
    model = nn.Sequential(*blocks).to(device)
    kw: dict[str, Any] = {"fused": True} if device == "cuda" else {"foreach": True}
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, **kw)


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values()
                 if isinstance(v, torch.Tensor))
    return n


class Loop:
    """One model, one optimizer and the step both kinds of block run."""

    def __init__(self, args: Any) -> None:
        self.device = args.device
        self.model, self.opt = build(args.device, d=args.d, layers=args.layers)
        self.wait_s = args.wait_s
        self.x = torch.randn(args.batch, args.d, device=args.device)
        self.cuda = args.device == "cuda"

    def step(self) -> None:
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.model(self.x).float().square().mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.cuda:
            torch.cuda.synchronize()
        if self.wait_s:
            time.sleep(self.wait_s)


def copy_limit(tensors: list[torch.Tensor], *, back: bool, repeats: int) -> float:
    """Median seconds of one copy of ``tensors`` into reused buffers (pinned for CUDA)
    and, with ``back``, from such buffers into the tensors."""
    cuda = tensors[0].is_cuda
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for t, b in zip(tensors, bufs):
            if back:
                t.copy_(b, non_blocking=cuda)
            else:
                b.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del bufs
    return statistics.median(times[1:])


def live_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


class DcpArm:
    """DCP's async_save every K steps (waiting for the previous one first)."""

    def __init__(self, loop: Loop, root: str, *, pinned: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.dcp, self.loop, self.root, self.pinned = dcp, loop, root, pinned
        self.get_state_dict = get_state_dict
        self.pending: Any = None
        self.n = 0
        self.blocked: list[float] = []
        self.commit: list[float] = []
        self.failed: str | None = None
        self.stager: Any = None
        if pinned:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(True, True, True, True))

    def _finish(self) -> None:
        if self.pending is None:
            return
        fut, t0 = self.pending
        self.pending = None
        upload = getattr(fut, "upload_completion", fut)
        upload.result()
        self.commit.append(time.perf_counter() - t0)

    def save(self) -> float:
        if self.failed is not None:
            return 0.0
        t0 = time.perf_counter()
        self._finish()
        model_sd, optim_sd = self.get_state_dict(self.loop.model, self.loop.opt)
        path = os.path.join(self.root, f"dcp-{self.n % 2}")
        shutil.rmtree(path, ignore_errors=True)
        self.n += 1
        t1 = time.perf_counter()
        try:
            kw: dict[str, Any] = {"checkpoint_id": path}
            if self.stager is not None:
                kw["async_stager"] = self.stager
            try:
                fut = self.dcp.async_save({"model": model_sd, "optim": optim_sd},
                                          no_dist=True, **kw)
            except TypeError:  # an older torch without no_dist
                fut = self.dcp.async_save({"model": model_sd, "optim": optim_sd}, **kw)
            staging = getattr(fut, "staging_completion", None)
            if staging is not None:
                # the live tensors may change only once staging is done: the loop's
                # next optimizer step would wait for it, so it counts as blocked here
                staging.result()
        except Exception as e:  # the pinned stager's known second-save failure
            self.failed = f"{type(e).__name__}: {e}"[:200]
            log.warning("DCP async_save (%s) failed: %s", "pinned" if self.pinned else
                        "default", self.failed)
            return 0.0
        self.pending = (fut, t1)
        blocked = time.perf_counter() - t0
        self.blocked.append(blocked)
        return blocked

    def drain(self) -> None:
        try:
            self._finish()
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"[:200]


def run_block(loop: Loop, steps: int, after_step: Callable[[int], None]) -> list[float]:
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        loop.step()
        after_step(i)
        times.append(time.perf_counter() - t0)
    return times


def after_restore(loop: Loop, ckpt: ek.Checkpointer, every: int) -> dict[str, Any]:
    """Train on after a restore until its first snapshot (the first to protect the
    restored steps) is taken and its cost known: that snapshot's blocked seconds,
    whether it went straight into a snapshot file, the snapshots skipped before it,
    its commit latency, and the longest step."""
    tier = ckpt.snapshots
    assert tier is not None
    times: list[float] = []
    taken_at: int | None = None
    blocked = direct = skipped = None
    for i in range(2 * every + 2):
        t0 = time.perf_counter()
        loop.step()
        if taken_at is not None:
            # final now (this step's optimizer pre-hook waited for its deferred copy);
            # no snapshot taken in this step
            blocked = tier.cost_s
            times.append(time.perf_counter() - t0)
            break
        ckpt.step(1)
        times.append(time.perf_counter() - t0)
        if tier.cost_s is not None:
            taken_at, direct, skipped = i, tier.direct > 0, len(tier.skipped)
    tier.wait()
    return {"steps": len(times), "max_step_s": round(max(times), 4),
            "first_taken_after_steps": None if taken_at is None else taken_at + 1,
            "skipped": skipped if skipped is not None else len(tier.skipped),
            "blocked_s": None if blocked is None else round(blocked, 4),
            "direct": direct,
            "commit_s": round(tier.commit_latency_s, 4) if tier.written else None,
            # the writer's whole time on it: also the restored snapshot's deletion (or
            # the take-over of its file) and the next file's making, after the commit
            "write_s": round(tier._writer.last_write_s, 4) if tier.written else None,
            "files_made": tier._slots.made if tier._slots is not None else None,
            "files_reused": (sum(s.reused for s in tier._slots._slots)
                             if tier._slots is not None else None)}


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--state-mib", type=float, default=None,
                    help="CPU: the state's size (parameters + AdamW moments); default 256")
    ap.add_argument("--layers", type=int, default=None,
                    help="Linear layers (default: from --state-mib on CPU, 24 on CUDA)")
    ap.add_argument("--every", default=None,
                    help="snapshot every K steps, or 'auto' (the checkpointer's automatic "
                         "interval; DCP then saves every 10) (default 1 on CPU, 10 on CUDA)")
    ap.add_argument("--wait-s", type=float, default=None,
                    help="sleep per step (default 0.4 s on CPU, 0 on CUDA)")
    ap.add_argument("--block", type=int, default=None, help="steps per block")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of blocks")
    ap.add_argument("--no-dcp", action="store_true", help="skip the DCP baseline")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time the first snapshots (which make the snapshot files) with "
                         "the rest instead of apart")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    torch.set_num_threads(1)
    args.d = 4096 if cuda else 1024
    if args.smoke:
        args.d = 256
    if args.layers is None:
        mib = args.state_mib if args.state_mib is not None else (2 if args.smoke else 256)
        args.layers = 24 if cuda and not args.smoke else max(
            1, round(mib * 2**20 / (12 * (args.d * args.d + args.d))))
    auto = args.every == "auto"
    every = 10 if auto else int(args.every or (10 if cuda else 1))
    args.wait_s = args.wait_s if args.wait_s is not None else (
        0.0 if cuda else (0.01 if args.smoke else 0.4))
    args.batch = 16384 if cuda and not args.smoke else 8
    block = args.block or (3 if args.smoke else max(10, 2 * every))
    rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 4)

    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    work = tempfile.mkdtemp(prefix="bench-snapshot-", dir=shm)
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = work
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = "bench"
    if auto:  # the automatic interval is on only under torchrun, which this stands for
        os.environ.setdefault("TORCHELASTIC_RUN_ID", "bench")
    load_start = _common.load_avg()
    try:
        loop = Loop(args)
        loop.step()  # the optimizer's state exists from here on
        nbytes = state_bytes(loop.model, loop.opt)
        tensors = live_tensors(loop.model, loop.opt)
        copy_s = copy_limit(tensors, back=False, repeats=3)
        h2d_s = copy_limit(tensors, back=True, repeats=3)
        del tensors
        state = ek.TrainState(loop.model, loop.opt)
        ckpt = ek.Checkpointer(state, os.path.join(work, "durable"), handle_signals=False,
                               snapshot_every="auto" if auto else every,
                               info=ek.DistInfo(run_id="bench"))
        ckpt.restore()
        tier = ckpt.snapshots
        assert tier is not None and tier.enabled, "snapshots are off (see the warning)"

        arms: dict[str, Callable[[int], Any]] = {"plain": lambda i: None}
        blocked: list[float] = []
        commits: list[float] = []
        hashing: list[float] = []  # the writer's parallel checksums per snapshot
        committing: list[float] = []  # payload, manifest, the older one's release
        snap_steps: list[bool] = []
        intervals: list[int] = []  # the agreed interval after each step (auto: it moves)
        stalls: list[float] = []  # CUDA: the device's wait for a snapshot's copies
        mirror_s: list[float] = []  # CUDA: the training stream's copy into the mirror

        last_was_snap = [False]

        def ek_after(i: int) -> None:
            if last_was_snap[0] and tier.cost_s is not None:
                # final now: this step's optimizer pre-hook waited for its deferred copy
                blocked.append(tier.cost_s)
            before, skipped = len(tier.written), len(tier.skipped)
            due = tier.due(state.step + 1)
            known = list(getattr(tier, "device_stalls", ()))
            known_m = list(getattr(tier, "mirror_copy_s", ()))
            ckpt.step(1)
            intervals.append(tier.interval)
            # the previous snapshot's, known at this one
            stalls.extend(list(getattr(tier, "device_stalls", ()))[len(known):])
            mirror_s.extend(list(getattr(tier, "mirror_copy_s", ()))[len(known_m):])
            taken = due and len(tier.skipped) == skipped  # not skipped for want of a file
            snap_steps.append(taken)
            last_was_snap[0] = taken
            if len(tier.written) > before:
                commits.append(tier.commit_latency_s)
                hashing.append(tier.last_hash_s)
                committing.append(tier.last_commit_s)

        arms["ek"] = ek_after
        dcps: dict[str, DcpArm] = {}
        if not args.no_dcp:
            dcps["dcp"] = DcpArm(loop, work, pinned=False)
            if cuda:
                dcps["dcp_pinned"] = DcpArm(loop, work, pinned=True)
        for name, arm in dcps.items():
            arms[name] = (lambda a: (lambda i: a.save() if (i + 1) % every == 0 else None))(arm)

        # The first snapshots make the two snapshot files (and on CUDA register them as
        # pinned memory): a cost paid once per run, measured apart from the steady state.
        warmup: dict[str, Any] | None = None
        if not args.no_warmup:
            wsteps = 2 * every + 2
            t0 = time.perf_counter()
            wtimes = run_block(loop, wsteps, ek_after)
            # a large CUDA state skips its snapshots until the writer made its first
            # file: go on until both files exist (at most 20 more intervals)
            for _ in range(20):
                tier.wait()
                if tier._slots is None or tier._slots.made >= 2 or not tier.enabled:
                    break
                wtimes += run_block(loop, every, ek_after)
                wsteps += every
            before = len(tier.written)
            tier.wait()
            if len(tier.written) > before:
                commits.append(tier.commit_latency_s)
            warmup = {"steps": wsteps, "wall_s": round(time.perf_counter() - t0, 3),
                      "max_step_s": round(max(wtimes), 4), "written": len(tier.written),
                      "skipped": list(tier.skipped),
                      "blocked_s": [round(b, 4) for b in blocked],
                      "commit_s": [round(c, 4) for c in commits]}
            for kept in (blocked, commits, hashing, committing, snap_steps, intervals, stalls,
                         mirror_s):
                kept.clear()
            last_was_snap[0] = False
        written0, direct0, skipped0 = len(tier.written), tier.direct, len(tier.skipped)

        times: dict[str, list[float]] = {k: [] for k in arms}
        cpu: dict[str, float] = {k: 0.0 for k in arms}  # process CPU seconds, all threads
        ek_times_snap: list[tuple[float, bool]] = []
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for name in order:
                n0 = len(snap_steps)
                c0 = time.process_time()
                t = run_block(loop, block, arms[name])
                times[name] += t
                if name == "ek":
                    ek_times_snap += list(zip(t, snap_steps[n0:]))
                    last_was_snap[0] = False  # its cost is not final: not counted
                    before = len(tier.written)
                    tier.wait()  # untimed: no write spills into the next block
                    if len(tier.written) > before:
                        commits.append(tier.commit_latency_s)
                        hashing.append(tier.last_hash_s)
                        committing.append(tier.last_commit_s)
                elif name in dcps:
                    dcps[name].drain()
                cpu[name] += time.process_time() - c0  # the block's writes included
                gc.collect()
        written, replaced = len(tier.written) - written0, len(tier.replaced)
        skipped = len(tier.skipped) - skipped0
        direct = tier.direct - direct0
        files_made = tier._slots.made if tier._slots is not None else None
        identity = tier.identity
        # closed as a failing run is (its snapshots stay for the restore below; the
        # last step's state is written if no snapshot holds it), not as a finished one
        ckpt.abandon()

        # the tier's load alone: map the file, verify its chunks, views (CPU) or the
        # copy to the device through the registered mapping (CUDA)
        from elastic_kit.snapshot import SnapshotTier

        probe = SnapshotTier(os.path.join(work, "durable"), info=ek.DistInfo(run_id="bench"),
                             every=every, identity=identity)
        t0 = time.perf_counter()
        probed = probe.load(map_location=args.device if cuda else None)
        if cuda:
            torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        load_phases = {k: round(v, 4)
                       for k, v in getattr(probe, "last_load_phases", {}).items()}
        assert probed is not None
        del probed
        probe.close(remove=False)

        # restore into a fresh model, from this node's memory
        loop2 = Loop(args)
        loop2.step()
        ck2 = ek.Checkpointer(ek.TrainState(loop2.model, loop2.opt),
                              os.path.join(work, "durable"), handle_signals=False,
                              snapshot_every=every, info=ek.DistInfo(run_id="bench"))
        t0 = time.perf_counter()
        ck2.restore(map_location=args.device if cuda else None)
        if cuda:
            torch.cuda.synchronize()
        restore_s = time.perf_counter() - t0
        restored_from = ck2.restored_from
        restart = after_restore(loop2, ck2, every)
        ck2.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    plain_med = statistics.median(times["plain"])
    ek_snap_times = [t for t, s in ek_times_snap if s] or [0.0]
    # none beyond the median (a quick run's noise can make every snapshot step shorter):
    # no excess, not a negative one
    excess = max(0.0, max(ek_snap_times) - plain_med)
    res: dict[str, Any] = {
        "claim": "snapshot_cost",
        "baseline": "the same loop without snapshots (interleaved blocks); DCP async_save",
        "device": args.device,
        "state_bytes": nbytes,
        "every": "auto" if auto else every,
        "ek_interval": {"first": intervals[0], "last": intervals[-1],
                        "median": statistics.median(intervals)} if intervals else None,
        "wait_s": args.wait_s,
        "steps_per_kind": len(times["plain"]),
        "plain_step_s": round(plain_med, 4),
        "ek_step_s": round(statistics.median(times["ek"]), 4),
        "copy_s": round(copy_s, 4),
        "h2d_s": round(h2d_s, 4),
        "ek_blocked_s": _common.spread(blocked) if blocked else None,
        "ek_max_step_excess_s": round(excess, 4),
        "ek_device_stall_s": _common.spread(stalls) if stalls else None,
        "ek_relay_bytes": getattr(getattr(tier, "relay", None), "budget", None),
        "ek_mirror_copy_s": _common.spread(mirror_s) if mirror_s else None,
        "ek_mirror_bytes": getattr(getattr(tier, "mirror", None), "nbytes", None),
        "ek_commit_s": _common.spread(commits) if commits else None,
        "ek_written": written,
        "ek_warmup": warmup,
        "ek_cpu_s_per_snapshot": round((cpu["ek"] - cpu["plain"]) / max(1, written), 4),
        "ek_replaced": replaced,
        "ek_skipped": skipped,
        "ek_direct": direct,
        "ek_files_made": files_made,
        "ek_hash_s": _common.spread(hashing) if hashing else None,
        "ek_commit_write_s": _common.spread(committing) if committing else None,
        "load_s": round(load_s, 4),
        "load_phases": load_phases,
        "restore_s": round(restore_s, 4),
        "restored_from": restored_from,
        "restart": restart,
        "load_avg_1m_start": load_start,
        "load_avg_1m": load_start,
        "machine": _common.machine(),
    }
    for name, arm in dcps.items():
        res[f"{name}_blocked_s"] = _common.spread(arm.blocked) if arm.blocked else None
        res[f"{name}_commit_s"] = _common.spread(arm.commit) if arm.commit else None
        res[f"{name}_failed"] = arm.failed
        res[f"ratio_{name}_vs_plain"] = round(sum(times["plain"]) / sum(times[name]), 4)
    res["ratio_ek_vs_plain"] = round(sum(times["plain"]) / sum(times["ek"]), 4)
    res["ratio_blocked_vs_copy"] = (round(statistics.median(blocked) / copy_s, 3)
                                    if blocked and copy_s > 0 else None)
    res["ratio_max_blocked_vs_two_copies"] = (round(max(blocked) / (2 * copy_s), 3)
                                              if blocked and copy_s > 0 else None)
    res["ratio_max_excess_vs_two_copies"] = round(excess / (2 * copy_s), 3) if copy_s else None
    res["ratio_restore_vs_h2d"] = round(restore_s / h2d_s, 3) if h2d_s else None
    res["ratio_load_vs_h2d"] = round(load_s / h2d_s, 3) if h2d_s else None
    res["ratio_restart_blocked_vs_blocked"] = (
        round(restart["blocked_s"] / statistics.median(blocked), 3)
        if blocked and restart["blocked_s"] is not None else None)
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
