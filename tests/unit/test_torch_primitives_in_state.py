"""What ``torch.load(weights_only=True)`` reads back, a checkpoint keeps: dicts keyed by
a dtype or a device (a mixed-precision recipe's per-dtype loss scales), ``torch.layout``
and ``torch.qscheme`` values. They were refused with a message saying weights-only
loading could not read them back, which it can. A bytearray is refused, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import elastic_kit as ek


def _state() -> dict:
    return {"scales": {torch.float16: torch.tensor(1024.0), torch.bfloat16: 1.0},
            "where": {torch.device("cpu"): 3, (torch.float32, 2): "pair"},
            "layout": torch.strided, "qscheme": torch.per_tensor_affine,
            "shape": {torch.Size([2, 3]): 6}, "z": {1j: 2}}


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    assert set(got["scales"]) == {torch.float16, torch.bfloat16}
    assert torch.equal(got["scales"][torch.float16], torch.tensor(1024.0))
    assert got["scales"][torch.bfloat16] == 1.0
    assert got["where"] == {torch.device("cpu"): 3, (torch.float32, 2): "pair"}
    assert got["layout"] is torch.strided and got["qscheme"] is torch.per_tensor_affine
    assert got["shape"] == {torch.Size([2, 3]): 6} and got["z"] == {1j: 2}


@pytest.mark.parametrize("blocking", [True, False])
def test_torch_keys_and_values_round_trip_through_the_store(tmp_path: Path,
                                                             blocking: bool) -> None:
    store = ek.CheckpointStore(str(tmp_path / "ck"))
    store.save(_state(), step=1, blocking=blocking)
    store.wait()
    _assert_same(store.load().state, _state())
    assert all(p is None for _, _, p in store.verify())


def test_torch_keys_round_trip_through_a_snapshot(shm: str, tmp_path: Path) -> None:
    def run(seed: int) -> tuple[ek.TrainState, ek.Checkpointer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 4)
        state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              extras={"amp": _state() if seed == 0 else {}})
        return state, ek.Checkpointer(state, str(tmp_path / "ck"), handle_signals=False,
                                      snapshot_every=1, info=ek.DistInfo())

    state, ckpt = run(0)
    ckpt.restore()
    ckpt.step(1)
    assert ckpt.snapshots is not None and ckpt.snapshots.wait(timeout=60)
    ckpt.abandon()
    state, ckpt = run(1)
    try:
        ckpt.restore()
        assert ckpt.restored_from == "memory"
        _assert_same(state.extras["amp"], _state())
    finally:
        ckpt.close()


def test_a_bytearray_is_refused_with_the_reason(tmp_path: Path) -> None:
    store = ek.CheckpointStore(str(tmp_path / "ck"))
    with pytest.raises(TypeError, match=r"state\['buf'\] is a bytearray.*bytes\(value\)"):
        store.save({"buf": bytearray(b"ab")}, step=1)
    assert store.list() == []
