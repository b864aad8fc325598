"""Retention never deletes a newer checkpoint: a save of an older step (a loop that
restarted from scratch after a load failed) is committed beside the newer ones."""

from __future__ import annotations

import errno
import random
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from elastic_kit.errors import CheckpointError
from elastic_kit.store import CheckpointStore
from elastic_kit.testing import FaultFileSystem


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((2000,), float(v)), "v": v}


def _steps(store: CheckpointStore) -> list[int]:
    return [i.step for i in store.list()]


def test_a_restart_from_scratch_after_a_failed_load_keeps_the_newer_step(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    store = CheckpointStore(str(tmp_path / "ck"), keep_last=1, filesystem=ffs,
                            read_attempts=1)
    store.save(_state(40), step=40)
    ffs.add("open", match="step-000000000040/", mode="rb", times=None,
            error=PermissionError(errno.EACCES, "403 Forbidden"))
    with pytest.raises(CheckpointError, match="403"):
        store.load()                        # a transient read error: raised, rightly
    ffs.clear()
    with caplog.at_level("WARNING"):
        store.save(_state(0), step=0)       # the loop's restart from scratch
    store.wait()
    assert _steps(store) == [0, 40]
    assert "step 0 was saved beside the newer step 40" in caplog.text
    store.save(_state(1), step=1)
    store.wait()
    assert _steps(store) == [1, 40]         # keep_last counts from the newest step
    loaded = store.load()
    assert loaded is not None and loaded.step == 40 and loaded.state["v"] == 40


def test_retention_still_keeps_the_newest_keep_last_of_ordered_saves(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ck"), keep_last=2)
    for step in (1, 2, 3, 4):
        store.save(_state(step), step=step)
    store.wait()
    assert _steps(store) == [3, 4]


def test_after_any_sequence_of_saves_loads_and_read_errors_the_newest_step_stays(
        tmp_path: Path) -> None:
    rng = random.Random(7)
    url = str(tmp_path / "ck")
    newest = -1
    for _ in range(6):                       # six "worker lives", each its own store
        ffs = FaultFileSystem(fsspec.filesystem("file"))
        store = CheckpointStore(url, keep_last=rng.choice([1, 2]), filesystem=ffs,
                                read_attempts=1)
        for _ in range(8):
            op = rng.choice(["save", "save", "load", "load_error"])
            if op == "save":
                step = rng.randrange(0, 60)
                store.save(_state(step), step=step, blocking=rng.random() < 0.5)
                store.wait()
                newest = max(newest, step)
            elif op == "load_error":
                ffs.add("read", match="state", error=ConnectionResetError(
                    errno.ECONNRESET, "reset"), times=None)
                try:
                    store.load()
                except CheckpointError:
                    pass
                ffs.clear()
            else:
                loaded = store.load()
                assert (loaded.step if loaded else -1) == newest
            assert (_steps(store) or [-1])[-1] == newest
        store.close()
