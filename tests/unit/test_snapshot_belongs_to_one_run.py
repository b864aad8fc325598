"""A snapshot belongs to one run of one durable store: the store holds a run identity,
every snapshot records it, and restore uses only snapshots carrying the identity the
store holds now. A deleted or replaced store starts fresh; with the store intact, a
snapshot newer than its newest step still wins."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.snapshot import SnapshotTier
from elastic_kit.store import IDENTITY_NAME, CheckpointStore


def test_the_store_creates_one_identity_and_keeps_it(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    store = CheckpointStore(url)
    assert store.run_identity(create=False) is None
    first = store.run_identity()
    assert len(first) == 32 and int(first, 16) >= 0
    assert CheckpointStore(url).run_identity() == first       # another store object
    shutil.rmtree(url)                                         # the store deleted
    assert CheckpointStore(url).run_identity() not in (None, first)


def test_writers_racing_on_an_empty_store_agree_on_one_identity(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    got: list[str] = []
    start = threading.Barrier(8)

    def create() -> None:
        start.wait()
        got.append(CheckpointStore(url).run_identity())

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1
    assert (tmp_path / "ck" / IDENTITY_NAME).read_text().strip() == got[0]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [IDENTITY_NAME]


def test_an_object_store_holds_its_identity_too() -> None:
    store = CheckpointStore("memory://identity-test/run")
    first = store.run_identity()
    assert CheckpointStore("memory://identity-test/run").run_identity() == first
    store.fs.rm("/identity-test", recursive=True)
    assert CheckpointStore("memory://identity-test/run").run_identity() != first


def _tier(shm: str, identity: str) -> SnapshotTier:
    return SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm,
                        identity=identity)


def test_a_snapshot_of_another_identity_is_ignored_and_removed(shm: str) -> None:
    old = _tier(shm, "a" * 32)
    old.save({"w": torch.full((10,), 9.0)}, step=9, metadata={"epoch": 0})
    old.close(remove=False)
    same = _tier(shm, "a" * 32)
    assert same.newest_local() == 9
    loaded = same.load()
    assert loaded is not None and loaded.step == 9 and loaded.metadata == {"epoch": 0}
    new = _tier(shm, "b" * 32)                 # the store was replaced since
    assert new.newest_local() is None and new.load() is None
    assert not Path(old.node_dir, "step-000000000009").exists()
    assert "another run of this store (identity aaaaaaaaaaaa" in new.ignored_note()


class _Life:
    """One worker life of an own loop with a snapshot every step and durable saves
    every 4 steps; 'crashes' (no close) after ``steps`` steps."""

    def __init__(self, url: str) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(3, 2)
        opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.state = ek.TrainState(self.model, opt)
        self.ckpt = ek.Checkpointer(self.state, url, every_steps=4, blocking=True,
                                    handle_signals=False, snapshot_every=1)

    def run(self, steps: int) -> None:
        self.ckpt.restore()
        for _ in range(steps):
            with torch.no_grad():
                self.model.weight.add_(1.0)
            self.ckpt.step(1)
        assert self.ckpt.snapshots is not None
        self.ckpt.snapshots.close(remove=False)     # a kill after the snapshot landed
        self.ckpt.store.close()                     # type: ignore[union-attr]


def _restore(url: str) -> tuple[Any, Any, float]:
    life = _Life(url)
    life.ckpt.restore()
    out = (life.ckpt.restored_step, life.ckpt.restored_from,
           float(life.model.weight.detach()[0, 0]))
    life.ckpt.close()
    return out


def test_a_kill_resumes_from_the_snapshot_newer_than_the_store(shm: str, tmp_path: Path) -> None:
    url = str(tmp_path / "durable")
    _Life(url).run(9)                                        # durable 8, snapshot 9
    step, tier, w = _restore(url)
    assert (step, tier) == (9, "memory")
    torch.manual_seed(0)
    assert w == pytest.approx(float(nn.Linear(3, 2).weight.detach()[0, 0]) + 9.0)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_deleted_or_replaced_store_never_resumes_from_memory(
        shm: str, tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture) -> None:
    url = str(tmp_path / "durable")
    _Life(url).run(9)                                        # durable 8, snapshot 9
    shutil.rmtree(url)
    if how == "replaced":                                     # another run's store, step 4
        other = tmp_path / "other"
        _Life(str(other)).run(5)
        shutil.copytree(other, url)
    with caplog.at_level(logging.INFO):
        step, tier, _ = _restore(url)
    assert (step, tier) == ((None, None) if how == "deleted" else (4, "store"))
    assert "snapshot step 9" in caplog.text and "another run of this store" in caplog.text
