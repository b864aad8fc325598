"""Training throughput through ElasticLoop vs a plain DDP loop (2 gloo workers, CPU).

Claim (issue 6, claim 1): the ImageNet example's training step run through
elastic_kit (:class:`~elastic_kit.loop.ElasticLoop` + ``ElasticDistributedSampler``
+ ``CheckpointStore``) is at most 1 % slower than the same model, data and DDP in a
plain loop with torch's ``DistributedSampler`` and no checkpoints; at most 3 % slower
with a non-blocking checkpoint every 50 steps.

Setting: 2 gloo ranks on the CPU (``elastic_kit.testing.spawn_multi_process``), one
torch thread each, ResNet-18 (torchvision, 10 classes) on 3x32x32 images, 32 images
per rank per step (global batch 64), SGD with momentum, ``num_workers=0``. The data
is a synthetic map-style dataset (a pool of 512 random images, sample ``i`` is
``pool[i % 512]``, label ``i % 10``) of 1e6 samples, so no epoch ends and data
loading costs the same small, constant amount on both sides.

The plain loop and elastic_kit live in the same two processes, each with its own
DDP model, optimizer and data pipeline, and their steps alternate one by one: the
``ElasticLoop``'s ``on_step_end`` hook runs one plain step (and times it), so each
elastic step is timed from the end of one hook to the start of the next, i.e. with
everything the loop does per step (its per-step collective, sample audit, sampler
advance, progress accounting, checkpoint trigger and the blocking part of a save).
Adjacent steps see the same machine load, which matters on a shared 2-core box.

- ``plain``: DDP + ``DistributedSampler`` + ``DataLoader``, mean cross-entropy loss.
- ``ek``: ``ElasticLoop`` on a ``TrainState`` with a ``CheckpointStore`` attached,
  no periodic checkpoint.
- ``ek_ckpt``: the same (a second run, again paired step by step with plain steps)
  plus a non-blocking checkpoint every ``--ckpt-every`` steps (model + momentum +
  loop state, ~90 MB, local disk). Caveat: rank 0's background copy and write
  overlap the plain steps that follow as well as the elastic ones, so part of their
  CPU cost is charged to the baseline; the blocking part (time in ``save()`` and in
  ``wait_staged()`` before the next optimizer step) is charged to ek only, and is
  reported per save against one synchronous save of the same state.

Reported: throughput of each (images / summed step time over ``--steps`` timed steps
after ``--warmup``) and the ratio ek / plain (1.0 = no overhead; the goal is >= 0.99
without and >= 0.97 with a checkpoint every 50 steps), plus the median of per-step
ratios. When ``--ckpt-every`` is not 50 (``--quick``), ``ek_ckpt`` is also
extrapolated to one checkpoint every 50 steps from the measured extra time per save.

Usage::

    .venv/bin/python benchmarks/bench_loop_overhead.py            # 150 paired steps, ckpt every 50
    .venv/bin/python benchmarks/bench_loop_overhead.py --quick    # 30 paired steps, ckpt every 15
"""

from __future__ import annotations

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
    import torchvision

    torch.manual_seed(0)
    if arch == "tinycnn":
        from torch import nn

        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(16, CLASSES))
    return torchvision.models.get_model(arch, weights=None, num_classes=CLASSES)


