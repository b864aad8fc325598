"""Sync and non-blocking save throughput of CheckpointStore against its baselines.

Claim measured (claim 2): a synchronous save to local disk runs at >= 0.9x what the
disk sustains for the same bytes and is not slower than what users do instead
(``torch.save`` + fsync, ``torch.distributed.checkpoint.save``); a non-blocking save
blocks the caller for <= 0.1x of a synchronous save.

Baselines, all measured in the same run, on the same directory, with the same state
(random float32 tensors of 10 MB each, so nothing compresses):

- ``o_direct``: **the device ceiling**, the faster (by median) of ``o_direct_8m`` and
  ``o_direct_16m`` (8 MiB requests, and 16 MiB: the store's own request size).
  The same bytes, already in one page-aligned
  buffer, written with ``O_DIRECT`` in those pieces, then fsync (what ``dd
  if=<those bytes> of=<target> bs=8M oflag=direct conv=fsync`` measures, without
  dd's read of its input). No page cache, no copy: the disk's own speed. ``null``
  where the filesystem refuses ``O_DIRECT`` (a first write at the start, untimed,
  finds out: ``o_direct_supported``). A memory filesystem may accept it (tmpfs does on
  recent kernels, such as the 2-core VM's 6.18): the figure is then a copy into its
  pages, not a device's speed.
- ``o_direct_beside_copy_hash``: the 16 MiB ceiling again, while a second thread does
  the CPU work any checksummed ``O_DIRECT`` writer of these bytes must do beside the
  requests: copy every byte once into an aligned 16 MiB staging buffer (torch's file
  format puts tensors at 64-byte offsets, so the bytes cannot go to the disk from the
  tensors' own memory) and hash it once (xxh3_128, the store's default). Its ratio to
  ``o_direct`` is what that work costs the device on this machine: where the virtual
  disk's backend shares the host's CPUs and memory bandwidth with the guest, the
  device itself slows while the guest computes (on the 2-core VM, ~20% beside a
  thread that only copies memory). ``ratio_ours_vs_o_direct_beside_copy_hash`` is the
  store against that.
- ``buffered_writeback``: **the same write strategy as the store**, without the
  store: each tensor's bytes written through the page cache, the kernel asked to
  start writeback every 8 MiB (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, through
  the store's own ``start_writeback``), one fsync at the end. The store's ratio against
  it is the cost of everything else the store does (pickling the structure,
  checksum, manifest, temporary directory, rename, directory fsyncs).
- ``raw_write_fsync``: the naive buffered writer (one ``write()`` per tensor, a
  single fsync at the end, no writeback hint). This was the only baseline before;
  the store beat it mostly by starting writeback early, which this writer does not.
- ``torch_save_fsync``: ``torch.save`` into a file + fsync (what scripts do).
- ``torch_save_nocrc_fsync``: the same with torch's per-record zip CRC32 switched off
  (``torch.serialization.set_crc32_options(False)``), as the store does (its own
  checksum covers every byte). ``torch_save`` / ``torch_save_nocrc`` is the part of
  the store's gain over ``torch.save`` that comes from not computing torch's CRC;
  ``torch_save_nocrc`` / ours is the rest (writeback while writing).
- ``dcp_save``: ``torch.distributed.checkpoint.save`` (no process group).

Methods run interleaved, in a new seeded order each round, so that a busy machine
slows every method alike and no method always follows the same one;
``os.sync()`` runs before each timed call, so no method pays for the writeback of
another's dirty pages. Each figure is the median of ``--repeats`` rounds (three times
as many for states under 200 MB, whose times are short and noisy). ``hash_only``
times the store's default checksum (xxh3_128) over the same bytes, no I/O: the CPU it
needs beside the write. States of 50 MB, 500 MB and 2 GB by default (the 2 GB state
needs ~10 GB of free memory: state, the aligned copy, staging buffers, DCP's copies).

Ratios are "the store is ... x as fast as the baseline" (baseline time / store time):
``ratio_ours_vs_o_direct`` (<= 1 expected: the ceiling), ``ratio_ours_vs_buffered_writeback``
(the store's own overhead), ``ratio_ours_vs_raw``, ``ratio_ours_vs_torch_save``,
``ratio_ours_vs_torch_save_nocrc``, ``ratio_ours_vs_dcp``.

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
  The headline ratio divides it by the sync save's time. What a save costs training
  over a whole checkpoint period (the background write competes for CPU and memory
  bandwidth) is measured by ``bench_loop_overhead.py``.

``--device cuda`` puts the state on the GPU (the store stages it to pinned host
memory); the baselines then write the same bytes from host memory, as they would
after a ``.cpu()``, which is not timed.

Usage::

    .venv/bin/python benchmarks/bench_checkpoint.py            # 50 MB, 500 MB, 2 GB
    .venv/bin/python benchmarks/bench_checkpoint.py --quick    # 50 MB, 200 MB, < 2 min
    .venv/bin/python benchmarks/bench_checkpoint.py --smoke    # 20 MB, one round, seconds

The last line printed is a JSON object with every figure and ratio.
"""

