"""A read that comes back short from an object store (a dropped connection that ends
the answer early, without an error) proves nothing about the checkpoint: it is retried
and, if it keeps failing, raised; never taken for corruption, which would make load()
fall back to an older step. Only an object that is really shorter than its manifest
says is corruption.

The store is ``memory://`` behind :class:`~elastic_kit.testing.FaultFileSystem`,
whose rules cut an object short at the moment it is read (``cut``) and put it back
whole at the next size check (``heal``): what a reader sees when an answer is cut.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Iterator

import fsspec
import pytest
import torch
import torch.distributed as dist
from fsspec.implementations.memory import MemoryFile

from elastic_kit.errors import CheckpointError
from elastic_kit.store import CheckpointStore
from elastic_kit.testing import FaultFileSystem


class _Cutter:
    """Swaps a memory object for its first bytes (``cut``) and back (``heal``)."""

    def __init__(self, ffs: FaultFileSystem, *, keep: float = 0.5) -> None:
        self.mem = ffs.target
        self.keep = keep
        self.whole: dict[str, Any] = {}
        self.cuts = 0

    def cut(self, path: str) -> None:
        f = self.mem.store[path]
        data = bytes(f.getbuffer())
        self.whole.setdefault(path, f)
        self.mem.store[path] = MemoryFile(self.mem, path, data[:int(len(data) * self.keep)])
        self.cuts += 1

    def heal(self, path: str) -> None:
        if path in self.whole:
            self.mem.store[path] = self.whole.pop(path)


@pytest.fixture()
def ffs() -> Iterator[FaultFileSystem]:
    fs = FaultFileSystem(fsspec.filesystem("memory"))
    yield fs
    fs.clear()


@pytest.fixture()
def url(ffs: FaultFileSystem) -> Iterator[str]:
    name = f"short-reads-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}"
    if ffs.target.exists(f"/{name}"):
        ffs.target.rm(f"/{name}", recursive=True)


@pytest.fixture()
def mesh() -> Iterator[Any]:
    """A one-rank gloo group in this process (an in-memory store: no port, no process)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _two_steps(url: str, ffs: FaultFileSystem, n: int = 300_000) -> None:
    store = CheckpointStore(url, keep_last=None, filesystem=ffs)
    for step in (1, 2):
        store.save({"w": torch.full((n,), float(step)), "step": step}, step=step)
    store.close()


def _store(url: str, ffs: FaultFileSystem) -> CheckpointStore:
    return CheckpointStore(url, keep_last=None, filesystem=ffs, read_attempts=3)


def test_a_payload_stream_cut_short_once_is_read_again_and_the_newest_step_loads(
        url: str, ffs: FaultFileSystem, caplog: pytest.LogCaptureFixture) -> None:
    _two_steps(url, ffs)
    cutter = _Cutter(ffs)
    ffs.add("open", match="step-000000000002/state", mode="rb", before=cutter.cut)
    ffs.add("info", match="step-000000000002/state", times=None, before=cutter.heal)
    with caplog.at_level(logging.WARNING):
        loaded = _store(url, ffs).load()
    assert cutter.cuts == 1
    assert loaded is not None and loaded.step == 2
    assert loaded.state["step"] == 2 and torch.equal(loaded.state["w"], torch.full((300_000,), 2.0))
    assert "a read cut short" in caplog.text
    assert "falling back" not in caplog.text


def test_a_payload_that_keeps_arriving_short_is_raised_not_skipped(
        url: str, ffs: FaultFileSystem) -> None:
    _two_steps(url, ffs)
    cutter = _Cutter(ffs)
    ffs.add("open", match="step-000000000002/state", mode="rb", times=None, before=cutter.cut)
    ffs.add("info", match="step-000000000002/state", times=None, before=cutter.heal)
    with pytest.raises(CheckpointError, match=r"after 3 attempt.*read cut short"):
        _store(url, ffs).load()
    assert cutter.cuts == 3


