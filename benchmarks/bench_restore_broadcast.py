"""Restore + broadcast to N gloo ranks: CheckpointStore vs the pytorch/elastic example's way.

Claim measured (claim 3): restoring a checkpoint that one rank holds and sending it to
every rank tensor by tensor (``CheckpointStore.load`` with a process group: skeleton
via ``broadcast_object``, tensors via ``broadcast_tensors``) is not slower than, and
peaks at less memory than, what the pytorch/elastic ImageNet example does.

The baseline (``blob``) is that example's own code path (``load_checkpoint`` in its
``main.py``): the ranks all-reduce who holds the newest checkpoint; the holder
``torch.load``s it, ``torch.save``s the state into a ``BytesIO``, takes its bytes as a
uint8 tensor and ``dist.broadcast``s first the length, then the byte tensor; every
other rank allocates a uint8 tensor of that length, receives it and ``torch.load``s
from a ``BytesIO`` over it. Same gloo group, same state, same file system as ours.

Each method runs in fresh processes (peak RSS is a per-process high-water mark):
N = 2 and 3 ranks, gloo, CPU. Reported per method and N: wall time of the restore
(max over ranks), peak RSS growth during it (max over ranks), their ratios ours /
blob, and the peak RSS growth over the state size (goal for ours: <= 1.3x).

Usage::

    .venv/bin/python benchmarks/bench_restore_broadcast.py            # ~300 MB, best of 3
    .venv/bin/python benchmarks/bench_restore_broadcast.py --quick    # ~100 MB, once
    .venv/bin/python benchmarks/bench_restore_broadcast.py --smoke    # 20 MB, 2 ranks, once

The last line printed is a JSON object with every figure and ratio.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastic_kit import CheckpointStore, DistInfo, init_distributed
from elastic_kit.testing import spawn_multi_process

import _common


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _checksum(state: dict[str, Any]) -> float:
    return float(sum(t.double().sum() for t in state["model"].values()))


def _timed_restore(restore: Callable[[Any], dict[str, Any]]) -> dict[str, float]:
    """Run ``restore(info) -> state`` on every rank between barriers: wall time, peak
    RSS growth and a checksum of the state it produced."""
    info = init_distributed(backend="gloo")  # CPU tensors, also where CUDA exists
    torch.set_num_threads(1)
    dist.barrier()
    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    state = restore(info)
    dist.barrier()
    dt = time.perf_counter() - t0
    return {"s": dt, "peak_mb": (_peak_rss_bytes() - rss0) / 1e6, "sum": _checksum(state)}


def _ours(root: str) -> dict[str, float]:
    def restore(info: Any) -> dict[str, Any]:
        loaded = CheckpointStore(root, info=info).load()
        assert loaded is not None
        return loaded.state

    return _timed_restore(restore)


def _blob(path: str) -> dict[str, float]:
    """The pytorch/elastic ImageNet example's ``load_checkpoint``, on this state."""
    import io

    import numpy

    def restore(info: Any) -> dict[str, Any]:
        state = torch.load(path, weights_only=True) if info.rank == 0 else None
        # who has the newest checkpoint (the example compares epochs; -1: none)
        epochs = torch.zeros(info.world_size, dtype=torch.int32)
        epochs[info.rank] = 1 if state is not None else -1
        dist.all_reduce(epochs, op=dist.ReduceOp.SUM)
        src = int(torch.max(epochs, dim=0)[1].item())
        # "pickle the snapshot, convert it into a byte-blob tensor then broadcast it"
        if info.rank == src:
            with io.BytesIO() as f:
                torch.save(state, f)
                raw_blob = numpy.frombuffer(f.getvalue(), dtype=numpy.uint8)
            blob_len = torch.tensor(len(raw_blob))
        else:
            blob_len = torch.tensor(0)
        dist.broadcast(blob_len, src=src)
        if info.rank != src:
            blob = torch.zeros(int(blob_len.item()), dtype=torch.uint8)
        else:
            with warnings.catch_warnings():  # the example's read-only numpy view
                warnings.simplefilter("ignore", UserWarning)
                blob = torch.as_tensor(raw_blob, dtype=torch.uint8)
        dist.broadcast(blob, src=src)
        if info.rank != src:
            with io.BytesIO(blob.numpy()) as f:
                state = torch.load(f, weights_only=True)
        return state

    return _timed_restore(restore)


