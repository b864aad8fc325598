"""CheckpointStore behaviour on local paths and ``memory://``: the shared contract
(:mod:`tests.store_contract`), one subclass per backend, and store construction.

``memory://`` gets a unique root per test: the memory filesystem is global.
"""

from __future__ import annotations

import uuid

import fsspec
import pytest

from elastic_kit.store import CheckpointStore
from tests.store_contract import StoreContract


class TestPlainPath(StoreContract):
    @pytest.fixture
    def target(self, tmp_path):
        return str(tmp_path / "ckpt"), None


class TestFileURL(StoreContract):
    @pytest.fixture
    def target(self, tmp_path):
        return f"file://{tmp_path}/ckpt", None


class TestMemory(StoreContract):
    @pytest.fixture
    def target(self):
        root = f"memory://ek-test-{uuid.uuid4().hex}"
        yield root, None
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_a_missing_checksum_dependency_fails_when_the_store_is_built(
        tmp_path, monkeypatch) -> None:
    """Not at the first save, an epoch later."""
    import sys

    monkeypatch.setitem(sys.modules, "xxhash", None)  # makes `import xxhash` fail
    with pytest.raises(ImportError, match="needs the xxhash package"):
        CheckpointStore(str(tmp_path))
    CheckpointStore(str(tmp_path), checksum="sha256")  # the others need nothing extra


def test_a_loaded_checkpoint_is_the_listed_record_plus_its_state(tmp_path) -> None:
    import dataclasses

    import torch

    from elastic_kit.store import CheckpointInfo, LoadedCheckpoint

    store = CheckpointStore(str(tmp_path), keep_last=None)
    store.save({"w": torch.arange(4.0)}, step=7, metadata={"epoch": 2, "note": "x"})
    (listed,) = store.list()
    loaded = store.load()
    assert isinstance(loaded, LoadedCheckpoint) and isinstance(loaded, CheckpointInfo)
    record = {f.name: getattr(loaded, f.name) for f in dataclasses.fields(CheckpointInfo)}
    assert record == dataclasses.asdict(listed) | {"manifest": listed.manifest}
    assert (loaded.step, loaded.epoch, loaded.world_size, loaded.metadata) == (
        7, 2, 1, {"epoch": 2, "note": "x"})
    assert loaded.size_bytes == listed.size_bytes > 0 and loaded.manifest is not None
    assert torch.equal(loaded.state["w"], torch.arange(4.0)) and not loaded.lacked_locally


def test_waiting_on_a_store_being_closed_on_another_thread_raises_nothing(tmp_path) -> None:
    """A rank that leaves closes its store on one thread while the exit hook waits on
    it on another: the wait must not fail on the executor the close shut down (it did:
    'cannot schedule new futures after shutdown' at every such exit)."""
    import torch

    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save({"w": torch.ones(3)}, step=1, blocking=False)
    executor = store._executor
    assert executor is not None
    executor.shutdown(wait=True)  # close() on another thread, not done yet
    store.wait_local()
    assert store.latest_step() == 1
    store.close()