from __future__ import annotations

import os
import shutil
import random
import statistics
import tempfile
import threading
import time
import warnings
from typing import Any, Callable

import torch

from elastic_kit import CheckpointStore, DistInfo

import _common

WRITEBACK_EVERY = 8 << 20  # the store's writeback period on local files


def make_state(total_mb: int, tensor_mb: int = 10, device: str = "cpu") -> dict[str, Any]:
    """A model-like state: ``total_mb`` of float32 tensors plus small bookkeeping."""
    n = max(1, total_mb // tensor_mb)
    numel = tensor_mb * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"layer{i}.weight": torch.randn(numel, generator=g).to(device)
                  for i in range(n)},
        "step": 123,
        "sampler": {"epoch": 1, "consumed": 4096},
    }


def state_nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def host_views(state: dict[str, Any]) -> list[memoryview]:
    """Each tensor's bytes in host memory, in order (copied once from a GPU, untimed)."""
    return [memoryview(t.detach().cpu().numpy()).cast("B") for t in state["model"].values()]


def _timed_write(path: str, write: Callable[[Any], None], *, buffering: int = -1) -> float:
    """Seconds to ``write(f)`` into a new file at ``path``, flush and fsync it."""
    t0 = time.perf_counter()
    with open(path, "wb", buffering=buffering) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def bench_raw(views: list[memoryview], d: str) -> float:
    """The naive writer: one buffered write per tensor, one fsync at the end."""
    def write(f: Any) -> None:
        for v in views:
            f.write(v)

    return _timed_write(os.path.join(d, "raw.bin"), write)


def bench_buffered_writeback(views: list[memoryview], d: str) -> float:
    """The store's strategy without the store: write through the page cache and start
    the disk's writeback every 8 MiB, fsync at the end."""
    def write(f: Any) -> None:
        size = written_back = 0
        for v in views:
            done = 0
            while done < v.nbytes:  # an unbuffered file may write less than asked
                done += f.write(v[done:])
            size += v.nbytes
            if size - written_back >= WRITEBACK_EVERY:
                _common.start_writeback(f.fileno(), written_back, size - written_back)
                written_back = size

    return _timed_write(os.path.join(d, "wb.bin"), write, buffering=0)


class _ODirect:
    """The device ceiling: the state's bytes in one aligned buffer, written O_DIRECT."""

    def __init__(self, views: list[memoryview], d: str) -> None:
        self.path = os.path.join(d, "direct.bin")
        self.buf = _common.aligned_buffer(sum(v.nbytes for v in views))
        off = 0
        for v in views:  # filled once, untimed: the ceiling excludes any copy
            self.buf[off:off + v.nbytes] = v
            off += v.nbytes
        self.staging: Any = None  # beside_copy_hash's staging buffer, made once
        self.supported = _common.write_o_direct(self.path, self.buf)  # also a warm-up
        if os.path.exists(self.path):
            os.remove(self.path)

    def __call__(self, chunk: int = 8 << 20,
                 beside: Callable[[], None] | None = None) -> float:
        """Seconds to write the bytes in ``chunk``-byte requests, then fsync (and,
        with ``beside``, until that function, run on another thread, is done too)."""
        worker = None if beside is None else threading.Thread(target=beside)
        t0 = time.perf_counter()
        if worker is not None:
            worker.start()
        ok = _common.write_o_direct(self.path, self.buf, chunk=chunk)
        if worker is not None:
            worker.join()
        dt = time.perf_counter() - t0
        os.remove(self.path)
        assert ok, "O_DIRECT worked at the warm-up but not now"
        return dt

    def beside_copy_hash(self, views: list[memoryview], chunk: int = 16 << 20) -> float:
        """:meth:`__call__` while another thread copies each byte once into an aligned
        staging buffer and hashes it once."""
        import numpy as np
        import xxhash

        if self.staging is None:
            self.staging = _common.aligned_buffer(chunk)
        stage = np.frombuffer(self.staging, dtype=np.uint8)

        def copy_and_hash() -> None:
            h = xxhash.xxh3_128()
            for v in views:
                src = np.frombuffer(v, dtype=np.uint8)
                for off in range(0, len(src), len(stage)):
                    piece = src[off:off + len(stage)]
                    stage[:len(piece)] = piece
                    h.update(piece)
            h.hexdigest()

        return self(chunk, beside=copy_and_hash)

    def close(self) -> None:
        self.buf.close()
        if self.staging is not None:
            self.staging.close()