class _NoRestore:
    """A CheckpointStore that never restores: each timed block continues the live
    state instead of rolling back to the newest checkpoint (restore is a one-off per
    worker life; bench_restore_broadcast.py measures it)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.blocked_s: list[float] = []  # per save: time in save() + in wait_staged()

    def load(self, **kwargs: Any) -> None:
        return None

    def save(self, *args: Any, **kwargs: Any) -> Any:
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


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import logging

    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    import elastic_kit as ek
    from elastic_kit.loop import ElasticLoop, LoopConfig, StepInfo, TrainState

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    info = ek.init_distributed()
    data = SyntheticImages(cfg["image_size"])
    per_rank = cfg["batch"]
    G = per_rank * info.world_size
    warm, n, every = cfg["warmup"], cfg["steps"], cfg["ckpt_every"]

    # --- plain DDP -------------------------------------------------------------------
    plain_model = ek.wrap_ddp(_model(cfg["arch"]))
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9,
                                weight_decay=1e-4)
    sampler = DistributedSampler(data, num_replicas=info.world_size, rank=info.rank, seed=0)
    sampler.set_epoch(0)
    plain_iter = iter(DataLoader(data, batch_size=per_rank, sampler=sampler, num_workers=0))
    criterion = nn.CrossEntropyLoss()

    def plain_step() -> float:
        t0 = time.perf_counter()
        x, y = next(plain_iter)
        loss = criterion(plain_model(x), y)
        plain_opt.zero_grad(set_to_none=True)
        loss.backward()
        plain_opt.step()
        float(loss.detach())  # the plain script reads its loss too, as the loop does
        return time.perf_counter() - t0

    # --- elastic_kit, paired step by step with plain steps ---------------------------
    per_sample = nn.CrossEntropyLoss(reduction="none")

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return per_sample(model(x), y)

    def paired(name: str, ckpt_every: int | None) -> dict[str, list[float]]:
        model = ek.wrap_ddp(_model(cfg["arch"]))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        state = TrainState(model, opt)
        store = ek.CheckpointStore(os.path.join(cfg["dir"], name), keep_last=2)
        ek_t: list[float] = []
        plain_t: list[float] = []
        last_end = [0.0]

        def on_step(state: TrainState, step: StepInfo) -> None:
            start = time.perf_counter()
            if step.step > warm:  # step `warm` ends the warm-up; time the ones after it
                ek_t.append(start - last_end[0])
            p = plain_step()
            if step.step > warm:
                plain_t.append(p)
            last_end[0] = time.perf_counter()

        wrapped = _NoRestore(store)
        ElasticLoop(
            state, data, loss_fn=loss_fn, store=wrapped, on_step_end=on_step,
            config=LoopConfig(epochs=1, global_batch_size=G, micro_batch_size=per_rank,
                              max_steps=warm + n, checkpoint_every_steps=ckpt_every,
                              checkpoint_at_epoch_end=False, checkpoint_at_exit=False,
                              blocking=False, log_every=0, progress_bar=False,
                              handle_signals=False)).run()
        store.wait()
        saves = sum(1 for s in range(warm + 1, warm + n) if ckpt_every and s % ckpt_every == 0)
        mb = None
        sync_s = None
        if ckpt_every:  # one synchronous save of the same state, for the blocked ratio
            t0 = time.perf_counter()
            store.save(state.state_dict(), step=10**9, blocking=True)
            sync_s = time.perf_counter() - t0
        if info.rank == 0 and ckpt_every:
            infos = store.list()
            d = os.path.join(cfg["dir"], name)
            mb = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(d)
                     for f in fs) / 1e6 / max(len(infos), 1)
        store.close()
        return {"ek": ek_t, "plain": plain_t, "saves": saves, "ckpt_mb": mb,
                "blocked_s": wrapped.blocked_s, "sync_save_s": sync_s}

    out = {"ek": paired("ek", None), "images_per_step": G, "rank": info.rank}
    if every:
        out["ek_ckpt"] = paired("ek_ckpt", every)
    return out


def main() -> None:
    ap = _common.parser(__doc__, smoke=True)
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="images per rank per step")
    ap.add_argument("--steps", type=int, default=None, help="timed paired steps per variant")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    ap.add_argument("--ckpt-every", type=int, default=None,
                    help="non-blocking checkpoint period of the ek_ckpt variant (0: off)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: tmp)")
    args = ap.parse_args()
    if args.smoke:
        args.arch, args.batch = "tinycnn", 8
    steps = args.steps or (6 if args.smoke else 30 if args.quick else 150)
    warm = args.warmup or (2 if args.smoke else 3 if args.quick else 5)
    every = args.ckpt_every if args.ckpt_every is not None else (
        3 if args.smoke else 15 if args.quick else 50)
    # a save right after the warm-up, then every `every` steps inside the window
    load0 = _common.load_avg()

    from elastic_kit.testing import spawn_multi_process

    base = tempfile.mkdtemp(prefix="ek-bench-loop-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        cfg = {"arch": args.arch, "image_size": args.image_size, "batch": args.batch,
               "steps": steps, "warmup": warm, "ckpt_every": every, "dir": base}
        ranks = spawn_multi_process(2, _worker, cfg, timeout=3600)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - t0
    r0 = ranks[0]
    G = r0["images_per_step"]
    res: dict[str, Any] = {
        "claim": "loop_overhead", "method": "step-by-step pairing (plain step in on_step_end)",
        "arch": args.arch, "image_size": args.image_size, "ranks": 2,
        "batch_per_rank": args.batch, "timed_steps": steps, "warmup_steps": warm,
        "ckpt_every_steps": every or None,
    }
    lines = []
    for name in ("ek", "ek_ckpt"):
        if name not in r0:
            continue
        # DDP keeps the ranks in lockstep: a step lasts as long as its slower rank
        ek_t = [max(r[name]["ek"][i] for r in ranks) for i in range(steps)]
        pl_t = [max(r[name]["plain"][i] for r in ranks) for i in range(steps)]
        ips_ek, ips_pl = G * steps / sum(ek_t), G * steps / sum(pl_t)
        ratio = ips_ek / ips_pl
        res[f"{name}_images_per_s"] = round(ips_ek, 2)
        res[f"{name}_paired_plain_images_per_s"] = round(ips_pl, 2)
        res[f"ratio_{name}_vs_plain"] = round(ratio, 4)
        res[f"ratio_{name}_vs_plain_median_per_step"] = round(
            statistics.median(p / e for p, e in zip(pl_t, ek_t)), 4)
        res[f"{name}_step_s"] = _common.spread(ek_t)
        res[f"{name}_paired_plain_step_s"] = _common.spread(pl_t)
        lines.append(f"  {name:<8} {ips_ek:7.2f} img/s vs plain {ips_pl:7.2f} img/s: ratio "
                     f"{ratio:.4f}")
        if name == "ek_ckpt":
            saves = r0[name]["saves"]
            res["saves_in_window"] = saves
            res["ckpt_mb"] = round(r0[name]["ckpt_mb"] or 0, 1)
            extra = sum(ek_t) - sum(pl_t)
            # the same comparison without saves is the ek run: remove its own overhead
            extra_ek = (res["ek_images_per_s"] and
                        (sum(pl_t) / steps) * (1 / res["ratio_ek_vs_plain"] - 1) * steps)
            per_save = (extra - extra_ek) / saves if saves else 0.0
            res["ckpt_extra_s_per_save"] = round(per_save, 3)
            # what a save blocks the training thread for (rank 0 writes): time in
            # save() + in wait_staged() before the next optimizer step, per save,
            # against one synchronous save of the same state
            blocked = r0[name]["blocked_s"]
            sync_s = r0[name]["sync_save_s"]
            if blocked and sync_s:
                res["ckpt_blocked_s_per_save"] = round(statistics.median(blocked), 4)
                res["ckpt_sync_save_s"] = round(sync_s, 4)
                res["ratio_ckpt_blocked_vs_sync"] = round(statistics.median(blocked) / sync_s, 3)
                lines.append(f"  a save blocks rank 0 for {statistics.median(blocked):.4f} s "
                             f"(median of {len(blocked)}), a sync save takes {sync_s:.3f} s: "
                             f"ratio {res['ratio_ckpt_blocked_vs_sync']:.3f}")
            if every != 50:
                step_s = sum(pl_t) / steps
                res["ratio_ek_ckpt_vs_plain_extrapolated_every_50"] = round(
                    1 / ((1 / res["ratio_ek_vs_plain"]) + per_save / (50 * step_s)), 4)
    res["wall_s"] = round(wall, 1)
    res["load_avg_1m_start"] = load0
    res.update(_common.machine())
    print(f"{args.arch} {args.image_size}px, 2 gloo ranks x {args.batch} images, {steps} "
          f"paired steps per variant:")
    print("\n".join(lines))
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
