"""The collectives a state moves through, on real gloo ranks: a tensor handed to many
collectives (a per-step flag, a parameter broadcast at every restore) is held once
and released, and a broadcast carries dtypes gloo has no reduction type for."""

from __future__ import annotations

import time
from typing import Any

import torch

import elastic_kit as ek
from elastic_kit import _collectives
from elastic_kit.testing import spawn_multi_process


def _reuse_one_tensor() -> dict[str, Any]:
    info = ek.init_distributed()
    flag = torch.zeros(1)
    peaks = []
    for step in range(300):  # one flag tensor reused at every step
        flag.fill_(step + info.rank)
        _collectives.all_reduce_(flag, torch.distributed.ReduceOp.MAX)
        peaks.append(int(flag.item()))
    weight = torch.nn.Linear(3, 3).weight  # a parameter, broadcast again and again
    if info.rank == 0:
        with torch.no_grad():
            weight.copy_(torch.arange(9.0).reshape(3, 3))
    for _ in range(5):
        ek.distributed.broadcast_tensors([weight], src=0)
    held = _collectives._prune_held()
    for _ in range(50):  # what stays held once the backend let go (its thread may
        if held == 0:    # drop the last work item a moment after wait() returned)
            break
        time.sleep(0.01)
        held = _collectives._prune_held()
    start = time.monotonic()
    settled = ek.distributed.settle_collectives(5.0)
    return {"peaks_ok": peaks == [s + info.world_size - 1 for s in range(300)],
            "weight": weight.detach().flatten().tolist(), "held_after": held,
            "settled": settled, "settle_s": time.monotonic() - start,
            "pinned": len(_collectives._pinned)}


def test_a_tensor_reused_by_many_collectives_is_released_and_exit_does_not_wait() -> None:
    out = spawn_multi_process(2, _reuse_one_tensor)
    for rank in out:
        assert rank["peaks_ok"] is True
        assert rank["weight"] == [float(i) for i in range(9)]
        assert rank["held_after"] == 0
        assert rank["settled"] is True and rank["pinned"] == 0
        assert rank["settle_s"] < 1.0


_SOURCES = {
    "float8_e4m3fn": lambda: torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
    "float8_e5m2": lambda: torch.tensor([1.5, -0.25]).to(torch.float8_e5m2),
    "uint16": lambda: torch.tensor([1, 65535, 300], dtype=torch.uint16),
    "int16": lambda: torch.tensor([-32768, 7], dtype=torch.int16),
    "uint32": lambda: torch.tensor([4000000000, 1], dtype=torch.uint32),
    "uint16 0-d": lambda: torch.tensor(513, dtype=torch.uint16),
    "uint16 transposed": lambda: torch.arange(6, dtype=torch.int32).to(torch.uint16)
    .reshape(2, 3).t(),
    "float32": lambda: torch.tensor([1.0, 2.5]),
}


def _broadcast_each_dtype() -> dict[str, list[int]]:
    info = ek.init_distributed()
    got: dict[str, list[int]] = {}
    for name, make in _SOURCES.items():
        src = make()
        t = src.clone() if info.rank == 0 else torch.zeros_like(src)
        if name.endswith("transposed") and info.rank != 0:
            t = torch.zeros(2, 3, dtype=src.dtype).t()  # non-contiguous, same shape
        ek.distributed.broadcast_tensors([t], src=0)
        got[name] = [t.dtype == src.dtype, *t.contiguous().reshape(-1).view(torch.uint8).tolist()]
    return got


def test_broadcast_carries_dtypes_gloo_lacks_bit_for_bit() -> None:
    expected = {name: [True, *make().contiguous().reshape(-1).view(torch.uint8).tolist()]
                for name, make in _SOURCES.items()}
    out = spawn_multi_process(2, _broadcast_each_dtype)
    assert out == [expected, expected]
