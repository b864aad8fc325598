"""Sync and non-blocking save throughput of CheckpointStore against its baselines.

Claim measured (issues 3 and 6, claim 2): a synchronous save to local disk runs at >= 0.9x a plain
write+fsync of the same byte count and is not slower than ``torch.save`` + fsync or
``torch.distributed.checkpoint.save``; a non-blocking save blocks the caller for
<= 0.1x of a synchronous save.

All baselines are measured in the same run, on the same directory, with the same
state (random float32 tensors of 10 MB each, so nothing compresses), interleaved
round-robin so that a busy machine slows every method alike; ``os.sync()`` runs
before each timed call, so no method pays for the writeback of another's dirty pages.
Each figure is the median of ``--repeats`` rounds (three times as many for states
under 200 MB, whose times are short and noisy). ``hash_only`` times the store's
default checksum (xxh3_128) over the same bytes, no I/O: the CPU it needs beside
the write. States of 50 MB, 500 MB and 2 GB by default (the 2 GB state needs ~8 GB
of free memory: state, staging buffers, DCP's copies).

Non-blocking saves, two ways, both after a warm-up save that allocates the reused
staging buffers:

- ``copy_in_save``: ``save(blocking=False)``; the caller is blocked while every tensor
  is copied into staging memory inside ``save()``.
- ``overlapped`` (what ``ElasticLoop`` does): ``save(blocking=False, copy_later=<all
  tensors>)`` returns after walking the state; the caller then runs a stand-in for
  the next forward/backward pass, copying a scratch buffer as large as the state
  (a real pass reads every parameter at least twice and writes every gradient, so it
  is never shorter than one copy of the state), then calls ``wait_staged()`` before
  its "optimizer step". Blocked time = time in ``save()`` + time in ``wait_staged()``.
  The headline ratio divides it by the sync save's time.

Usage::

    .venv/bin/python benchmarks/bench_checkpoint.py            # 50 MB, 500 MB, 2 GB
    .venv/bin/python benchmarks/bench_checkpoint.py --quick    # 50 MB, 200 MB, < 2 min

The last line printed is a JSON object with every figure and ratio.
"""

from __future__ import annotations

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

import _common


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


def bench_raw(state: dict[str, Any], d: str) -> float:
    """Plain write of the same bytes (each tensor's memory, in order), then fsync."""
    def write(f: Any) -> None:
        for t in state["model"].values():
            f.write(memoryview(t.numpy()).cast("B"))

    return _timed_write(os.path.join(d, "raw.bin"), write)


def bench_torch_save(state: dict[str, Any], d: str) -> float:
    return _timed_write(os.path.join(d, "torch.pt"), lambda f: torch.save(state, f))


def _timed_write(path: str, write: Callable[[Any], None]) -> float:
    """Seconds to ``write(f)`` into a new file at ``path``, flush and fsync it."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        write(f)
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
        """Everything copied inside save(): (blocked s, s until committed)."""
        self.step += 1
        t0 = time.perf_counter()
        self.store.save(state, step=self.step, blocking=False)
        blocked = time.perf_counter() - t0
        self.store.wait()
        return blocked, time.perf_counter() - t0

    def overlapped(self, state: dict[str, Any],
                   scratch: list[torch.Tensor]) -> tuple[float, float]:
        """copy_later + a stand-in step + wait_staged(): (blocked s, step s)."""
        self.step += 1
        tensors = list(state["model"].values())
        t0 = time.perf_counter()
        self.store.save(state, step=self.step, blocking=False, copy_later=tensors)
        t1 = time.perf_counter()
        for src, dst in zip(tensors, scratch):  # the next forward/backward pass
            dst.copy_(src)
        t2 = time.perf_counter()
        self.store.wait_staged()  # before the optimizer step
        t3 = time.perf_counter()
        self.store.wait()
        return (t1 - t0) + (t3 - t2), t2 - t1


def bench_hash(state: dict[str, Any]) -> float:
    """CPU cost of the default checksum alone, over every tensor's bytes."""
    from elastic_kit.checkpoint.serialize import new_hasher

    t0 = time.perf_counter()
    h = new_hasher("xxh3_128")
    for t in state["model"].values():
        h.update(memoryview(t.numpy()).cast("B"))
    h.hexdigest()
    return time.perf_counter() - t0


