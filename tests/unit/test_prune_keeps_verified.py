"""``CheckpointStore.prune`` keeps the newest checkpoints that verify, not the newest
whose manifest is present: a corrupt newest step must not cost the loadable ones."""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import fsspec
import pytest
import torch

from elastic_kit.store import CheckpointStore


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


def _flip_payload(store: CheckpointStore, step: int) -> None:
    """Flip one byte in the middle of ``step``'s payload (its size stays right)."""
    (info,) = [i for i in store.list() if i.step == step]
    path = f"{info.path}/{info.manifest.payload}"  # fresh per save on an object store
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))


def _steps(store: CheckpointStore) -> list[int]:
    return [i.step for i in store.list()]


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ck")
        return
    root = f"memory://ek-prune-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture
def store(url: str) -> CheckpointStore:
    store = CheckpointStore(url, keep_last=None)
    for step in (1, 2, 3):
        store.save(_state(step), step=step)
    store.close()
    return store


def test_a_corrupt_newest_step_is_not_counted_and_the_loadable_one_stays(store, url):
    _flip_payload(store, 3)
    dry = CheckpointStore(url, keep_last=None).prune(1, dry_run=True)
    assert [i.step for i in dry] == [1]
    assert _steps(store) == [1, 2, 3]  # a dry run deletes nothing
    pruned = CheckpointStore(url, keep_last=None).prune(1)
    assert [i.step for i in pruned] == [1]
    # the corrupt step 3 stays (load skips it; verify lists it), step 2 is kept
    assert _steps(store) == [2, 3]
    problems = {step: p for step, _, p in store.verify()}
    assert problems[2] is None and "corrupt payload" in problems[3]
    loaded = CheckpointStore(url).load()
    assert loaded is not None and loaded.step == 2 and loaded.state["step"] == 2
    assert torch.equal(loaded.state["w"], torch.full((1000,), 2.0))


def test_a_corrupt_step_between_kept_ones_is_skipped_not_counted(store, url):
    _flip_payload(store, 2)
    pruned = CheckpointStore(url, keep_last=None).prune(2)
    assert [i.step for i in pruned] == []  # steps 3 and 1 verify: both kept, 2 in between
    assert _steps(store) == [1, 2, 3]
    store.save(_state(4), step=4)
    pruned = CheckpointStore(url, keep_last=None).prune(2)
    assert [i.step for i in pruned] == [1, 2]
    assert _steps(store) == [3, 4]


def test_with_fewer_verified_steps_than_keep_nothing_is_deleted(store, url):
    _flip_payload(store, 3)
    _flip_payload(store, 2)
    assert CheckpointStore(url, keep_last=None).prune(2) == []
    assert _steps(store) == [1, 2, 3]
    loaded = CheckpointStore(url).load()
    assert loaded is not None and loaded.step == 1 and loaded.state["step"] == 1


def test_intact_steps_prune_to_the_newest_keep(store, url):
    pruned = CheckpointStore(url, keep_last=None).prune(2)
    assert [i.step for i in pruned] == [1]
    assert _steps(store) == [2, 3]
