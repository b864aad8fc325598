"""Sync and non-blocking save throughput of CheckpointStore against its baselines.

Claim measured (issue 3): a synchronous save to local disk runs at >= 0.9x a plain
write+fsync of the same byte count and is not slower than ``torch.save`` + fsync or
``torch.distributed.checkpoint.save``; a non-blocking save blocks the caller for
<= 0.1x of a synchronous save.

All baselines are measured in the same run, on the same directory, with the same
state (random float32 tensors of 10 MB each, so nothing compresses), interleaved
round-robin so that a busy machine slows every method alike. Each figure is the
median of ``--repeats`` runs.

Usage::

    python benchmarks/bench_checkpoint.py            # ~500 MB state
    python benchmarks/bench_checkpoint.py --quick    # ~100 MB state, < 2 min

The last line printed is a JSON object with every figure and ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable

import torch

from elastic_kit.checkpoint import CheckpointStore
from elastic_kit.distributed import DistInfo


def make_state(total_mb: int, tensor_mb: int = 10) -> dict[str, Any]:
    """A model-like state: ``total_mb`` of float32 tensors plus small bookkeeping."""
    n = max(1, total_mb // tensor_mb)
    numel = tensor_mb * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)},
        "step": 123,
        "sampler": {"epoch": 1, "consumed": 4096},
    }


def state_nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def _fsync_path(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def bench_raw(flat: torch.Tensor, d: str) -> float:
    """Plain write of the same byte count from memory, then fsync."""
    path = os.path.join(d, "raw.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(flat.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def bench_torch_save(state: dict[str, Any], d: str) -> float:
    path = os.path.join(d, "torch.pt")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def bench_dcp(state: dict[str, Any], d: str) -> float:
    import torch.distributed.checkpoint as dcp

    path = os.path.join(d, "dcp")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)  # FileSystemWriter fsyncs
    dt = time.perf_counter() - t0
    shutil.rmtree(path)
    return dt


class _Ours:
    def __init__(self, d: str, checksum: str) -> None:
        self.store = CheckpointStore(os.path.join(d, f"store-{checksum}"), keep_last=1,
                                     info=DistInfo(), checksum=checksum)
        self.step = 0

    def sync(self, state: dict[str, Any]) -> float:
        self.step += 1
        t0 = time.perf_counter()
        self.store.save(state, step=self.step)
        return time.perf_counter() - t0

    def nonblocking(self, state: dict[str, Any]) -> tuple[float, float]:
        self.step += 1
        t0 = time.perf_counter()
        self.store.save(state, step=self.step, blocking=False)
        blocked = time.perf_counter() - t0
        self.store.wait()
        return blocked, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="~100 MB state, 3 repeats")
    ap.add_argument("--size-mb", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: tmp)")
    args = ap.parse_args()
    size_mb = args.size_mb or (100 if args.quick else 500)
    repeats = args.repeats or (3 if args.quick else 5)
    torch.set_num_threads(1)

    state = make_state(size_mb)
    nbytes = state_nbytes(state)
    # the same bytes the state holds, already in memory (not an untouched torch.empty,
    # whose pages would all be the shared zero page and copy unrealistically fast)
    flat = torch.cat([t.reshape(-1) for t in state["model"].values()])
    base = tempfile.mkdtemp(prefix="ek-bench-", dir=args.dir)
    ours = _Ours(base, "crc32")
    ours_sha = _Ours(base, "sha256")
    # non-blocking saves get their own store, as a loop that always saves non-blocking
    # would: its retention runs on the save thread, never on the caller's
    ours_nb = _Ours(os.path.join(base, "nb"), "crc32")
    methods: dict[str, Callable[[], float]] = {
        "raw_write_fsync": lambda: bench_raw(flat, base),
        "torch_save_fsync": lambda: bench_torch_save(state, base),
        "dcp_save": lambda: bench_dcp(state, base),
        "ours_sync_crc32": lambda: ours.sync(state),
        "ours_sync_sha256": lambda: ours_sha.sync(state),
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    blocked: list[float] = []
    nb_total: list[float] = []
    try:
        for name, fn in methods.items():  # warm-up: page cache, allocator, imports
            fn()
        ours_nb.nonblocking(state)  # warm-up: allocates the staging buffers once
        for _ in range(repeats):
            for name, fn in methods.items():
                times[name].append(fn())
            b, t = ours_nb.nonblocking(state)
            blocked.append(b)
            nb_total.append(t)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    ours_t = med["ours_sync_crc32"]
    res = {
        "size_mb": round(nbytes / 1e6, 1),
        "repeats": repeats,
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "gb_per_s": {k: round(v, 3) for k, v in gbps.items()},
        "ratio_ours_vs_raw": round(med["raw_write_fsync"] / ours_t, 3),
        "ratio_ours_vs_torch_save": round(med["torch_save_fsync"] / ours_t, 3),
        "ratio_ours_vs_dcp": round(med["dcp_save"] / ours_t, 3),
        "ratio_sha256_vs_raw": round(med["raw_write_fsync"] / med["ours_sync_sha256"], 3),
        "nonblocking_blocked_s": round(statistics.median(blocked), 4),
        "nonblocking_total_s": round(statistics.median(nb_total), 4),
        "ratio_nonblocking_blocked_vs_sync": round(statistics.median(blocked) / ours_t, 3),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
    }
    print(f"state {res['size_mb']} MB, median of {repeats}:")
    for k in methods:
        print(f"  {k:<18} {med[k]:7.3f} s  {gbps[k]:6.3f} GB/s")
    print(f"  non-blocking: caller blocked {res['nonblocking_blocked_s']:.3f} s "
          f"({res['ratio_nonblocking_blocked_vs_sync']:.3f}x of a sync save)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
