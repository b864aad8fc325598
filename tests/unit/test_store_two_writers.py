"""Two writers of one step on an object store (a stale process from an earlier restart
and its successor, both saving step 5): each save names its files afresh, so the
manifest that lands last names its own intact bytes and the step stays loadable,
whatever the order of the two writers' uploads."""

from __future__ import annotations

import uuid
from typing import Any

import fsspec
import torch

from elastic_kit.store import CheckpointStore
from elastic_kit.testing import FaultFileSystem


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((1000,), v)}


def test_the_later_manifest_of_a_step_names_intact_bytes() -> None:
    root = f"memory://ek-two-writers-{uuid.uuid4().hex}"
    ffs = FaultFileSystem(fsspec.filesystem("memory"))
    stale = CheckpointStore(root, keep_last=1)
    new = CheckpointStore(root, keep_last=1, filesystem=ffs)
    new.save(_state(4.0), step=4)

    def stale_commits_first(path: str) -> None:  # between the new payload and its manifest
        stale.save(_state(-5.0), step=5)

    ffs.add("pipe", match="step-000000000005/manifest.json", before=stale_commits_first)
    new.save(_state(5.0), step=5)          # its manifest lands last
    assert ffs.fired("pipe") == 1
    loaded = CheckpointStore(root).load()
    assert loaded is not None and loaded.step == 5
    assert torch.equal(loaded.state["w"], _state(5.0)["w"])
    assert {step: problem for step, _, problem in CheckpointStore(root).verify()} == {5: None}
