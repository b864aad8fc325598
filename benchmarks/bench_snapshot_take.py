"""The training thread's time to take one snapshot of the reference model's state.

Why. Taking a snapshot costs the training thread a fixed time per tensor (walking
the state, and on a GPU one launch per copy), whatever the tensors' sizes, and that
time is what the automatic interval spreads over its 1% budget: for the reference
example (ResNet-50 + SGD with momentum, ~480 tensors) it decides how many steps a
worker with no surviving peer redoes after a SIGKILL (half the interval, on average).

Arms, interleaved step by step after a warm-up, in one process (``--device cpu`` or
``cuda``), each after a real training step of the model (so the caches are as cold
as in training):

- ``ek``: ``Checkpointer.snapshot()`` at a step's end, and the optimizer pre-hook's
  wait (``SnapshotTier.wait_staged``) after the next forward and backward pass, as in
  training (both timed: ``ek_ms``); the next step itself (the pass and the optimizer
  step, on CUDA up to the device's end) is timed apart (``step_ms.after_ek``); the
  writer is then waited for, untimed, so every snapshot goes straight into a snapshot
  file (the steady state). On CUDA the device's time in the snapshot (its wait before
  the optimizer step, its copy into the device's mirror) is reported apart
  (``ek_device_stall_ms``, ``ek_mirror_copy_ms``); on the CPU the background write's
  CPU seconds, which CPU training also pays, and which the automatic interval counts
  (``ek_write_cpu_ms``).
- ``state_dict``: ``TrainState.state_dict()`` alone: what any snapshot of the state
  must call (the floor of the training thread's time).
- ``copy``: a hand-written snapshot: ``state_dict()``, then each tensor copied into a
  reused buffer (pinned, ``non_blocking=True`` on CUDA: the launches only, the copy
  is waited for untimed; on the CPU the copy itself) (``copy_ms``), then the next
  step, timed the same way (``step_ms.after_copy``).
- ``plain``: the same next step with no snapshot before it (``step_ms.plain``).

Ratios:

- ``ratio_ek_vs_state_dict`` and ``ratio_ek_vs_copy``: **the training thread's time
  only** (``ek_ms`` against ``state_dict_ms`` and ``copy_ms``). They leave out that the
  snapshot's deferred copies and its background write run on other threads (on a GPU,
  on the device) while the next step runs, and slow it where they share its cores,
  memory bandwidth or device: on a 2-core CPU machine that step can take twice as long.
- ``ratio_ek_with_slowdown_vs_copy``: what a snapshot costs the user, against the
  hand-written copy: (``ek_ms`` + the slowdown of the next step) / (``copy_ms`` + the
  slowdown of its next step). A slowdown (``step_slowdown_ms``) is the median, over the
  rounds, of that step's time minus the ``plain`` step's of the same round; one below
  zero (noise) counts as zero. The part of the write still running after that step (on
  the CPU, see ``ek_write_cpu_ms``) is not in it: with a snapshot every step it would
  slow the steps after too (``bench_snapshot.py`` measures throughput over many steps).

Last line: JSON with the medians in milliseconds and the ratios.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torchvision

import _common
import elastic_kit as ek
from elastic_kit.store import split_state


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--arch", default="resnet50", help="a torchvision model (default resnet50)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per arm (default 40)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    torch.set_num_threads(1 if not cuda else torch.get_num_threads())
    steps = args.steps or (3 if args.smoke else 15 if args.quick else 40)
    arch = "resnet18" if args.smoke else args.arch
    device = torch.device("cuda" if cuda else "cpu")
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    work = tempfile.mkdtemp(prefix="bench-snapshot-take-", dir=shm)
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = work
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = "bench"
    load_start = _common.load_avg()
    try:
        result = _run(steps, arch, device, cuda, work, load_start)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _common.emit(result, args.results)


def _run(steps: int, arch: str, device: torch.device, cuda: bool, work: str,
         load_start: float) -> dict[str, Any]:
    """The arms, interleaved (see the module); the JSON result."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(num_classes=10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    size = 64 if cuda else 32
    x = torch.randn(8 if cuda else 2, 3, size, size, device=device)
    y = torch.randint(0, 10, (x.shape[0],), device=device)

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    train_step()
    state = ek.TrainState(model, opt)
    ckpt = ek.Checkpointer(state, os.path.join(work, "durable"), handle_signals=False,
                           snapshot_every=1, info=ek.DistInfo(run_id="bench"))
    ckpt.restore()
    tier = ckpt.snapshots
    assert tier is not None and tier.enabled, "snapshots are off (see the warning)"
    sd0 = state.state_dict()
    tensors = [t for _, t in ek_leaves(sd0) if isinstance(t, torch.Tensor)]
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def next_step(wait: bool = False) -> tuple[float, float]:
        """(seconds, seconds waited) of the step after a snapshot: the forward and
        backward pass and the optimizer step (on CUDA to the device's end); with
        ``wait``, the pre-hook's wait for the deferred copies (``wait_staged``), timed
        apart and left out of the step's time (the training thread's cost)."""
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        waited = 0.0
        if wait:
            w0 = time.perf_counter()
            tier.wait_staged()
            waited = time.perf_counter() - w0
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0 - waited, waited

    def arm_ek() -> tuple[float, float | None]:
        # taken at a step's end; the deferred copies overlap the next forward and
        # backward pass, and the optimizer's pre-hook waits for what is left
        ckpt.record_step(x.shape[0])
        t0 = time.perf_counter()
        ckpt.snapshot()
        took = time.perf_counter() - t0
        step, waited = next_step(wait=True)
        tier.wait()
        return took + waited, step

    def arm_state_dict() -> tuple[float, float | None]:
        t0 = time.perf_counter()
        state.state_dict()
        return time.perf_counter() - t0, None

    def arm_copy() -> tuple[float, float | None]:
        t0 = time.perf_counter()
        sd = state.state_dict()
        for buf, (_, t) in zip(buffers, ek_leaves(sd)):
            buf.copy_(t, non_blocking=cuda)
        took = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
        return took, next_step()[0]

    def arm_plain() -> tuple[float, float | None]:
        return 0.0, next_step()[0]

    arms = {"ek": arm_ek, "state_dict": arm_state_dict, "copy": arm_copy,
            "plain": arm_plain}
    times: dict[str, list[float]] = {k: [] for k in arms}
    after: dict[str, list[float]] = {"ek": [], "copy": [], "plain": []}  # the next step
    for i in range(3):  # warm-up: the snapshot files are made, the mirror allocated
        train_step()
        arm_ek()
    stalls0, mirror0 = _device_times(tier)
    writes0 = len(list(getattr(tier, "write_cpu_costs", ())))
    for i in range(steps):
        for name, arm in arms.items():
            train_step()
            took, step = arm()
            times[name].append(took)
            if step is not None:
                after[name].append(step)
    train_step()
    arm_ek()  # the last timed snapshot's device time is known at the next one
    stalls, mirror = _device_times(tier)
    stalls, mirror = stalls[len(stalls0):], mirror[len(mirror0):]
    write_cpu = list(getattr(tier, "write_cpu_costs", ()))[writes0:]
    written, direct = len(tier.written), tier.direct
    ckpt.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    # the next step's slowdown, paired with the plain step of the same round
    slowdown = {k: statistics.median(a - p for a, p in zip(after[k], after["plain"]))
                for k in ("ek", "copy")}
    with_slowdown = {k: med[k] + max(0.0, slowdown[k]) for k in ("ek", "copy")}
    result: dict[str, Any] = {
        "claim": "snapshot_take",
        "baseline": "TrainState.state_dict() alone (the floor), and a hand-written snapshot: "
                    "state_dict() and one copy_ per tensor into reused (pinned) buffers; "
                    "the next training step without a snapshot before it",
        "device": str(device), "arch": arch, "tensors": len(tensors), "state_bytes": nbytes,
        "steps_per_arm": steps,
        "ek_ms": _common.spread([1e3 * t for t in times["ek"]]),
        "state_dict_ms": round(1e3 * med["state_dict"], 3),
        "copy_ms": round(1e3 * med["copy"], 3),
        "step_ms": {("after_" + k if k != "plain" else k):
                    _common.spread([1e3 * t for t in after[k]]) for k in ("plain", "ek", "copy")},
        "step_slowdown_ms": {k: round(1e3 * v, 3) for k, v in slowdown.items()},
        "ek_with_slowdown_ms": round(1e3 * with_slowdown["ek"], 3),
        "copy_with_slowdown_ms": round(1e3 * with_slowdown["copy"], 3),
        "ek_device_stall_ms": _common.spread([1e3 * t for t in stalls]) if stalls else None,
        "ek_mirror_copy_ms": _common.spread([1e3 * t for t in mirror]) if mirror else None,
        "ek_write_cpu_ms": _common.spread([1e3 * t for t in write_cpu]) if write_cpu else None,
        "ek_written": written, "ek_direct": direct,
        "ek_mirror_bytes": getattr(getattr(tier, "mirror", None), "nbytes", None),
        "ratio_ek_vs_state_dict": round(med["ek"] / med["state_dict"], 3),
        "ratio_ek_vs_copy": round(med["ek"] / med["copy"], 3),  # training thread only
        "ratio_ek_with_slowdown_vs_copy": round(with_slowdown["ek"] / with_slowdown["copy"], 3),
        "load_avg_1m_start": load_start,
        "load_avg_1m": load_start,
        "machine": _common.machine(),
        "load_avg_1m_end": _common.load_avg(),
    }
    return result


def _device_times(tier: Any) -> tuple[list[float], list[float]]:
    """The device's time in the snapshots so far: its waits before the optimizer step,
    and its copies into the mirror (CUDA; empty on the CPU)."""
    return list(getattr(tier, "device_stalls", ())), list(getattr(tier, "mirror_copy_s", ()))


def ek_leaves(state: Any) -> list[tuple[str, Any]]:
    """The state's tensors with their key paths, in the snapshot file's order."""
    return split_state(state)[1]


if __name__ == "__main__":
    main()
