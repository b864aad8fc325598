"""Training curve of an elastic 2 -> 3 -> 1 -> 2 run vs a fixed 2-worker run (fixed_global).

Claim (claim 6): under the ``fixed_global`` batch policy the trajectory does not
depend on the world size: a run whose worker group changes size 2 -> 3 -> 1 -> 2
(restarting from the checkpoint store each time) follows the same loss curve as an
uninterrupted 2-worker run and ends with the same parameters up to float summation
order.

Baseline (drift vs drift): the same elastic 2 -> 3 -> 1 -> 2 run done the naive way,
as a plain elastic DDP script does it: each worker keeps its batch (24 samples, the
fixed run's per-worker share at 2 workers), so the global batch follows the world
size (72 at 3 workers, 24 at 1) and the learning rate stays. Both elastic runs are
compared with the same fixed 2-worker run; ``ratio_param_drift_ours_vs_naive`` is
our final max |Δparam| over the naive run's (0 = no drift at all, 1 = as bad as
naive), ``ratio_loss_drift_ours_vs_naive`` the same for the max |Δloss| over the run.

How: in-process gloo groups on the CPU (``elastic_kit.testing.spawn_multi_process``),
not torchrun: a phase is one worker-group life; it restores the newest checkpoint of
a shared ``CheckpointStore``, trains until ``max_steps`` (the end of the phase), and
checkpoints on exit, exactly what a torchrun restart at a new world size does (the
torchrun path itself is covered by tests/torchrun/scenarios and bench_recovery.py).

Model and data: a 3-layer CNN without batch norm (like the example's ``tinycnn``) on
a synthetic 10-class problem (noisy copies of 10 random 3x16x16 prototypes),
global batch 48 (divisible by 1, 2 and 3), micro-batch 8, SGD with momentum,
one torch thread per rank. Both runs start from the same seed.

Reported: the loss of every step of the three runs, the max absolute loss difference, the
max absolute parameter difference at the end (and whether the weights are bitwise
equal), the epochs' sample audits, and a plot
(``benchmarks/results/elastic_curve_cpu2_202611.png``).

Usage::

    .venv/bin/python benchmarks/bench_elastic_curve.py            # 4 x 30 steps
    .venv/bin/python benchmarks/bench_elastic_curve.py --quick    # 4 x 10 steps
    .venv/bin/python benchmarks/bench_elastic_curve.py --smoke    # 2 -> 1 workers, 2 x 2 steps
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

import torch
from torch import nn

import _common

PHASES = (2, 3, 1, 2)
SMOKE_PHASES = (2, 1)  # --smoke: one resize, the fewest process groups
GLOBAL_BATCH, MICRO = 48, 8
NAIVE_PER_WORKER = GLOBAL_BATCH // PHASES[0]  # the fixed run's per-worker share


def _naive_policy() -> Any:
    """Each worker keeps its batch; the global batch follows the world size; LR unchanged."""
    from elastic_kit.loop import BatchPlan, BatchPolicy

    class PerWorkerBatch(BatchPolicy):
        name = "naive_per_worker"

        def plan(self, world_size: int, initial_world_size: int) -> BatchPlan:
            return BatchPlan(world_size, NAIVE_PER_WORKER * world_size, NAIVE_PER_WORKER,
                             MICRO, 1.0)

    return PerWorkerBatch()


class Teacher(torch.utils.data.Dataset):
    """Noisy copies of 10 random class prototypes (learnable in a few epochs)."""

    def __init__(self, n: int, size: int = 16, classes: int = 10) -> None:
        g = torch.Generator().manual_seed(1234)
        # a per-class colour (survives global pooling) plus a per-class pattern
        protos = (torch.randn(classes, 3, 1, 1, generator=g)
                  + torch.randn(classes, 3, size, size, generator=g))
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = protos[self.y] + torch.randn(n, 3, size, size, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10))


def _phase(cfg: dict[str, Any]) -> dict[str, Any]:
    import logging

    import torch.distributed as dist

    import elastic_kit as ek
    from elastic_kit.checkpointer import CheckpointerConfig
    from elastic_kit.loop import ElasticLoop, LoopConfig, StepInfo, TrainState

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    info = ek.init_distributed(backend="gloo")  # CPU, also where CUDA exists
    model = ek.wrap_ddp(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TrainState(model, opt)
    curve: list[tuple[int, float, int]] = []

    def on_step(state: TrainState, s: StepInfo) -> None:
        # StepInfo.loss is this rank's; the curve is the step's mean over all ranks
        # (the hook runs on every rank, so it may use a collective)
        total = torch.tensor([s.loss], dtype=torch.float64)
        dist.all_reduce(total)
        curve.append((s.step, float(total[0]) / s.world_size, s.world_size))

    criterion = nn.CrossEntropyLoss(reduction="none")
    loop = ElasticLoop(
        state, Teacher(cfg["n"]),
        loss_fn=lambda m, b: criterion(m(b[0]), b[1]),
        store=ek.CheckpointStore(cfg["store"], keep_last=2),
        on_step_end=on_step,
        config=LoopConfig(epochs=cfg["epochs"], global_batch_size=GLOBAL_BATCH,
                          micro_batch_size=MICRO,
                          batch_policy=_naive_policy() if cfg.get("naive") else "fixed_global",
                          max_steps=cfg["max_steps"], log_every=0, progress_bar=False,
                          checkpoint=CheckpointerConfig(handle_signals=False, blocking=True)))
    loop.run()
    out: dict[str, Any] = {"curve": curve, "restored_step": loop.restored_step,
                           "world_size": info.world_size}
    if info.rank == 0:
        # numpy, not tensors: torch's queue would share tensor storage through file
        # descriptors that vanish when this process exits
        out["params"] = {k: v.detach().cpu().numpy().copy() for k, v in
                         ek.unwrap_model(model).state_dict().items()}
        out["audit"] = [(e, a.count, a.expected_count, a.ok)
                        for e, a in sorted(state.audit.epochs.items())]
    return out


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--phase-steps", type=int, default=None, help="steps per phase")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    per_phase = args.phase_steps or (2 if args.smoke else 10 if args.quick else 30)
    phases = SMOKE_PHASES if args.smoke else PHASES
    total = per_phase * len(phases)
    n = 480  # 10 steps per epoch at global batch 48
    # enough epochs for the naive run's largest global batch; max_steps ends every run
    epochs = -(-(total * NAIVE_PER_WORKER * max(phases)) // n) + 1
    load0 = _common.load_avg()

    from elastic_kit.testing import spawn_multi_process

    base = tempfile.mkdtemp(prefix="ek-bench-curve-")
    t0 = time.perf_counter()
    try:
        ref = spawn_multi_process(2, _phase, {"n": n, "epochs": epochs, "max_steps": total,
                                              "store": f"{base}/fixed"}, timeout=900)[0]
        elastic: list[dict[str, Any]] = []
        naive: list[dict[str, Any]] = []
        for i, w in enumerate(phases):  # interleaved phase by phase
            for runs, name in ((elastic, "elastic"), (naive, "naive")):
                runs.append(spawn_multi_process(
                    w, _phase, {"n": n, "epochs": epochs, "max_steps": per_phase * (i + 1),
                                "store": f"{base}/{name}", "naive": name == "naive"},
                    timeout=900)[0])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - t0

    ref_curve = ref["curve"]
    el_curve = [c for ph in elastic for c in ph["curve"]]
    nv_curve = [c for ph in naive for c in ph["curve"]]
    assert ([c[0] for c in ref_curve] == [c[0] for c in el_curve] == [c[0] for c in nv_curve]
            == list(range(1, total + 1)))
    loss_diff = max(abs(a[1] - b[1]) for a, b in zip(ref_curve, el_curve))
    naive_loss_diff = max(abs(a[1] - b[1]) for a, b in zip(ref_curve, nv_curve))
    pa, pb, pn = ref["params"], elastic[-1]["params"], naive[-1]["params"]

    def max_diff(p: dict[str, Any], q: dict[str, Any]) -> float:
        return max(float(abs(p[k].astype("float64") - q[k].astype("float64")).max())
                   for k in p)

    param_diff = max_diff(pa, pb)
    naive_param_diff = max_diff(pa, pn)
    bitwise = all((pa[k] == pb[k]).all() for k in pa)
    audit = elastic[-1]["audit"]
    res: dict[str, Any] = {
        "claim": "elastic_curve",
        "baseline": "the same elastic run with a per-worker batch of "
                    f"{NAIVE_PER_WORKER} (global batch follows the world size, LR unchanged); "
                    "both compared with a fixed 2-worker run",
        "method": "spawn_multi_process phases resuming from one CheckpointStore (not torchrun)",
        "policy": "fixed_global", "global_batch": 48, "phases": list(phases),
        "steps_per_phase": per_phase, "total_steps": total,
        "restored_steps": [ph["restored_step"] for ph in elastic],
        "final_loss_fixed": round(ref_curve[-1][1], 6),
        "final_loss_elastic": round(el_curve[-1][1], 6),
        "first_loss": round(ref_curve[0][1], 6),
        "max_abs_loss_diff": loss_diff,
        "max_abs_param_diff": param_diff,
        "params_bitwise_equal": bool(bitwise),
        "naive_max_abs_loss_diff": naive_loss_diff,
        "naive_max_abs_param_diff": naive_param_diff,
        "final_loss_naive": round(nv_curve[-1][1], 6),
        "ratio_param_drift_ours_vs_naive": param_diff / naive_param_diff
        if naive_param_diff else None,
        "ratio_loss_drift_ours_vs_naive": loss_diff / naive_loss_diff
        if naive_loss_diff else None,
        "audit_epochs_ok": all(ok for *_, ok in audit if ok is not None),
        "audit_epochs_checked": sum(1 for *_, ok in audit if ok is not None),
        "wall_s": round(wall, 1), "load_avg_1m_start": load0,
    }
    res.update(_common.machine())
    print(f"fixed 2 workers vs elastic {'->'.join(map(str, phases))}, {total} steps: "
          f"max |loss diff| {loss_diff:.3g}, max |param diff| {param_diff:.3g}, "
          f"bitwise {bitwise}; naive per-worker batch: max |loss diff| "
          f"{naive_loss_diff:.3g}, max |param diff| {naive_param_diff:.3g}")
    if not args.no_plot and not args.smoke:
        plt = _common.pyplot()
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.plot([c[0] for c in ref_curve], [c[1] for c in ref_curve], "-", lw=2.5,
                color="0.7", label="fixed: 2 workers")
        ax.plot([c[0] for c in el_curve], [c[1] for c in el_curve], "--", lw=1.2,
                color="C0", label="elastic: " + " → ".join(map(str, PHASES)) + " workers")
        ax.plot([c[0] for c in nv_curve], [c[1] for c in nv_curve], ":", lw=1.2,
                color="C3", label=f"naive elastic: {NAIVE_PER_WORKER} per worker")
        for i, w in enumerate(PHASES):
            ax.axvspan(i * per_phase + 0.5, (i + 1) * per_phase + 0.5,
                       color=f"C{w}", alpha=0.08, lw=0)
            ax.text((i + 0.5) * per_phase + 0.5, 0.98, f"W={w}", ha="center", va="top",
                    fontsize=9, transform=ax.get_xaxis_transform())
        ax.set_yscale("log")
        ax.set_xlabel("global step")
        ax.set_ylabel("training loss (global batch 48, log scale)")
        ax.set_title(f"fixed_global: max |Δparam| at the end = {param_diff:.2g}")
        ax.legend(loc="center right")
        fig.tight_layout()
        res["plot"] = _common.save_plot(fig, "elastic_curve_cpu2_202611.png")
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