def bench_torch_save(state: dict[str, Any], d: str, *, crc: bool = True) -> float:
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    prev = get() if get is not None else True
    if set_ is not None:
        set_(crc)
    try:
        return _timed_write(os.path.join(d, "torch.pt"), lambda f: torch.save(state, f))
    finally:
        if set_ is not None:
            set_(prev)


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
        if src.is_cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        self.store.wait_staged()  # before the optimizer step
        t3 = time.perf_counter()
        self.store.wait()
        return (t1 - t0) + (t3 - t2), t2 - t1


def bench_hash(views: list[memoryview]) -> float:
    """CPU cost of the store's default checksum (xxh3_128) alone, over every tensor."""
    import xxhash

    t0 = time.perf_counter()
    h = xxhash.xxh3_128()
    for v in views:
        h.update(v)
    h.hexdigest()
    return time.perf_counter() - t0


def _ratio(base: float | None, ours: float) -> float | None:
    return None if base is None else round(base / ours, 3)


def measure(size_mb: int, repeats: int, base_dir: str | None, device: str) -> dict[str, Any]:
    """All methods on one state of ``size_mb``, interleaved round-robin."""
    state = make_state(size_mb, device=device)
    nbytes = state_nbytes(state)
    views = host_views(state)
    host_state = state if device == "cpu" else make_state(size_mb)  # same bytes on the host
    if base_dir:
        os.makedirs(base_dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="ek-bench-", dir=base_dir)
    ours = _Ours(base, "xxh3_128")
    ours_crc = _Ours(base, "crc32")
    ours_sha = _Ours(base, "sha256")
    # non-blocking saves get their own stores, as a loop that always saves non-blocking
    # would: its retention runs on the save thread, never on the caller's
    ours_nb = _Ours(os.path.join(base, "nb"), "xxh3_128")
    ours_ov = _Ours(os.path.join(base, "ov"), "xxh3_128")
    scratch = [torch.empty_like(t) for t in state["model"].values()]
    direct = _ODirect(views, base)
    methods: dict[str, Callable[[], float]] = {
        "o_direct_8m": direct,
        "o_direct_16m": lambda: direct(16 << 20),
        "o_direct_beside_copy_hash": lambda: direct.beside_copy_hash(views),
        "buffered_writeback": lambda: bench_buffered_writeback(views, base),
        "raw_write_fsync": lambda: bench_raw(views, base),
        "torch_save_fsync": lambda: bench_torch_save(host_state, base),
        "torch_save_nocrc_fsync": lambda: bench_torch_save(host_state, base, crc=False),
        "dcp_save": lambda: bench_dcp(host_state, base),
        "ours_sync": lambda: ours.sync(state),
        "ours_sync_crc32": lambda: ours_crc.sync(state),
        "ours_sync_sha256": lambda: ours_sha.sync(state),
        "hash_only": lambda: bench_hash(views),
    }
    if not direct.supported:
        del methods["o_direct_8m"], methods["o_direct_16m"], methods["o_direct_beside_copy_hash"]
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
        for r in range(repeats):
            # a new order every round: no method always follows the same neighbour
            # (on a VM disk the previous method's deletions and writeback linger)
            order = list(methods)
            random.Random(r).shuffle(order)
            for name in order:
                settle()
                times[name].append(methods[name]())
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
        direct.close()
        shutil.rmtree(base, ignore_errors=True)

    if "o_direct_8m" in times:
        # the device ceiling: the request size with the faster median (a per-round
        # minimum of two noisy samples would be biased low)
        times["o_direct"] = min(times["o_direct_8m"], times["o_direct_16m"],
                                key=statistics.median)
    med: dict[str, float | None] = {k: statistics.median(v) for k, v in times.items()}
    med.setdefault("o_direct", None)
    med.setdefault("o_direct_beside_copy_hash", None)
    gbps = {k: (None if v is None else nbytes / v / 1e9) for k, v in med.items()}
    ours_t = med["ours_sync"]
    assert ours_t is not None
    per_round = {b: [round(times[b][i] / times["ours_sync"][i], 3) for i in range(repeats)]
                 for b in ("o_direct", "buffered_writeback") if b in times}
    return {
        "size_mb": round(nbytes / 1e6, 1),
        "repeats": repeats,
        "o_direct_supported": direct.supported,
        "seconds": {k: (None if v is None else round(v, 4)) for k, v in med.items()},
        "gb_per_s": {k: (None if v is None else round(v, 3)) for k, v in gbps.items()},
        "ratio_ours_vs_o_direct": _ratio(med["o_direct"], ours_t),
        "ratio_ours_vs_o_direct_per_round": per_round.get("o_direct"),
        "ratio_ours_vs_o_direct_beside_copy_hash": _ratio(med["o_direct_beside_copy_hash"],
                                                          ours_t),
        "ratio_o_direct_beside_copy_hash_vs_o_direct": _ratio(
            med["o_direct"], med["o_direct_beside_copy_hash"] or 1.0),
        "ratio_ours_vs_buffered_writeback": _ratio(med["buffered_writeback"], ours_t),
        "ratio_ours_vs_buffered_writeback_per_round": per_round["buffered_writeback"],
        "ratio_ours_vs_raw": _ratio(med["raw_write_fsync"], ours_t),
        "ratio_ours_vs_torch_save": _ratio(med["torch_save_fsync"], ours_t),
        "ratio_ours_vs_torch_save_nocrc": _ratio(med["torch_save_nocrc_fsync"], ours_t),
        "ratio_torch_save_crc_cost": _ratio(med["torch_save_fsync"],
                                            med["torch_save_nocrc_fsync"] or 1.0),
        "ratio_ours_vs_dcp": _ratio(med["dcp_save"], ours_t),
        "ratio_buffered_writeback_vs_o_direct": _ratio(med["o_direct"],
                                                       med["buffered_writeback"] or 1.0),
        "ratio_crc32_vs_buffered_writeback": _ratio(med["buffered_writeback"],
                                                    med["ours_sync_crc32"] or 1.0),
        "ratio_sha256_vs_buffered_writeback": _ratio(med["buffered_writeback"],
                                                     med["ours_sync_sha256"] or 1.0),
        "nonblocking_copy_in_save_blocked_s": round(statistics.median(blocked), 4),
        "nonblocking_total_s": round(statistics.median(nb_total), 4),
        "ratio_copy_in_save_blocked_vs_sync": round(statistics.median(blocked) / ours_t, 3),
        "overlapped_blocked_s": round(statistics.median(ov_blocked), 4),
        "overlapped_blocked_s_per_round": [round(b, 4) for b in ov_blocked],
        "overlapped_step_s": round(statistics.median(ov_step), 4),
        "ratio_nonblocking_blocked_vs_sync": round(statistics.median(ov_blocked) / ours_t, 3),
        "load_avg_1m": _common.load_avg(),
    }


