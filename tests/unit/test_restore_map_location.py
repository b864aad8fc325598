"""``restore(map_location=...)`` takes what ``torch.load`` takes, on every path: a
callable (``lambda storage, loc: storage``, the old idiom for "load onto the CPU")
worked on a first start (``torch.load`` of the store) and failed the first restart
that found a snapshot in memory, even at world size 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import elastic_kit as ek
from elastic_kit.store import target_device


def _run(root: Path, seed: int) -> tuple[torch.nn.Module, ek.Checkpointer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, ek.Checkpointer(ek.TrainState(model, opt), str(root), handle_signals=False,
                                  snapshot_every=1, info=ek.DistInfo())


@pytest.mark.parametrize("map_location", [lambda storage, loc: storage,
                                          lambda storage, loc: None, "cpu", {"cpu": "cpu"}],
                         ids=["callable", "callable-None", "str", "dict"])
def test_a_restart_restores_from_memory_with_any_map_location(
        shm: str, tmp_path: Path, map_location: Any) -> None:
    model, ckpt = _run(tmp_path / "ck", seed=0)
    ckpt.restore(map_location=map_location)
    for _ in range(3):
        model(torch.randn(4, 8)).square().mean().backward()
        ckpt.state.optimizer.step()
        ckpt.state.optimizer.zero_grad()
        ckpt.step(4)
    assert ckpt.snapshots is not None and ckpt.snapshots.wait(timeout=60)
    weight = model.weight.detach().clone()
    ckpt.abandon()  # as a failing worker ends: its snapshots stay

    again, ckpt = _run(tmp_path / "ck", seed=1)
    ckpt.restore(map_location=map_location)
    try:
        assert (ckpt.restored_from, ckpt.restored_step) == ("memory", 3)
        assert torch.equal(again.weight, weight) and again.weight.device.type == "cpu"
    finally:
        ckpt.close()


def test_target_device_asks_a_callable_where_a_cpu_storage_goes() -> None:
    assert target_device(lambda storage, loc: storage) == torch.device("cpu")
    with pytest.raises(TypeError, match="returned 3 for a CPU storage"):
        target_device(lambda storage, loc: 3)
    with pytest.raises(TypeError, match="map_location=5: expected a device"):
        target_device(5)
