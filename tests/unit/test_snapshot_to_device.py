"""A mapped snapshot's tensors copied to a device through reused buffers, window by
window: every byte lands where it belongs whatever the window size, and nothing
returned shares memory with the mapping.

The CPU stands in for the device here (the same windows, buffers and copies, without
pinning or a side stream); ``tests/gpu`` runs the CUDA path."""

from __future__ import annotations

import pytest
import torch

from elastic_kit.snapshot._to_device import copy_to_device


def _mapped_state() -> tuple[torch.Tensor, dict]:
    mapped = torch.randint(0, 256, (4096,), dtype=torch.uint8)

    def view(offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = torch.empty(shape, dtype=dtype).nbytes
        return mapped[offset:offset + n].view(dtype).view(shape)

    state = {
        "model": {"w": view(64, torch.float32, (10, 7)), "b": view(384, torch.float64, (5,)),
                  "flag": view(448, torch.bool, (3,))},
        "optim": {"state": {0: {"exp_avg": view(512, torch.bfloat16, (1000,)),
                                "step": view(2560, torch.int64, ())}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
        "strided": view(2624, torch.float32, (8, 8)).t(),   # not contiguous: copied with .to
        "own": torch.arange(4),                             # not a view of the mapping
        "empty": view(3000, torch.float32, (0,)),
        "note": "kept",
    }
    return mapped, state


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _leaves(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}/{k}"))
        return out
    if isinstance(tree, list):
        out = {}
        for i, v in enumerate(tree):
            out.update(_leaves(v, f"{prefix}/{i}"))
        return out
    return {prefix: tree}


@pytest.mark.parametrize("window_bytes,windows", [(1 << 20, 3), (100, 2), (7, 1), (13, 3)])
def test_every_tensor_arrives_whole_whatever_the_windows(window_bytes: int, windows: int) -> None:
    mapped, state = _mapped_state()
    phases: dict[str, float] = {}
    out = copy_to_device(mapped, state, torch.device("cpu"), phases,
                         window_bytes=window_bytes, windows=windows)
    want, got = _leaves(state), _leaves(out)
    assert got.keys() == want.keys()
    lo, hi = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
    for k, v in want.items():
        if not isinstance(v, torch.Tensor):
            assert got[k] == v, k
            continue
        g = got[k]
        assert isinstance(g, torch.Tensor) and g.dtype == v.dtype and g.shape == v.shape, k
        assert torch.equal(_raw(g), _raw(v)), k   # bytes: random bits hold NaNs
        assert not (v.numel() and lo <= g.data_ptr() < hi), f"{k} still views the mapping"
    # the 70*4 + 5*8 + 3 + 1000*2 + 8 bytes of the contiguous views went through the buffers
    assert phases["bytes"] == 280 + 40 + 3 + 2000 + 8
    assert phases["copy_s"] >= 0 and phases["alloc_s"] >= 0


def test_the_copies_are_independent_of_the_mapping() -> None:
    mapped, state = _mapped_state()
    out = copy_to_device(mapped, state, torch.device("cpu"), window_bytes=64)
    before = _raw(out["model"]["w"]).clone()
    mapped.fill_(0)
    assert torch.equal(_raw(out["model"]["w"]), before)


def test_bad_windows_are_refused() -> None:
    mapped, state = _mapped_state()
    with pytest.raises(ValueError, match="window_bytes=0"):
        copy_to_device(mapped, state, torch.device("cpu"), window_bytes=0)