RATIOS = ("ratio_ours_vs_o_direct", "ratio_ours_vs_o_direct_beside_copy_hash",
          "ratio_o_direct_beside_copy_hash_vs_o_direct", "ratio_ours_vs_buffered_writeback",
          "ratio_ours_vs_raw",
          "ratio_ours_vs_torch_save", "ratio_ours_vs_torch_save_nocrc",
          "ratio_torch_save_crc_cost", "ratio_ours_vs_dcp",
          "ratio_nonblocking_blocked_vs_sync", "ratio_copy_in_save_blocked_vs_sync")


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--sizes", default=None,
                    help="comma-separated state sizes in MB (default 50,500,2000; "
                         "quick 50,200; smoke 20)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: tmp)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the state lives (cuda: the store stages to pinned memory)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    sizes = [int(x) for x in (args.sizes or ("20" if args.smoke else "50,200" if args.quick
                                              else "50,500,2000")).split(",")]
    repeats = args.repeats or (1 if args.smoke else 3 if args.quick else 5)
    small_repeats = repeats if args.smoke else 3 * repeats  # short, noisy timings
    torch.set_num_threads(1)
    load0 = _common.load_avg()
    per_size = {}
    for size_mb in sizes:
        r = measure(size_mb, small_repeats if size_mb < 200 else repeats, args.dir, args.device)
        per_size[str(size_mb)] = r
        print(f"state {r['size_mb']} MB on {args.device}, median of {r['repeats']} "
              f"(load {r['load_avg_1m']}):")
        for k, v in r["seconds"].items():
            print(f"  {k:<24} {_fmt(v, '7.3f')} s  {_fmt(r['gb_per_s'][k], '6.3f')} GB/s")
        print(f"  ours vs O_DIRECT ceiling {_fmt(r['ratio_ours_vs_o_direct'])}, vs the ceiling "
              f"beside one copy + hash of the bytes "
              f"{_fmt(r['ratio_ours_vs_o_direct_beside_copy_hash'])} (which is "
              f"{_fmt(r['ratio_o_direct_beside_copy_hash_vs_o_direct'])}x the ceiling)")
        print(f"  ours vs the same "
              f"writeback strategy {_fmt(r['ratio_ours_vs_buffered_writeback'])}, vs naive "
              f"write+fsync {_fmt(r['ratio_ours_vs_raw'])}", flush=True)
        print(f"  ours vs torch.save {_fmt(r['ratio_ours_vs_torch_save'])} (of which torch's "
              f"zip CRC {_fmt(r['ratio_torch_save_crc_cost'])}x, the rest "
              f"{_fmt(r['ratio_ours_vs_torch_save_nocrc'])}x), vs DCP "
              f"{_fmt(r['ratio_ours_vs_dcp'])}", flush=True)
        print(f"  non-blocking, copy in save(): blocked {r['nonblocking_copy_in_save_blocked_s']:.3f}"
              f" s ({r['ratio_copy_in_save_blocked_vs_sync']:.3f}x sync); overlapped with a "
              f"{r['overlapped_step_s']:.3f} s step: blocked {r['overlapped_blocked_s']:.3f} s "
              f"({r['ratio_nonblocking_blocked_vs_sync']:.3f}x sync)", flush=True)
    res: dict[str, Any] = {
        "claim": "checkpoint_save",
        "baseline": "O_DIRECT write of the same bytes in 8 or 16 MiB requests, the faster (device ceiling); the same "
                    "beside one copy + xxh3 of the bytes on another thread; buffered write with "
                    "the store's writeback every 8 MiB; naive write+fsync; torch.save + fsync "
                    "(with and without its zip CRC); torch.distributed.checkpoint.save",
        "device": args.device,
        "sizes_mb": sizes,
        "repeats": repeats,
        **{k: {s: v[k] for s, v in per_size.items()} for k in RATIOS},
        "per_size": per_size,
        "load_avg_1m_start": load0,
    }
    res.update(_common.machine())
    if not args.no_plot and not args.smoke and len(sizes) > 1:
        plt = _common.pyplot()
        fig, ax = plt.subplots(figsize=(9, 4.2))
        names = ["o_direct", "buffered_writeback", "ours_sync", "raw_write_fsync",
                 "torch_save_fsync", "torch_save_nocrc_fsync", "dcp_save"]
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            ax.bar([j + i * width for j in range(len(sizes))],
                   [per_size[str(s)]["gb_per_s"][n] or 0.0 for s in sizes], width, label=n)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))],
                      [f"{per_size[str(s)]['size_mb']:.0f} MB" for s in sizes])
        ax.set_ylabel("GB/s (median)")
        ax.set_title("synchronous save to local disk, incl. fsync")
        ax.legend(fontsize=7)
        fig.tight_layout()
        res["plot"] = _common.save_plot(fig, "checkpoint_cpu2_202611.png")
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
