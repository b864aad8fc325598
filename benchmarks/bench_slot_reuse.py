"""A restarted writer's first snapshot file: a killed worker's file reused, against a new one.

A snapshot writer copies each snapshot into one of two reused files in shared memory
(``elastic_kit/snapshot/_slots.py``). A worker killed mid-run leaves its free file
behind, a file of the state's size whose pages exist. Its restarted writer used to
remove it and make a new file: allocate and zero every page of it (the first touch,
on the writer thread and the shared thread pool, while training goes on; on CUDA the
file is then registered as pinned memory). Now it takes the dead worker's file over
(:meth:`Slots.claim_dead`) and only passes over its pages once, so that the snapshot
copies into it do not take the page faults on the training thread.

Arms, interleaved, each on a file of ``--mib`` MiB in ``/dev/shm`` (a state's layout
of 1 MiB tensors):

- ``reused``: a dead process's slot file (already touched) claimed and made the slot;
- ``new``: the slot made as a new file (what a restart did before, and what a
  first start does);
- ``copy``: a memory copy of the same bytes into pages already mapped: the floor of
  what putting a snapshot into the file costs.

Each arm also times the first copy of the state into the slot it made (the snapshot
the training thread then takes): equal in both, since both passed over the pages.
Last line: JSON with the median seconds and ``ratio_reused_vs_new`` (< 1: faster).

    .venv/bin/python benchmarks/bench_slot_reuse.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from elastic_kit.snapshot._slots import SLOT_PREFIX, Slots  # noqa: E402
from elastic_kit.store import map_file, plan_flat  # noqa: E402

DEAD_PID = 2**22 + 7  # above Linux's largest pid (pid_max <= 2**22): never alive


def _dead_file(node: str, size: int, n: int) -> str:
    """A killed worker's free slot file: its size, every page touched."""
    path = os.path.join(node, f"{SLOT_PREFIX}{DEAD_PID}-dead{n:04d}-1")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    mapped = map_file(path, size)
    mapped.fill_(0xAB)
    del mapped
    return path


def _arm(node: str, items: list[tuple[str, torch.Tensor]], *, reuse: bool,
         n: int) -> tuple[float, float, bool]:
    """Seconds to make the slot, then to copy the state into it; whether it was reused."""
    plan = plan_flat(items)
    if reuse:
        _dead_file(node, plan.size, n)
    slots = Slots(node)
    t0 = time.perf_counter()
    if reuse:
        slots.claim_dead()
    slots.prepare(plan)
    made = time.perf_counter() - t0
    slot = slots.take(items)
    assert slot is not None
    t0 = time.perf_counter()
    for view, (_, t) in zip(slot.views, items):
        view.copy_(t)
    copied = time.perf_counter() - t0
    reused = slot.reused
    slots.done(slot, None)
    slots.close()
    return made, copied, reused


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--mib", type=int, default=None, help="file size in MiB (default 1024)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of each arm (default 5)")
    args = ap.parse_args()
    mib = args.mib or (8 if args.smoke else 512 if args.quick else 1024)
    rounds = args.rounds or (1 if args.smoke else 3 if args.quick else 5)
    torch.manual_seed(0)
    items = [(f"t{i}", torch.randn(1 << 18)) for i in range(mib)]  # 1 MiB each
    load_start = _common.load_avg()
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    node = tempfile.mkdtemp(prefix="ek-bench-slot-", dir=root)
    made: dict[str, list[float]] = {"reused": [], "new": []}
    first_copy: dict[str, list[float]] = {"reused": [], "new": []}
    copies: list[float] = []
    try:
        dst = [torch.empty_like(t) for _, t in items]
        for d, (_, t) in zip(dst, items):
            d.copy_(t)  # pages of the floor's destination mapped
        for r in range(rounds):
            for arm in (("reused", "new") if r % 2 == 0 else ("new", "reused")):
                m, c, reused = _arm(node, items, reuse=arm == "reused", n=r)
                assert reused == (arm == "reused"), f"{arm}: reused={reused}"
                made[arm].append(m)
                first_copy[arm].append(c)
            t0 = time.perf_counter()
            for d, (_, t) in zip(dst, items):
                d.copy_(t)
            copies.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(node, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in made.items()}
    copy_s = statistics.median(copies)
    result: dict[str, Any] = {
        "claim": "slot_reuse",
        "baseline": "a new snapshot file (allocated and zeroed, what a restart did before); "
                    "a memory copy of the same bytes into mapped pages (the floor)",
        "bytes": mib << 20, "rounds": rounds,
        "torch_threads": torch.get_num_threads(),
        "reused_make_s": _common.spread(made["reused"]),
        "new_make_s": _common.spread(made["new"]),
        "reused_first_copy_s": _common.spread(first_copy["reused"]),
        "new_first_copy_s": _common.spread(first_copy["new"]),
        "copy_s": round(copy_s, 4),
        "ratio_reused_vs_new": round(med["reused"] / med["new"], 3),
        "ratio_reused_vs_copy": round(med["reused"] / copy_s, 3),
        "ratio_new_vs_copy": round(med["new"] / copy_s, 3),
        "load_avg_1m_start": load_start,
        "load_avg_1m": load_start,
        "machine": _common.machine(),
    }
    _common.emit(result, args.results)


if __name__ == "__main__":
    main()