def measure(ranks: int, repeats: int, store_root: str, blob_path: str, expected: float,
            nbytes: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "blob": []}
    for _ in range(repeats):
        for name, fn, arg in (("ours", _ours, store_root), ("blob", _blob, blob_path)):
            per_rank = spawn_multi_process(ranks, fn, arg, timeout=600)
            assert all(abs(r["sum"] - expected) < 1e-3 * abs(expected) + 1 for r in per_rank)
            runs[name].append({"s": max(r["s"] for r in per_rank),
                               "peak_mb": max(r["peak_mb"] for r in per_rank)})

    def best(name: str, key: str) -> float:
        return min(r[key] for r in runs[name])

    mb = nbytes / 1e6
    return {
        "ranks": ranks,
        "ours_s": round(best("ours", "s"), 3),
        "blob_s": round(best("blob", "s"), 3),
        "ours_peak_rss_growth_mb": round(best("ours", "peak_mb"), 1),
        "blob_peak_rss_growth_mb": round(best("blob", "peak_mb"), 1),
        "ratio_time_ours_vs_blob": round(best("ours", "s") / best("blob", "s"), 3),
        "ratio_peak_rss_ours_vs_blob": round(best("ours", "peak_mb") / best("blob", "peak_mb"), 3),
        "ratio_peak_rss_vs_state_ours": round(best("ours", "peak_mb") / mb, 3),
        "ratio_peak_rss_vs_state_blob": round(best("blob", "peak_mb") / mb, 3),
        "load_avg_1m": _common.load_avg(),
    }


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--size-mb", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--ranks", default="2,3", help="comma-separated world sizes (default 2,3)")
    args = ap.parse_args()
    size_mb = args.size_mb or (20 if args.smoke else 100 if args.quick else 300)
    repeats = args.repeats or (1 if args.quick or args.smoke else 3)
    ranks_list = [int(r) for r in args.ranks.split(",")]
    if args.smoke:
        ranks_list = ranks_list[:1]
    load0 = _common.load_avg()

    base = tempfile.mkdtemp(prefix="ek-bench-bcast-")
    per_n = {}
    try:
        g = torch.Generator().manual_seed(0)
        numel = 10 * (1 << 20) // 4
        state = {"model": {f"l{i}": torch.randn(numel, generator=g)
                           for i in range(max(1, size_mb // 10))}, "step": 1}
        nbytes = sum(t.numel() * 4 for t in state["model"].values())
        store_root = os.path.join(base, "store")
        CheckpointStore(store_root, info=DistInfo()).save(state, step=1)
        blob_path = os.path.join(base, "blob.pt")
        torch.save(state, blob_path)
        expected = _checksum(state)
        del state
        for n in ranks_list:
            r = per_n[str(n)] = measure(n, repeats, store_root, blob_path, expected, nbytes)
            print(f"restore + broadcast of {nbytes / 1e6:.1f} MB to {n} gloo ranks "
                  f"(best of {repeats}, load {r['load_avg_1m']}):")
            for name, label in (("ours", "ours (tensor by tensor)"),
                                ("blob", "example's byte tensor")):
                print(f"  {label:<24} {r[name + '_s']:.3f} s, peak RSS "
                      f"+{r[name + '_peak_rss_growth_mb']:.0f} MB "
                      f"({r['ratio_peak_rss_vs_state_' + name]:.2f}x state)", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    res: dict[str, Any] = {
        "claim": "restore_broadcast",
        "baseline": "the pytorch/elastic ImageNet example's load_checkpoint: torch.load on the "
                    "holder, torch.save into a BytesIO, dist.broadcast of its length and of "
                    "the bytes as a uint8 tensor, torch.load on the receivers",
        "size_mb": round(nbytes / 1e6, 1),
        "repeats": repeats,
        "ranks": ranks_list,
        "ratio_time_ours_vs_blob": {k: v["ratio_time_ours_vs_blob"] for k, v in per_n.items()},
        "ratio_peak_rss_vs_state_ours": {k: v["ratio_peak_rss_vs_state_ours"]
                                         for k, v in per_n.items()},
        "ratio_peak_rss_vs_state_blob": {k: v["ratio_peak_rss_vs_state_blob"]
                                         for k, v in per_n.items()},
        "per_ranks": per_n,
        "load_avg_1m_start": load0,
    }
    res.update(_common.machine())
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
