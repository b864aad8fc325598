"""Time and peak memory to produce one rank's indices: ours vs torch's DistributedSampler.

Claim checked: generating a rank's share with :class:`ElasticDistributedSampler` is
not slower than ``torch.utils.data.DistributedSampler`` and holds at most one
permutation (plus the rank's own share), for 1e6, 1e7 and 1e8 samples.

Setting: world size 8, rank 3, shuffle on, epoch 0, position 0 (the case where both
samplers do the same work). Three paths are measured:

- ``torch_list``: ``list(iter(DistributedSampler(...)))``
- ``ours_list``: ``list(iter(ElasticDistributedSampler(...)))``
- ``ours_tensor``: ``ElasticDistributedSampler(...).local_indices()`` (int64 tensor)

How memory is measured, and why: ``tracemalloc`` does not see torch's tensor
allocations and CPU tensors have no allocator statistics, so each (path, size) runs
in a fresh subprocess that reads the process's peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``, the kernel's high-water mark) right before the
first call and right after it. The difference is the peak extra memory the call
needed, including freed temporaries (a Python list of all indices, the padded
copy...), and excluding the interpreter and torch import. Timings are the best of
``--repeats`` calls in the same subprocess (after the memory-measured first call).

Usage::

    .venv/bin/python benchmarks/bench_sampler.py --quick     # 1e6 and 1e7, < 2 minutes
    .venv/bin/python benchmarks/bench_sampler.py             # adds 1e8 (needs ~10 GB free RAM)
    .venv/bin/python benchmarks/bench_sampler.py --smoke     # 1e5, once: seconds

The last printed line is a JSON object with every figure and the ratios
ours / torch (below 1 means ours is faster or smaller).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

PATHS = ("torch_list", "ours_list", "ours_tensor")
WORLD, RANK = 8, 3


class _Sized:
    """A dataset stand-in: the samplers only call ``len``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _child(path: str, n: int, repeats: int) -> dict[str, Any]:
    import resource
    import time

    import torch
    from torch.utils.data import DistributedSampler

    from elastic_kit.sampler import ElasticDistributedSampler

    torch.set_num_threads(1)
    dataset = _Sized(n)
    if path == "torch_list":
        sampler: Any = DistributedSampler(dataset, num_replicas=WORLD, rank=RANK, seed=0)
        run = lambda: list(iter(sampler))  # noqa: E731
    else:
        sampler = ElasticDistributedSampler(dataset, num_replicas=WORLD, rank=RANK, seed=0)
        run = (lambda: list(iter(sampler))) if path == "ours_list" else sampler.local_indices

    def maxrss_bytes() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    before = maxrss_bytes()
    t = time.perf_counter()
    out = run()
    times = [time.perf_counter() - t]
    peak = maxrss_bytes() - before
    length = len(out)
    del out
    for _ in range(repeats - 1):
        t = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t)
        del out
    return {"path": path, "n": n, "len": length, "best_s": min(times),
            "peak_extra_mib": peak / 2**20}


def _measure(path: str, n: int, repeats: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", path, str(n), str(repeats)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = _common.parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per measurement (default 5, 3 with --quick)")
    parser.add_argument("--child", nargs=3, metavar=("PATH", "N", "REPEATS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, n, repeats = args.child
        print(json.dumps(_child(path, int(n), int(repeats))))
        return

    import torch

    sizes = ([10**5] if args.smoke else [10**6, 10**7] if args.quick
             else [10**6, 10**7, 10**8])
    repeats = args.repeats or (1 if args.smoke else 3 if args.quick else 5)
    summary: dict[str, Any] = {
        "claim": "sampler", "load_avg_1m_start": _common.load_avg(),
        "world_size": WORLD, "rank": RANK, "repeats": repeats, "quick": args.quick,
        "python": platform.python_version(), "torch": torch.__version__,
        "machine": platform.machine(), "results": {},
    }
    print(f"{'n':>11} {'path':>12} {'best s':>9} {'peak extra MiB':>15} {'len':>11}")
    for n in sizes:
        row: dict[str, Any] = {}
        for path in PATHS:
            m = _measure(path, n, repeats)
            row[path] = {"best_s": round(m["best_s"], 4),
                         "peak_extra_mib": round(m["peak_extra_mib"], 1)}
            print(f"{n:>11} {path:>12} {m['best_s']:>9.4f} {m['peak_extra_mib']:>15.1f} "
                  f"{m['len']:>11}", flush=True)
        t_ref, m_ref = row["torch_list"]["best_s"], row["torch_list"]["peak_extra_mib"]
        for path in ("ours_list", "ours_tensor"):
            row[f"{path}_time_ratio"] = round(row[path]["best_s"] / t_ref, 3)
            row[f"{path}_mem_ratio"] = round(row[path]["peak_extra_mib"] / max(m_ref, 1e-9), 3)
        summary["results"][str(n)] = row
    res = summary["results"]
    summary["max_time_ratio"] = max(max(r["ours_list_time_ratio"], r["ours_tensor_time_ratio"])
                                    for r in res.values())
    summary["max_mem_ratio"] = max(max(r["ours_list_mem_ratio"], r["ours_tensor_mem_ratio"])
                                   for r in res.values())
    # the headline ratios: the worse of our two paths at every size, against torch's
    summary["baseline"] = "torch.utils.data.DistributedSampler, same size, world and rank"
    summary["ratio_time_ours_vs_torch"] = summary["max_time_ratio"]
    summary["ratio_mem_ours_vs_torch"] = summary["max_mem_ratio"]
    summary.update(_common.machine())
    _common.emit(summary, args.results)


if __name__ == "__main__":
    main()
