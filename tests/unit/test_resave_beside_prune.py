"""A re-save of a committed step while a prune (of this or another process) deletes
that step must not report success with a manifest naming files that are gone.

On a local disk the re-save's rename into the deleted step fails; on an object store
the manifest's PUT would land on its own. ``memory://`` goes through the same
object-store backend as ``s3://``; the prune (the CLI's, in this process) runs at the
moment of the manifest's PUT, through a real fsspec filesystem wrapper."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
import torch

from elastic_kit.cli import main
from elastic_kit.store import CheckpointStore
from elastic_kit.testing import FaultFileSystem


def _store(tmp_path: Path) -> tuple[CheckpointStore, FaultFileSystem, str]:
    root = f"/resave-{tmp_path.name}"
    fs = FaultFileSystem(fsspec.filesystem("memory"))
    store = CheckpointStore(root, filesystem=fs, keep_last=None)
    for s in (1, 2, 3):
        store.save({"w": torch.full((10,), float(s))}, step=s)
    return store, fs, f"memory://{root}"


def test_a_resave_whose_step_a_prune_deleted_fails_and_leaves_no_broken_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, fs, url = _store(tmp_path)
    pruned: list[int] = []
    fs.add("pipe", match="step-000000000001/manifest.json",
           before=lambda p: pruned.append(main(["prune", "--keep", "1", url])))
    with pytest.raises(FileNotFoundError, match=r"step-000000000001.*deleted while"):
        store.save({"w": torch.full((10,), 9.0)}, step=1)  # the re-save of step 1
    assert pruned == [0]
    assert [i.step for i in store.list()] == [3]
    assert [(s, problem) for s, _, problem in store.verify()] == [(3, None)]
    loaded = store.load()
    assert loaded is not None and loaded.step == 3
    capsys.readouterr()


def test_a_resave_that_nothing_deleted_replaces_the_step(tmp_path: Path) -> None:
    store, _, _ = _store(tmp_path)
    store.save({"w": torch.full((10,), 9.0)}, step=3)
    assert [i.step for i in store.list()] == [1, 2, 3]
    loaded = store.load()
    assert loaded is not None and loaded.step == 3 and torch.equal(loaded.state["w"], torch.full((10,), 9.0))
    assert [problem for _, _, problem in store.verify()] == [None, None, None]
