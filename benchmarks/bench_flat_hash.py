"""A snapshot file's checksums: the commit's pass over the bytes, against reading them.

Every snapshot's commit hashes its file on the writer's thread pool before the
manifest is written: each chunk's checksum (xxh3) and each tensor's layout-independent
digest (``elastic_kit/store/_digest.py``). On a GPU host that pass is most of the time
from taking a snapshot to its commit. This measures ``hash_flat`` on a file in shared
memory laid out as the snapshots lay out a state, interleaved with:

- ``two_pass``: the same checksums and digests computed as before, one pass for the
  chunks' checksums and another for the tensors' digests (each on the same pool);
- ``xxh3_only``: the chunks' checksums alone (one pass, on the same pool): the floor,
  since every byte must be read once to be checked.

States (``--layout``): ``linear4096``, 12 tensors of 4096 x 4096 float32 (the GPU
benchmark's layers and their two AdamW moments, 805 MB); ``linear1024``: 21 layers of
1024 x 1024 with bias and two moments (``bench_snapshot.py``'s CPU state, 264 MB).

Last line: JSON with ``ratio_hash_flat_vs_two_pass`` (> 1: faster than before) and
``ratio_hash_flat_vs_xxh3_only`` (1: at the floor), per layout.

    .venv/bin/python benchmarks/bench_flat_hash.py
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from elastic_kit.store import hash_flat, plan_flat, tensor_views  # noqa: E402
from elastic_kit.store._digest import combine, partial  # noqa: E402
from elastic_kit.store._flat_commit import _submit  # noqa: E402
from elastic_kit.store._serialize import new_hasher  # noqa: E402


def _layout(name: str, scale: float) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    if name == "linear4096":
        n = max(1, round(4 * scale))
        return [(f"{k}{i}", torch.randn(4096, 4096, generator=g))
                for i in range(n) for k in ("w", "m", "v")]
    n = max(1, round(21 * scale))
    return [(f"{k}{i}{b}", torch.randn(*shape, generator=g))
            for i in range(n) for k in ("w", "m", "v")
            for b, shape in (("", (1024, 1024)), ("b", (1024,)))]


def _xxh3(mapped: torch.Tensor, offset: int, nbytes: int) -> str:
    h = new_hasher("xxh3_128")
    h.update(mapped[offset:offset + nbytes].numpy())
    return str(h.hexdigest())


def _two_pass(mapped: torch.Tensor, plan: Any) -> tuple[list[str], list[str]]:
    sums = [_submit(_xxh3, mapped, o, n) for _, _, _, o, n in plan.chunks]
    digests = [_submit(lambda t=t: combine([partial(t, (0,) * t.dim(), t.shape)]))
               for t in tensor_views(mapped, plan)]
    return [f.result() for f in sums], [f.result() for f in digests]


def _xxh3_only(mapped: torch.Tensor, plan: Any) -> list[str]:
    return [f.result() for f in [_submit(_xxh3, mapped, o, n) for _, _, _, o, n in plan.chunks]]


def _measure(items: list[tuple[str, torch.Tensor]], rounds: int) -> dict[str, Any]:
    plan = plan_flat(items)
    work = tempfile.mkdtemp(prefix="ek-bench-hash-",
                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        path = os.path.join(work, "tensors.bin")
        with open(path, "wb") as f:
            f.truncate(plan.size)
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, plan.size)
        os.close(fd)
        mapped = torch.frombuffer(mm, dtype=torch.uint8)
        for view, (_, t) in zip(tensor_views(mapped, plan), items):
            view.copy_(t)
        ours = hash_flat(mapped, plan)  # also the warm-up: pages, pool, weights
        chunks, digests = _two_pass(mapped, plan)
        assert list(ours.chunks) == chunks and list(ours.digests) == digests, "mismatch"
        arms: dict[str, Callable[[], Any]] = {
            "hash_flat": lambda: hash_flat(mapped, plan),
            "two_pass": lambda: _two_pass(mapped, plan),
            "xxh3_only": lambda: _xxh3_only(mapped, plan),
        }
        times: dict[str, list[float]] = {k: [] for k in arms}
        for r in range(rounds):
            for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
                t0 = time.perf_counter()
                arms[name]()
                times[name].append(time.perf_counter() - t0)
        del mapped, view
        mm.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = plan.size / 1e9
    return {"bytes": plan.size, "chunks": len(plan.chunks), "tensors": len(items),
            "seconds": {k: _common.spread(v) for k, v in times.items()},
            "gb_per_s": {k: round(gb / s, 2) for k, s in med.items()},
            "ratio_hash_flat_vs_two_pass": round(med["two_pass"] / med["hash_flat"], 3),
            "ratio_hash_flat_vs_xxh3_only": round(med["xxh3_only"] / med["hash_flat"], 3)}


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--layout", default="linear4096,linear1024",
                    help="comma-separated: linear4096 (805 MB), linear1024 (264 MB)")
    args = ap.parse_args()
    scale = 0.05 if args.smoke else 1.0
    rounds = 2 if args.smoke else 6 if args.quick else 20
    load0 = _common.load_avg()
    per: dict[str, Any] = {}
    for name in args.layout.split(","):
        if name not in ("linear4096", "linear1024"):
            ap.error(f"--layout: {name!r} is not linear4096 or linear1024")
        per[name] = _measure(_layout(name, scale), rounds)
    result = {
        "claim": "flat_hash",
        "baseline": "the same checksums and digests in two passes (chunks, then tensors); "
                    "the chunks' xxh3 alone (one read of every byte, the floor); same pool",
        "rounds": rounds, "pool_threads": min(8, os.cpu_count() or 1),
        "ratio_hash_flat_vs_two_pass": {k: v["ratio_hash_flat_vs_two_pass"]
                                        for k, v in per.items()},
        "ratio_hash_flat_vs_xxh3_only": {k: v["ratio_hash_flat_vs_xxh3_only"]
                                         for k, v in per.items()},
        "per_layout": per, "load_avg_1m_start": load0, "load_avg_1m": load0,
        **_common.machine(),
        "load_avg_1m_end": _common.load_avg(),
    }
    _common.emit(result, args.results)


if __name__ == "__main__":
    main()
