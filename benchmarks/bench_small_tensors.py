"""A state of many small tensors: the store's save and load against torch.save / torch.load.

Claim measured: a checkpoint of many small tensors (an optimizer's state of a model
with many small parameters, an embedding per feature: 100,000 tensors of 8 floats by
default) costs about what ``torch.save`` of the same dict to a local file costs, with
the store's checksum, manifest and commit on top; loading it costs about what
``torch.load(weights_only=True)`` costs. Per tensor, both are Python work (pickling,
a zip record), not bytes: the store's own per-tensor work (staging, the writes of
torch's pieces through the checksumming writer) is what this measures against them.

Baselines, same run, same directory, same dict, interleaved (the order alternates
each round):

- ``torch_save_fsync``: ``torch.save(state, f)`` into an open file, flush, fsync
  (what scripts do);
- ``torch_load``: ``torch.load(path, weights_only=True)`` of that file (torch's
  default, and the loader the store uses).

Candidates: ``ours_sync`` (``CheckpointStore.save``, blocking), ``ours_nonblocking``
(``save(blocking=False)``: the time ``save()`` blocked, and until ``wait()``
returned, after a first non-blocking save that allocated the reused staging
buffers), ``ours_load`` (``CheckpointStore.load``: verify the checksum, then load).
Each figure is the median over rounds of wall seconds, and beside it the process's
CPU seconds (all threads; on a shared machine the CPU time is the steadier figure).

Ratios are baseline time / store time (> 1: the store is faster):
``ratio_ours_vs_torch_save``, ``ratio_ours_vs_torch_save_cpu``,
``ratio_nonblocking_total_vs_torch_save``, ``ratio_ours_load_vs_torch_load`` (and its
``_cpu``); except ``ratio_nonblocking_blocked_vs_torch_save``, the other way round:
the share of a ``torch.save`` that a non-blocking save blocks its caller for.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import _common  # noqa: E402
from elastic_kit.store import CheckpointStore  # noqa: E402


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--tensors", type=int, default=None,
                    help="how many tensors (default 100000)")
    ap.add_argument("--numel", type=int, default=8, help="elements per tensor (default 8)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: tmp)")
    args = ap.parse_args()
    n = args.tensors or (300 if args.smoke else 30_000 if args.quick else 100_000)
    rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 3)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(args.numel) for i in range(n)}
    load_start = _common.load_avg()
    base = tempfile.mkdtemp(prefix="ek-bench-small-", dir=args.dir)
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def note(name: str, w: float, c: float) -> None:
        wall.setdefault(name, []).append(w)
        cpu.setdefault(name, []).append(c)

    try:
        path = os.path.join(base, "torch.pt")
        store = CheckpointStore(os.path.join(base, "store"), keep_last=2)
        step = 0

        def torch_save() -> None:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        def ours_sync() -> None:
            nonlocal step
            step += 1
            store.save(state, step=step)

        def ours_nonblocking() -> None:
            nonlocal step
            step += 1
            w, c, _ = _timed(lambda: store.save(state, step=step, blocking=False))
            note("ours_nonblocking_blocked", w, c)
            w2, c2, _ = _timed(store.wait)
            note("ours_nonblocking", w + w2, c + c2)

        step += 1
        store.save(state, step=step, blocking=False)  # the staging buffers, allocated
        store.wait()
        for r in range(rounds):
            saves = [("torch_save_fsync", torch_save), ("ours_sync", ours_sync),
                     ("", ours_nonblocking)]
            for name, fn in (saves if r % 2 == 0 else saves[::-1]):
                w, c, _ = _timed(fn)
                if name:
                    note(name, w, c)
            loads = [("torch_load", lambda: torch.load(path, weights_only=True)),
                     ("ours_load", store.load)]
            for name, fn in (loads if r % 2 == 0 else loads[::-1]):
                w, c, out = _timed(fn)
                note(name, w, c)
                if name == "ours_load":
                    assert out is not None and out.step == step
                    assert all(torch.equal(out.state[k], v) for k, v in state.items())
                del out
        store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    def ratio(a: str, b: str, of: dict[str, float]) -> float:
        return round(of[a] / of[b], 3) if of[b] > 0 else 0.0

    result: dict[str, Any] = {
        "claim": "small_tensors",
        "baseline": "torch.save(state, f) + flush + fsync into a local file; "
                    "torch.load(path, weights_only=True) of that file",
        "tensors": n, "numel": args.numel, "rounds": rounds,
        "wall_s": {k: round(v, 3) for k, v in med.items()},
        "cpu_s": {k: round(v, 3) for k, v in med_cpu.items()},
        "ratio_ours_vs_torch_save": ratio("torch_save_fsync", "ours_sync", med),
        "ratio_ours_vs_torch_save_cpu": ratio("torch_save_fsync", "ours_sync", med_cpu),
        "ratio_nonblocking_blocked_vs_torch_save": ratio(
            "ours_nonblocking_blocked", "torch_save_fsync", med),
        "ratio_nonblocking_total_vs_torch_save": ratio("torch_save_fsync", "ours_nonblocking",
                                                       med),
        "ratio_ours_load_vs_torch_load": ratio("torch_load", "ours_load", med),
        "ratio_ours_load_vs_torch_load_cpu": ratio("torch_load", "ours_load", med_cpu),
        "load_avg_1m_start": load_start,
        "machine": _common.machine(),
    }
    _common.emit(result, args.results)


if __name__ == "__main__":
    main()
