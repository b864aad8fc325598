"""A save returns a handle: ``staged`` and ``committed`` futures, as DCP's async save does."""

from __future__ import annotations

import threading

import fsspec
import pytest
import torch

import elastic_kit as ek
from elastic_kit.testing import FaultFileSystem


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), v), "b": torch.arange(4.0) + v}


def test_a_blocking_save_returns_a_resolved_handle_of_its_step(tmp_path) -> None:
    store = ek.CheckpointStore(str(tmp_path / "ck"))
    handle = store.save(_state(1.0), step=7)
    assert isinstance(handle, ek.SaveHandle) and handle.step == 7
    assert handle.staged.done() and handle.committed.done() and handle.done()
    handle.wait()
    assert [i.step for i in store.list()] == [7]
    store.close()


def test_committed_resolves_after_the_commit_and_staged_after_the_deferred_copy(
        tmp_path) -> None:
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    release = threading.Event()
    ffs.add("pipe", match="manifest.json", before=lambda path: release.wait(30), times=None)
    store = ek.CheckpointStore(str(tmp_path / "ck"), filesystem=ffs)
    live = _state(2.0)
    handle = store.save(live, step=3, blocking=False, copy_later=[live["w"]])
    handle.staged.result(timeout=30)  # the deferred copy is done: the tensors may change
    live["w"].fill_(-1.0)
    assert not handle.committed.done()  # the manifest write is held
    release.set()
    handle.wait(timeout=30)
    assert handle.done()
    loaded = store.load()
    assert loaded is not None and loaded.step == 3
    assert torch.equal(loaded.state["w"], torch.full((64,), 2.0))  # as at save time
    store.close()


def test_a_failed_write_is_raised_by_its_handle_and_by_the_next_store_call(tmp_path) -> None:
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("open", match="/state.", mode="wb", error=OSError(28, "No space left on device"))
    store = ek.CheckpointStore(str(tmp_path / "ck"), filesystem=ffs)
    handle = store.save(_state(3.0), step=5, blocking=False)
    with pytest.raises(OSError, match="No space left"):
        handle.wait(timeout=30)
    assert handle.done() and isinstance(handle.committed.exception(), OSError)
    with pytest.raises(OSError, match="No space left"):
        store.wait()
    assert store.list() == []
    store.close()


def test_a_rank_that_does_not_write_gets_a_resolved_handle(tmp_path) -> None:
    info = ek.DistInfo(rank=1, world_size=2, local_rank=1, local_world_size=2)
    store = ek.CheckpointStore(str(tmp_path / "ck"), info=info)
    handle = store.save(_state(4.0), step=2, blocking=False)
    assert handle.step == 2 and handle.done() and handle.staged.done()
    assert not (tmp_path / "ck").exists() or store.list() == []