def measure(size_mb: int, repeats: int, base_dir: str | None) -> dict[str, Any]:
    """All methods on one state of ``size_mb``, interleaved round-robin."""
    state = make_state(size_mb)
    nbytes = state_nbytes(state)
    base = tempfile.mkdtemp(prefix="ek-bench-", dir=base_dir)
    ours = _Ours(base, "xxh3_128")
    ours_crc = _Ours(base, "crc32")
    ours_sha = _Ours(base, "sha256")
    # non-blocking saves get their own stores, as a loop that always saves non-blocking
    # would: its retention runs on the save thread, never on the caller's
    ours_nb = _Ours(os.path.join(base, "nb"), "xxh3_128")
    ours_ov = _Ours(os.path.join(base, "ov"), "xxh3_128")
    scratch = [torch.empty_like(t) for t in state["model"].values()]
    methods: dict[str, Callable[[], float]] = {
        "raw_write_fsync": lambda: bench_raw(state, base),
        "torch_save_fsync": lambda: bench_torch_save(state, base),
        "dcp_save": lambda: bench_dcp(state, base),
        "ours_sync": lambda: ours.sync(state),
        "ours_sync_crc32": lambda: ours_crc.sync(state),
        "ours_sync_sha256": lambda: ours_sha.sync(state),
        "hash_only": lambda: bench_hash(state),
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    blocked: list[float] = []
    nb_total: list[float] = []
    ov_blocked: list[float] = []
    ov_step: list[float] = []

    def settle() -> None:
        for o in (ours, ours_crc, ours_sha):
            o.store.list()  # joins the retention thread of the previous save
        os.sync()

    try:
        for name, fn in methods.items():  # warm-up: page cache, allocator, imports
            fn()
        ours_nb.nonblocking(state)  # warm-up: allocates the staging buffers once
        ours_ov.overlapped(state, scratch)
        for _ in range(repeats):
            for name, fn in methods.items():
                settle()
                times[name].append(fn())
            settle()
            b, t = ours_nb.nonblocking(state)
            blocked.append(b)
            nb_total.append(t)
            settle()
            b, t = ours_ov.overlapped(state, scratch)
            ov_blocked.append(b)
            ov_step.append(t)
    finally:
        for o in (ours, ours_crc, ours_sha, ours_nb, ours_ov):
            o.store.close()
        shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    ours_t = med["ours_sync"]
    per_round = [times["raw_write_fsync"][i] / times["ours_sync"][i] for i in range(repeats)]
    return {
        "size_mb": round(nbytes / 1e6, 1),
        "repeats": repeats,
        "seconds": {k: round(v, 4) for k, v in med.items()},
        "gb_per_s": {k: round(v, 3) for k, v in gbps.items()},
        "ratio_ours_vs_raw": round(med["raw_write_fsync"] / ours_t, 3),
        "ratio_ours_vs_raw_per_round": [round(r, 3) for r in per_round],
        "ratio_ours_vs_torch_save": round(med["torch_save_fsync"] / ours_t, 3),
        "ratio_ours_vs_dcp": round(med["dcp_save"] / ours_t, 3),
        "ratio_crc32_vs_raw": round(med["raw_write_fsync"] / med["ours_sync_crc32"], 3),
        "ratio_sha256_vs_raw": round(med["raw_write_fsync"] / med["ours_sync_sha256"], 3),
        "nonblocking_copy_in_save_blocked_s": round(statistics.median(blocked), 4),
        "nonblocking_total_s": round(statistics.median(nb_total), 4),
        "ratio_copy_in_save_blocked_vs_sync": round(statistics.median(blocked) / ours_t, 3),
        "overlapped_blocked_s": round(statistics.median(ov_blocked), 4),
        "overlapped_blocked_s_per_round": [round(b, 4) for b in ov_blocked],
        "overlapped_step_s": round(statistics.median(ov_step), 4),
        "ratio_nonblocking_blocked_vs_sync": round(statistics.median(ov_blocked) / ours_t, 3),
        "load_avg_1m": _common.load_avg(),
    }


def main() -> None:
    ap = _common.parser(__doc__, smoke=True)
    ap.add_argument("--sizes", default=None,
                    help="comma-separated state sizes in MB (default 50,500,2000; "
                         "quick 50,200; smoke 20)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: tmp)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    sizes = [int(x) for x in (args.sizes or ("20" if args.smoke else "50,200" if args.quick
                                              else "50,500,2000")).split(",")]
    repeats = args.repeats or (1 if args.smoke else 3 if args.quick else 5)
    small_repeats = repeats if args.smoke else 3 * repeats  # short, noisy timings
    torch.set_num_threads(1)
    load0 = _common.load_avg()
    per_size = {}
    for size_mb in sizes:
        r = measure(size_mb, small_repeats if size_mb < 200 else repeats, args.dir)
        per_size[str(size_mb)] = r
        print(f"state {r['size_mb']} MB, median of {r['repeats']} (load {r['load_avg_1m']}):")
        for k, v in r["seconds"].items():
            print(f"  {k:<18} {v:7.3f} s  {r['gb_per_s'][k]:6.3f} GB/s")
        print(f"  ours vs raw {r['ratio_ours_vs_raw']:.3f}, vs torch.save "
              f"{r['ratio_ours_vs_torch_save']:.3f}, vs dcp {r['ratio_ours_vs_dcp']:.3f}; "
              f"crc32 vs raw {r['ratio_crc32_vs_raw']:.3f}", flush=True)
        print(f"  non-blocking, copy in save(): blocked {r['nonblocking_copy_in_save_blocked_s']:.3f}"
              f" s ({r['ratio_copy_in_save_blocked_vs_sync']:.3f}x sync); overlapped with a "
              f"{r['overlapped_step_s']:.3f} s step: blocked {r['overlapped_blocked_s']:.3f} s "
              f"({r['ratio_nonblocking_blocked_vs_sync']:.3f}x sync)", flush=True)
    res: dict[str, Any] = {
        "claim": "checkpoint_save",
        "sizes_mb": sizes,
        "repeats": repeats,
        "ratio_ours_vs_raw": {k: v["ratio_ours_vs_raw"] for k, v in per_size.items()},
        "ratio_ours_vs_torch_save": {k: v["ratio_ours_vs_torch_save"] for k, v in per_size.items()},
        "ratio_ours_vs_dcp": {k: v["ratio_ours_vs_dcp"] for k, v in per_size.items()},
        "ratio_nonblocking_blocked_vs_sync": {
            k: v["ratio_nonblocking_blocked_vs_sync"] for k, v in per_size.items()},
        "ratio_copy_in_save_blocked_vs_sync": {
            k: v["ratio_copy_in_save_blocked_vs_sync"] for k, v in per_size.items()},
        "per_size": per_size,
        "load_avg_1m_start": load0,
    }
    res.update(_common.machine())
    if not args.no_plot and not args.smoke and len(sizes) > 1:
        plt = _common.pyplot()
        fig, ax = plt.subplots(figsize=(8, 4.2))
        names = ["raw_write_fsync", "ours_sync", "ours_sync_crc32", "ours_sync_sha256",
                 "torch_save_fsync", "dcp_save"]
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            ax.bar([j + i * width for j in range(len(sizes))],
                   [per_size[str(s)]["gb_per_s"][n] for s in sizes], width, label=n)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))],
                      [f"{per_size[str(s)]['size_mb']:.0f} MB" for s in sizes])
        ax.set_ylabel("GB/s (median)")
        ax.set_title("synchronous save to local disk, incl. fsync")
        ax.legend(fontsize=8)
        fig.tight_layout()
        res["plot"] = _common.save_plot(fig, "checkpoint_cpu2_202611.png")
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
