"""A sharded snapshot's restore: the replicated rest of the state, broadcast from part
0's holder, reaches the requested device on the holder too (the other ranks get it
there from the broadcast), and the holder keeps no view of the part's mapping."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

import elastic_kit.snapshot._shards as shards


@pytest.fixture
def holder(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Part 0's holder (rank 0 of 2), whose broadcasts hand back what they send, as the
    source's do; the manifest and the record stood in for."""
    class Manifest:
        metadata: dict[str, Any] = {}

        @staticmethod
        def from_json(text: str, where: str) -> Manifest:
            return Manifest()

        def to_json(self) -> str:
            return "{}"

    monkeypatch.setattr(shards, "broadcast_object", lambda obj, src: obj)
    monkeypatch.setattr(shards, "broadcast_state", lambda tree, **_: tree)
    monkeypatch.setattr(shards, "Manifest", Manifest)
    monkeypatch.setattr(shards, "LoadedCheckpoint", types.SimpleNamespace(
        from_manifest=lambda path, m, state: types.SimpleNamespace(state=state, metadata={})))
    mapped = torch.arange(16, dtype=torch.float32)  # the part's mapping
    src = types.SimpleNamespace(state={"buf": mapped[:4], "rng": mapped[4:8], "step": 3},
                                manifest=Manifest())

    def assemble(device: torch.device | None) -> dict[str, Any]:
        info = types.SimpleNamespace(rank=0, world_size=2)
        out = shards._assemble(None, {0: (0, "node0", "/part", {"tensors": []})}, info,
                               {"/part": src}, {}, {}, device, True)
        return out.state

    return mapped, assemble


def test_the_holders_replicated_tensors_go_to_the_requested_device(holder: Any) -> None:
    mapped, assemble = holder
    state = assemble(torch.device("meta"))
    assert state["buf"].device.type == "meta" and state["rng"].device.type == "meta"
    assert state["step"] == 3


def test_on_the_cpu_the_holder_keeps_copies_not_views_of_the_mapping(holder: Any) -> None:
    mapped, assemble = holder
    state = assemble(None)
    assert torch.equal(state["buf"], mapped[:4])
    assert state["buf"].untyped_storage().data_ptr() != mapped.untyped_storage().data_ptr()
