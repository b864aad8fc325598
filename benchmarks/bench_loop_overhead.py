"""Training throughput through ElasticLoop vs a plain DDP loop, over whole save periods.

Claim (claim 1): the ImageNet example's training step run through elastic_kit
(:class:`~elastic_kit.ElasticLoop` + ``ElasticDistributedSampler`` +
``CheckpointStore``) is at most 1 % slower than the same model, data and DDP in a
plain loop with torch's ``DistributedSampler`` and no checkpoints; at most 3 % slower
with a non-blocking checkpoint every 50 steps, counting everything the checkpoint
costs over its whole period (the blocking part in ``save()`` and ``wait_staged()``,
and the background copy and write competing with training for CPU, memory bandwidth
and, on a GPU, the copy engine).

Setting: 2 ranks (``elastic_kit.testing.spawn_multi_process``; gloo on the CPU, one
torch thread each, or ``--device cuda``: NCCL, one rank per GPU), ResNet-18
(torchvision, 10 classes) or ``--arch tinycnn`` (a conv layer and a linear one, a few
ms per step: the per-step overhead of the loop and the fixed cost of a save weigh
most there) on 3x32x32 images, 32 images per rank per step, SGD with momentum,
``num_workers=0``. The data is a synthetic map-style dataset (a pool of 512 random
images, sample ``i`` is ``pool[i % 512]``, label ``i % 10``) of 1e6 samples, so no
epoch ends and data loading costs the same small, constant amount on both sides.
The workers carry torchrun's environment, so the elastic loop takes its default
in-memory snapshots (``--snapshot-every auto``: as often as costs at most 1% of the
training time) in both ``ek`` kinds; ``--snapshot-every 0`` measures without them.

Method: interleaved blocks. The plain loop and elastic_kit live in the same processes,
each with its own DDP model, optimizer and data pipeline. One ``ElasticLoop`` run is
cut into blocks of ``--periods`` x ``--ckpt-every`` steps; blocks alternate between
checkpointing every ``--ckpt-every`` steps (``ek_ckpt``) and not checkpointing (``ek``)
and, after each, the loop's ``on_step_end`` hook runs a plain block of as many steps:
after an ``ek_ckpt`` block a plain loop that ``torch.save``s model and optimizer on
rank 0 every ``--ckpt-every`` steps (``plain_ckpt``: what the pytorch/elastic example
does, synchronously, to a temporary file renamed into place; the file and, after the
rename, its directory fsync'ed, as durable as the store's save), after an ``ek`` block a
plain loop without checkpoints (``plain``: the physical limit). The plain step is the
strongest fair one: the same pinned, non-blocking copies to the device as the loop's,
and no value read off the device per step (a ``.item()`` / ``float(loss)`` per step is a
device sync on CUDA: the CPU's data loading and kernel launches for the next step then
wait for the GPU instead of overlapping its work; the loop reads its loss at most
every 0.5 s, for a progress bar, and with ``log_every=0`` never). A checkpointing
block holds ``--periods`` saves (the first half a period after its start) and ends by
waiting for its last save to commit (timed, inside the block), so each block pays for
whole save periods and no background write spills into the next block, whichever it
is; the last save of a block has only half a period to overlap training, which, if
anything, overcharges the checkpointing blocks. The order of the two kinds alternates from one
cycle to the next; the first ``--warmup`` steps of each loop are not timed.

Reported, from the summed block times (a block lasts as long as its slowest rank):

- ``ratio_ek_vs_plain``: ElasticLoop without checkpoints vs the plain loop (goal >= 0.99);
- ``ratio_ek_ckpt_vs_plain``: with a non-blocking checkpoint every ``--ckpt-every``
  steps vs the plain loop without any (the headline; goal >= 0.97 at every 50 steps);
- ``ratio_ek_ckpt_vs_plain_ckpt``: vs the plain loop with its synchronous ``torch.save``;
- ``*_ci95``: the mean of the per-block (per-cycle) values with its 95% interval: on a
  busy 2-core machine a block's ratio varies by several percent, so a goal is shown met
  only when the interval lies above it;
- ``ckpt_lost_s_per_save``: throughput lost per save period, in seconds of training,
  ``(ek_ckpt time - ek time) / saves``, next to ``ckpt_blocked_s_per_save`` (time
  inside ``save()`` + ``wait_staged()``, median) and one synchronous save of the same
  state: the difference between lost and blocked is what the background write costs;
- ``ckpt_cpu_s_per_save``: the CPU seconds a save adds over its period, all ranks and
  threads (process CPU time of the ``ek_ckpt`` blocks minus the ``ek`` blocks', per
  save), ``ckpt_side_thread_cpu_s_per_save`` the part outside the training threads
  (the save's own threads), and ``cpu_busy_fraction`` per kind of block (CPU time over
  wall time x cores): less noisy than wall time, and what the save takes from cores
  that training keeps busy; ``ckpt_cpu_s_alone``: the CPU of one non-blocking save
  of the same state measured with training idle (the writing rank, every thread), and
  ``ckpt_cpu_alone_fraction_of_period`` that over the training time of one period.
- ``ckpt_lost_fraction_of_cost_period`` (and its ``_ci95``): the seconds lost per save
  over the training time of ``--cost-period`` steps (default: ``--ckpt-every``).

Short blocks for the save's cost. Everything a save costs happens inside the block
that holds it: the save starts half a period in, and the block ends by waiting for it
to commit. So the seconds lost per save need blocks only as long as a save and its
write, not the period the goal is stated for, and short blocks give many more pairs
in the same time (the noise of this VM is per block, so the interval shrinks with
the number of pairs). ``--ckpt-every 8 --periods 1 --cycles 40 --cost-period 50
--snapshot-every 0`` measures a ResNet-18 save in 8-step blocks and states its cost
as a share of a 50-step period (snapshots off: they would land in either kind of
block at random and only add noise).

Usage::

    .venv/bin/python benchmarks/bench_loop_overhead.py                 # ResNet-18, ckpt every 50
    .venv/bin/python benchmarks/bench_loop_overhead.py --arch tinycnn  # ~5 ms steps
    .venv/bin/python benchmarks/bench_loop_overhead.py --quick         # ckpt every 10, < 2 min
    .venv/bin/python benchmarks/bench_loop_overhead.py --device cuda   # NCCL, one rank per GPU
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

import _common

IMAGES, CLASSES, POOL = 10**6, 10, 512


class SyntheticImages(torch.utils.data.Dataset):
    """``ds[i] = (pool[i % POOL], i % CLASSES)``: 1e6 virtual samples, constant cost."""

    def __init__(self, size: int, n: int = IMAGES) -> None:
        g = torch.Generator().manual_seed(0)
        self.pool = torch.randn(POOL, 3, size, size, generator=g)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.pool[i % POOL], i % CLASSES


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "tinycnn":
        from torch import nn

        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(16, CLASSES))
    import torchvision

    return torchvision.models.get_model(arch, weights=None, num_classes=CLASSES)


class _NoRestore:
    """A CheckpointStore that never restores: each timed block continues the live
    state instead of rolling back to the newest checkpoint (restore is a one-off per
    worker life; bench_restore_broadcast.py measures it)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.blocked_s: list[float] = []  # per save: time in save() + in wait_staged()
        self.saves = 0

    def __getattr__(self, name: str) -> Any:  # everything else: the store's own
        return getattr(self.store, name)

    def load(self, **kwargs: Any) -> None:
        return None

    def save(self, *args: Any, **kwargs: Any) -> Any:
        self.saves += 1
        t0 = time.perf_counter()
        out = self.store.save(*args, **kwargs)
        self.blocked_s.append(time.perf_counter() - t0)
        return out

    def wait_staged(self) -> None:
        t0 = time.perf_counter()
        self.store.wait_staged()
        if self.blocked_s:
            self.blocked_s[-1] += time.perf_counter() - t0

    def wait(self) -> Any:
        return self.store.wait()

    def wait_local(self) -> Any:
        return self.store.wait_local()