def test_a_manifest_cut_short_once_is_read_again(
        url: str, ffs: FaultFileSystem, caplog: pytest.LogCaptureFixture) -> None:
    _two_steps(url, ffs, n=10)
    cutter = _Cutter(ffs)
    ffs.add("open", match="step-000000000002/manifest.json", mode="rb", before=cutter.cut)
    ffs.add("info", match="step-000000000002/manifest.json", times=None, before=cutter.heal)
    with caplog.at_level(logging.WARNING):
        loaded = _store(url, ffs).load()
    assert cutter.cuts == 1
    assert loaded is not None and loaded.step == 2 and loaded.state["step"] == 2
    assert "falling back" not in caplog.text and "skipping" not in caplog.text


def test_a_payload_really_shorter_than_its_manifest_is_still_skipped(
        url: str, ffs: FaultFileSystem, caplog: pytest.LogCaptureFixture) -> None:
    _two_steps(url, ffs)
    cutter = _Cutter(ffs)
    # cut once, never healed: the retry's size check finds the object short
    ffs.add("open", match="step-000000000002/state", mode="rb", before=cutter.cut)
    with caplog.at_level(logging.WARNING):
        loaded = _store(url, ffs).load()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["w"], torch.full((300_000,), 1.0))
    assert "falling back to an older one" in caplog.text and "truncated" in caplog.text


def _sharded_steps(url: str, ffs: FaultFileSystem, mesh: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    store = CheckpointStore(url, keep_last=None, filesystem=ffs)
    for step in (1, 2):
        w = distribute_tensor(torch.full((64, 64), float(step)), mesh, [Shard(0)])
        store.save({"w": w, "step": step}, step=step)
    store.close()


def _template(mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"w": distribute_tensor(torch.zeros(64, 64), mesh, [Shard(0)]), "step": 0}


def test_a_shard_range_read_cut_short_once_is_read_again_and_the_newest_step_loads(
        url: str, ffs: FaultFileSystem, mesh: Any, caplog: pytest.LogCaptureFixture) -> None:
    _sharded_steps(url, ffs, mesh)
    cutter = _Cutter(ffs, keep=0.9)
    ffs.add("cat", match="step-000000000002/shards-", before=cutter.cut)
    ffs.add("info", match="step-000000000002/shards-", times=None, before=cutter.heal)
    with caplog.at_level(logging.WARNING):
        loaded = _store(url, ffs).load(into=_template(mesh))
    assert cutter.cuts == 1
    assert loaded is not None and loaded.step == 2 and loaded.state["step"] == 2
    assert torch.equal(loaded.state["w"].to_local(), torch.full((64, 64), 2.0))
    assert "an answer cut short" in caplog.text
    assert "falling back" not in caplog.text


def test_a_shard_range_that_keeps_arriving_short_is_raised_not_skipped(
        url: str, ffs: FaultFileSystem, mesh: Any) -> None:
    _sharded_steps(url, ffs, mesh)
    cutter = _Cutter(ffs, keep=0.9)
    ffs.add("cat", match="step-000000000002/shards-", times=None, before=cutter.cut)
    ffs.add("info", match="step-000000000002/shards-", times=None, before=cutter.heal)
    with pytest.raises(CheckpointError, match="an answer cut short"):
        _store(url, ffs).load(into=_template(mesh))
    assert cutter.cuts == 3


def test_a_shard_object_truncated_after_its_size_check_is_still_corruption(
        url: str, ffs: FaultFileSystem, mesh: Any, caplog: pytest.LogCaptureFixture) -> None:
    _sharded_steps(url, ffs, mesh)
    cutter = _Cutter(ffs, keep=0.9)
    ffs.add("cat", match="step-000000000002/shards-", before=cutter.cut)  # never healed
    with caplog.at_level(logging.WARNING):
        loaded = _store(url, ffs).load(into=_template(mesh))
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["w"].to_local(), torch.full((64, 64), 1.0))
    assert "falling back to an older one" in caplog.text and "the file is shorter" in caplog.text