KINDS = ("ek", "ek_ckpt", "plain", "plain_ckpt")


def _block_kinds(cycles: int) -> list[str]:
    """Checkpointing or not, per ElasticLoop block: the order alternates per cycle."""
    out: list[str] = []
    for c in range(cycles):
        out += ["ek_ckpt", "ek"] if c % 2 == 0 else ["ek", "ek_ckpt"]
    return out


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import logging

    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    import elastic_kit as ek

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    info = ek.init_distributed(backend=cfg["backend"])
    device = info.device
    cuda = device.type == "cuda"
    data = SyntheticImages(cfg["image_size"])
    per_rank = cfg["batch"]
    G = per_rank * info.world_size
    every, block = cfg["ckpt_every"], cfg["ckpt_every"] * cfg["periods"]
    kinds = _block_kinds(cfg["cycles"])
    warm = cfg["warmup"]  # half a period past a save step: see main()

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    # --- plain DDP -------------------------------------------------------------------
    plain_model = ek.wrap_ddp(_model(cfg["arch"]))
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9,
                                weight_decay=1e-4)
    sampler = DistributedSampler(data, num_replicas=info.world_size, rank=info.rank, seed=0)
    sampler.set_epoch(0)
    plain_iter = iter(DataLoader(data, batch_size=per_rank, sampler=sampler, num_workers=0,
                                 pin_memory=cuda))
    criterion = nn.CrossEntropyLoss()
    plain_path = os.path.join(cfg["dir"], "plain.pt")

    plain_loss: list[torch.Tensor] = []  # the newest step's loss, never read per step

    def plain_step() -> None:
        x, y = next(plain_iter)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = criterion(plain_model(x), y)
        plain_opt.zero_grad(set_to_none=True)
        loss.backward()
        plain_opt.step()
        # kept, not read: reading it (float(loss)) would sync with the GPU every step,
        # which the loop does not do; the loop keeps its loss as a tensor the same way
        plain_loss[:] = [loss.detach()]

    def plain_save() -> None:  # the pytorch/elastic example: rank 0, torch.save, rename
        if info.rank == 0:
            # as durable as the store's save (payload fsync'ed, the rename's directory
            # fsync'ed): both sides run with the same settings
            with open(plain_path + ".tmp", "wb") as f:
                torch.save({"model": ek.unwrap_model(plain_model).state_dict(),
                            "optimizer": plain_opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(plain_path + ".tmp", plain_path)
            fd = os.open(cfg["dir"], os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def plain_block(checkpoint: bool) -> tuple[float, float, float]:
        """(wall s, CPU s of this process, CPU s of this thread) of one plain block."""
        t0, c0, m0 = now(), time.process_time(), time.thread_time()
        for i in range(block):
            if checkpoint and i % every == every // 2:  # where the ek block saves
                plain_save()
            plain_step()
        return now() - t0, time.process_time() - c0, time.thread_time() - m0

    # --- elastic_kit: one run cut into blocks, a plain block after each --------------
    per_sample = nn.CrossEntropyLoss(reduction="none")

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return per_sample(model(x), y)

    model = ek.wrap_ddp(_model(cfg["arch"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    state = ek.TrainState(model, opt)
    store = ek.CheckpointStore(os.path.join(cfg["dir"], "ek"), keep_last=2)
    wrapped = _NoRestore(store)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}  # this process's CPU s, all threads
    cpu_main: dict[str, list[float]] = {k: [] for k in KINDS}  # the training thread's only
    end_wait: list[float] = []
    saves_per_block: list[int] = []
    mark = {"t": 0.0, "cpu": 0.0, "cpu_main": 0.0, "saves": 0}
    loop: Any = None

    def set_every(value: int | None) -> None:
        loop.config.checkpoint = dataclasses.replace(loop.config.checkpoint, every_steps=value)
        if getattr(loop, "checkpointer", None) is not None:  # the loop's Checkpointer
            loop.checkpointer.every_steps = value

    def start_block(j: int) -> None:
        set_every(every if j < len(kinds) and kinds[j] == "ek_ckpt" else None)
        mark["saves"] = wrapped.saves
        mark["t"] = now()
        mark["cpu"] = time.process_time()
        mark["cpu_main"] = time.thread_time()

    def on_step(state: Any, step: Any) -> None:
        s = step.step
        if s < warm:
            return
        if s == warm:
            for _ in range(cfg["plain_warmup"]):  # the plain loop's warm-up
                plain_step()
            start_block(0)
            return
        if (s - warm) % block:
            return
        j = (s - warm) // block - 1  # the block that ends here
        kind = kinds[j]
        if kind == "ek_ckpt":
            t0 = now()
            store.wait()  # the block's last save commits inside the block
            end_wait.append(now() - t0)
        times[kind].append(now() - mark["t"])
        cpu[kind].append(time.process_time() - mark["cpu"])
        cpu_main[kind].append(time.thread_time() - mark["cpu_main"])
        saves_per_block.append(wrapped.saves - mark["saves"])
        plain_kind = "plain_ckpt" if kind == "ek_ckpt" else "plain"
        wall_s, cpu_s, main_s = plain_block(kind == "ek_ckpt")
        times[plain_kind].append(wall_s)
        cpu[plain_kind].append(cpu_s)
        cpu_main[plain_kind].append(main_s)
        start_block(j + 1)

    loop = ek.ElasticLoop(
        state, data, loss_fn=loss_fn, store=wrapped, on_step_end=on_step,
        config=ek.LoopConfig(epochs=1, global_batch_size=G, micro_batch_size=per_rank,
                             max_steps=warm + block * len(kinds), checkpoint_at_exit=False,
                             checkpoint=ek.CheckpointerConfig(
                                 every_steps=None, save_at_epoch_end=False, blocking=False,
                                 handle_signals=False, snapshot_every=cfg["snapshot_every"]),
                             log_every=0, progress_bar=False, pin_memory=cuda))
    loop.run()
    store.wait()
    expected = [cfg["periods"] if k == "ek_ckpt" else 0 for k in kinds]
    if saves_per_block != expected:  # the loop did not follow the per-block setting
        raise RuntimeError(f"saves per block {saves_per_block}, expected {expected}: "
                           "ElasticLoop no longer reads checkpoint_every_steps per step")
    t0 = time.perf_counter()  # one synchronous save of the same state, for the ratio
    store.save(state.state_dict(), step=10**9, blocking=True)
    sync_s = time.perf_counter() - t0
    # The CPU one non-blocking save costs (every thread of this process), measured
    # with training idle, as the loop saves (parameters and optimizer state copied on
    # the save thread): what a save can take from cores that training keeps busy,
    # without the blocks' noise.
    later = list(model.parameters()) + [v for st in opt.state.values() for v in st.values()
                                        if isinstance(v, torch.Tensor)]
    save_cpu: list[float] = []
    for i in range(3):
        c0 = time.process_time()
        store.save(state.state_dict(), step=10**9 + 1 + i, blocking=False, copy_later=later)
        store.wait_staged()
        store.wait()
        save_cpu.append(time.process_time() - c0)
    mb = None
    if info.rank == 0:
        d = os.path.join(cfg["dir"], "ek")
        infos = store.list()
        mb = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(d)
                 for f in fs) / 1e6 / max(len(infos), 1)
    store.close()
    return {"times": times, "cpu": cpu, "cpu_main": cpu_main, "kinds": kinds,
            "images_per_step": G, "rank": info.rank,
            "blocked_s": wrapped.blocked_s, "end_wait_s": end_wait, "sync_save_s": sync_s,
            "save_cpu_s": save_cpu,
            "ckpt_mb": mb, "device": str(device), "backend": info.backend,
            "snapshot_interval": (loop.checkpointer.snapshots.interval
                                  if loop.checkpointer.snapshots is not None else None),
            "world_size": info.world_size}


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--arch", default="resnet18", help="resnet18 (default), tinycnn, or any "
                                                        "torchvision model name")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=None, help="images per rank per step (32)")
    ap.add_argument("--ckpt-every", type=int, default=None,
                    help="checkpoint period in steps (default 50, quick 10, smoke 2)")
    ap.add_argument("--cost-period", type=int, default=None,
                    help="steps of training the lost seconds per save are a share of "
                         "(default: --ckpt-every)")
    ap.add_argument("--periods", type=int, default=None,
                    help="save periods per block (default 2, quick 2, smoke 1)")
    ap.add_argument("--cycles", type=int, default=None,
                    help="pairs of (checkpointing, not) blocks (default 3, quick 2, smoke 1)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps of each loop first (default 5; the elastic loop's "
                         "is rounded up to a multiple of --ckpt-every)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: gloo, 1 thread per rank; cuda: NCCL, one rank per GPU")
    ap.add_argument("--ranks", type=int, default=None,
                    help="worker processes (default 2; with cuda at most the GPU count)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: tmp)")
    ap.add_argument("--snapshot-every", default="auto",
                    help="the elastic loop's in-memory snapshots (LoopConfig.snapshot_every): "
                         "'auto' (the default, what users get; the workers run with "
                         "torchrun's environment), a number of steps, or 0 (off)")
    args = ap.parse_args()
    snapshot_every = args.snapshot_every if args.snapshot_every == "auto" else int(
        args.snapshot_every)
    if args.smoke:
        args.arch = "tinycnn"
    batch = args.batch or (8 if args.smoke else 32)
    every = args.ckpt_every or (2 if args.smoke else 10 if args.quick else 50)
    periods = args.periods or (1 if args.smoke else 2)
    cycles = args.cycles or (1 if args.smoke else 2 if args.quick else 3)
    if every < 2:
        ap.error("--ckpt-every must be >= 2")
    cost_period = args.cost_period or every
    if cost_period < 1:
        ap.error(f"--cost-period={cost_period}: expected a number of steps >= 1")
    plain_warm = args.warmup if args.warmup is not None else (2 if args.smoke else 5)
    # The loop saves at multiples of `every`; blocks start half a period after one,
    # so that whether a step's hook runs before or after its save does not matter:
    # a block holds `periods` saves, the first half a period in, and its last save
    # has half a period to finish before the block's closing wait (conservative).
    warm = max(1, -(-plain_warm // every)) * every + every // 2
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch.cuda.is_available() is False")
        ranks = args.ranks or min(2, torch.cuda.device_count())
        if ranks > torch.cuda.device_count():
            ap.error(f"--ranks={ranks}: NCCL needs one GPU per rank, "
                     f"{torch.cuda.device_count()} visible")
    else:
        ranks = args.ranks or 2
    load0 = _common.load_avg()

    from elastic_kit.testing import spawn_multi_process

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="ek-bench-loop-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        cfg = {"arch": args.arch, "image_size": args.image_size, "batch": batch,
               "ckpt_every": every, "periods": periods, "cycles": cycles, "warmup": warm,
               "plain_warmup": plain_warm, "dir": base, "snapshot_every": snapshot_every, "backend": "nccl" if args.device == "cuda" else "gloo"}
        out = spawn_multi_process(ranks, _worker, cfg, timeout=3600,
                                  cuda=args.device == "cuda")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - t0
    r0 = out[0]
    G = r0["images_per_step"]
    block = every * periods
    # DDP keeps the ranks in lockstep: a block lasts as long as its slowest rank
    per_kind = {k: [max(r["times"][k][i] for r in out) for i in range(len(r0["times"][k]))]
                for k in KINDS}
    total = {k: sum(v) for k, v in per_kind.items()}
    ips = {k: G * block * len(per_kind[k]) / total[k] for k in KINDS}
    saves = periods * len(per_kind["ek_ckpt"])
    lost = (total["ek_ckpt"] - total["ek"]) / saves
    # CPU seconds of all ranks' processes (every thread: training, gloo, the save's);
    # busy = that CPU over the cores the ranks had (wall x min(ranks, cores))
    cpu_total = {k: sum(sum(r["cpu"][k]) for r in out) for k in KINDS}
    cores = min(ranks, os.cpu_count() or 1)
    busy = {k: round(cpu_total[k] / (total[k] * cores), 3) for k in KINDS}
    save_cpu = (cpu_total["ek_ckpt"] - cpu_total["ek"]) / saves
    # the same for threads other than training's (the save's threads, gloo's, the
    # snapshot writer's): the difference is what the save ran beside training
    side = {k: sum(sum(r["cpu"][k]) - sum(r["cpu_main"][k]) for r in out) for k in KINDS}
    save_side_cpu = (side["ek_ckpt"] - side["ek"]) / saves
    # per block pair: the plain block's time over the elastic block's before it
    per_block = {k: [p / e for p, e in zip(per_kind["plain"], per_kind[k])]
                 for k in ("ek", "ek_ckpt")}
    cpu_alone = statistics.median(r0["save_cpu_s"])
    # the training time of --cost-period steps, from the blocks without saves
    cost_period_s = cost_period * total["ek"] / (block * len(per_kind["ek"]))
    lost_per_cycle = [(c - e) / periods for c, e in zip(per_kind["ek_ckpt"], per_kind["ek"])]
    blocked = r0["blocked_s"]
    res: dict[str, Any] = {
        "claim": "loop_overhead",
        "baseline": "plain DDP loop with DistributedSampler in the same processes, "
                    "interleaved blocks of whole save periods; without checkpoints (the "
                    "limit) and with a synchronous rank-0 torch.save every period "
                    "(file and directory fsync'ed, as durable as the store's save)",
        "method": "interleaved blocks of periods x ckpt_every steps",
        "arch": args.arch, "image_size": args.image_size, "device": args.device,
        "backend": r0["backend"], "ranks": ranks, "batch_per_rank": batch,
        "ckpt_every_steps": every, "periods_per_block": periods, "cycles": cycles,
        "block_steps": block, "warmup_steps": warm,
        "snapshot_every": snapshot_every, "snapshot_interval_final": r0["snapshot_interval"],
        "block_order": r0["kinds"],
        **{f"{k}_images_per_s": round(ips[k], 2) for k in KINDS},
        "ratio_ek_vs_plain": round(total["plain"] / total["ek"], 4),
        "ratio_ek_ckpt_vs_plain": round(total["plain"] / total["ek_ckpt"], 4),
        "ratio_ek_ckpt_vs_plain_ckpt": round(total["plain_ckpt"] / total["ek_ckpt"], 4),
        "ratio_ek_ckpt_vs_ek": round(total["ek"] / total["ek_ckpt"], 4),
        "ratio_ek_vs_plain_per_block": [round(x, 4) for x in per_block["ek"]],
        "ratio_ek_ckpt_vs_plain_per_block": [round(x, 4) for x in per_block["ek_ckpt"]],
        # per-block ratios: their mean and its 95% interval say whether a goal is
        # met, missed, or inside this machine's noise
        "ratio_ek_vs_plain_ci95": _common.mean_ci95(per_block["ek"]),
        "ratio_ek_ckpt_vs_plain_ci95": _common.mean_ci95(per_block["ek_ckpt"]),
        "block_s": {k: _common.spread(v) for k, v in per_kind.items()},
        "saves": saves,
        "ckpt_mb": round(r0["ckpt_mb"] or 0, 2),
        "ckpt_lost_s_per_save": round(lost, 4),
        # the same per cycle (its ek_ckpt block minus its ek block, per save)
        "ckpt_lost_s_per_save_ci95": _common.mean_ci95(lost_per_cycle),
        # the same as a share of --cost-period steps of training
        "cost_period_steps": cost_period,
        "cost_period_s": round(cost_period_s, 4),
        "ckpt_lost_fraction_of_cost_period": round(lost / cost_period_s, 4),
        "ckpt_lost_fraction_of_cost_period_ci95": _common.mean_ci95(
            [x / cost_period_s for x in lost_per_cycle]),
        # what a save costs in CPU over its period (all ranks, every thread): the
        # ek_ckpt blocks' process CPU time minus the ek blocks', per save
        "ckpt_cpu_s_per_save": round(save_cpu, 4),
        "ckpt_side_thread_cpu_s_per_save": round(save_side_cpu, 4),
        # one non-blocking save alone (training idle), the writing rank's process CPU
        # time, and that as a fraction of the training time of its period
        "ckpt_cpu_s_alone": round(cpu_alone, 4),
        "ckpt_cpu_alone_fraction_of_period": round(
            cpu_alone / (statistics.median(per_kind["ek"]) / periods), 4),
        "cpu_busy_fraction": busy,
        # the training thread's own CPU per step (mean over ranks): the loop's Python
        # and tensor work per step, without the scheduling noise of wall time
        "cpu_main_ms_per_step": {
            k: round(1e3 * statistics.fmean(sum(r["cpu_main"][k]) for r in out)
                     / (block * len(per_kind[k])), 4) for k in KINDS},
        "ckpt_blocked_s_per_save": round(statistics.median(blocked), 4) if blocked else None,
        "ckpt_end_of_block_wait_s": round(statistics.median(r0["end_wait_s"]), 4)
        if r0["end_wait_s"] else None,
        "ckpt_sync_save_s": round(r0["sync_save_s"], 4),
        "ratio_ckpt_blocked_vs_sync": round(statistics.median(blocked) / r0["sync_save_s"], 3)
        if blocked and r0["sync_save_s"] else None,
        # a signed difference of two timings, not a ratio: noise can make it negative
        "ckpt_lost_fraction_of_sync": round(lost / r0["sync_save_s"], 3)
        if r0["sync_save_s"] else None,
        "wall_s": round(wall, 1),
        "load_avg_1m_start": load0,
    }
    res.update(_common.machine())
    print(f"{args.arch} {args.image_size}px on {args.device}, {ranks} ranks x {batch} images, "
          f"{cycles} cycles of blocks of {block} steps (checkpoint every {every}):")
    for k in KINDS:
        print(f"  {k:<11} {ips[k]:9.2f} img/s")
    print(f"  ek vs plain {res['ratio_ek_vs_plain']:.4f}; ek_ckpt vs plain "
          f"{res['ratio_ek_ckpt_vs_plain']:.4f}, vs plain_ckpt "
          f"{res['ratio_ek_ckpt_vs_plain_ckpt']:.4f}")
    for k in ("ratio_ek_vs_plain_ci95", "ratio_ek_ckpt_vs_plain_ci95",
              "ckpt_lost_s_per_save_ci95", "ckpt_lost_fraction_of_cost_period_ci95"):
        if res[k] is not None:
            print(f"  {k[:-5]}: per-block mean {res[k]['mean']} "
                  f"(95% interval {res[k]['low']}..{res[k]['high']}, n={res[k]['n']})")
    print(f"  per save: {lost:.4f} s of training lost over its period, "
          f"{res['ckpt_blocked_s_per_save']} s blocked in save()+wait_staged(), a sync "
          f"save takes {r0['sync_save_s']:.4f} s; it used {save_cpu:.3f} CPU s "
          f"({save_side_cpu:.3f} s beside the training threads); cores busy "
          f"{busy}; alone a save uses {res['ckpt_cpu_s_alone']} CPU s, "
          f"{100 * res['ckpt_cpu_alone_fraction_of_period']:.2f}% of its period")
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
