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


def _other_process_commits(fs: Any, step_dir: str, into: str) -> None:
    """Another process's commit of a step landing: its files (a payload, then the
    manifest), copied from where that writer saved them. (A second store of this
    process would wait for the first one's commit of the step: one after the other.)"""
    names = sorted(fs.ls(step_dir, detail=False), key=lambda p: p.endswith("manifest.json"))
    for path in names:
        fs.pipe_file(f"{into}/{path.rsplit('/', 1)[1]}", fs.cat_file(path))


def test_the_later_manifest_of_a_step_names_intact_bytes() -> None:
    root = f"memory://ek-two-writers-{uuid.uuid4().hex}"
    memory = fsspec.filesystem("memory")
    ffs = FaultFileSystem(memory)
    other = f"memory://ek-two-writers-other-{uuid.uuid4().hex}"
    CheckpointStore(other).save(_state(-5.0), step=5)
    new = CheckpointStore(root, keep_last=1, filesystem=ffs)
    new.save(_state(4.0), step=4)

    def stale_commits_first(path: str) -> None:  # between the new payload and its manifest
        _other_process_commits(memory, f"{other[len('memory://'):]}/step-000000000005",
                               f"{root[len('memory://'):]}/step-000000000005")

    ffs.add("pipe", match="step-000000000005/manifest.json", before=stale_commits_first)
    new.save(_state(5.0), step=5)          # its manifest lands last
    new.wait()                             # and the retention after it (step 4 goes)
    assert ffs.fired("pipe") == 1
    loaded = CheckpointStore(root).load()
    assert loaded is not None and loaded.step == 5
    assert torch.equal(loaded.state["w"], _state(5.0)["w"])
    assert {step: problem for step, _, problem in CheckpointStore(root).verify()} == {5: None}


def test_a_step_committed_by_another_writer_during_a_local_save_is_kept(
        tmp_path: Any, monkeypatch: Any) -> None:
    """On a local disk a first save builds the step aside and renames it into place,
    moving an unfinished leftover of the step out of the way: a step another writer
    committed meanwhile is no leftover. It is kept, and this save fails naming the
    conflict."""
    import pytest

    from elastic_kit.errors import CheckpointConflictError
    from elastic_kit.store import _backend_local

    import shutil

    url = str(tmp_path / "ck")
    CheckpointStore(str(tmp_path / "other"), keep_last=None).save(_state(-5.0), step=5)
    new = CheckpointStore(url, keep_last=None)
    real = _backend_local.LocalBackend._move_leftover
    fired: list[str] = []

    def other_commits_first(self: Any, directory: str) -> Any:
        if not fired:  # another process's commit of the step, renamed into place
            fired.append(directory)
            shutil.copytree(tmp_path / "other" / "step-000000000005", directory)
        return real(self, directory)

    monkeypatch.setattr(_backend_local.LocalBackend, "_move_leftover", other_commits_first)
    with pytest.raises(CheckpointConflictError, match="committed by another writer"):
        new.save(_state(5.0), step=5)
    monkeypatch.undo()
    loaded = CheckpointStore(url).load()
    assert fired and loaded is not None and loaded.step == 5
    assert torch.equal(loaded.state["w"], _state(-5.0)["w"])
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()
                  if p.name.startswith(".tmp")) == []


def test_a_step_whose_manifest_does_not_validate_is_not_removed_as_a_leftover(
        tmp_path: Any) -> None:
    """A manifest of a newer release's format (or a damaged one) is skipped at load,
    never deleted as the leftover of a save that did not finish; a step without any
    manifest is."""
    import os

    url = str(tmp_path / "ck")
    store = CheckpointStore(url, keep_last=None, stale_after_s=0)
    for step in (1, 2):
        store.save(_state(float(step)), step=step)
    newer = tmp_path / "ck" / "step-000000000001" / "manifest.json"
    newer.write_text('{"format": "elastic_kit.checkpoint/9", "step": 1}')
    unfinished = tmp_path / "ck" / "step-000000000000"
    unfinished.mkdir()
    (unfinished / "state.pt").write_bytes(b"half")
    for p in (newer, unfinished):
        os.utime(p, (1, 1))
    store.save(_state(3.0), step=3)            # retention and stale cleanup run here
    store.wait()
    names = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step-"))
    assert names == ["step-000000000001", "step-000000000002", "step-000000000003"]
    assert store.load().step == 3


def _second_process_store(url: str, monkeypatch: Any, **kw: Any) -> CheckpointStore:
    """A store as another process makes it (its own writer id)."""
    from elastic_kit.store import _store

    monkeypatch.setattr(_store, "_PROCESS_TOKEN", uuid.uuid4().hex)
    return CheckpointStore(url, **kw)


def test_a_late_commit_of_an_earlier_worker_group_of_the_run_is_no_conflict(
        tmp_path: Any, monkeypatch: Any, caplog: Any) -> None:
    """A frozen node taken for dead wakes up after its survivors restarted and commits
    the save it had in flight: an older step of the same run. The live group's saves
    go on (they failed with CheckpointConflictError, each restart used up)."""
    import logging

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    url = str(tmp_path / "ck")
    frozen = CheckpointStore(url, keep_last=3)
    frozen.save(_state(15.0), step=15)
    live = _second_process_store(url, monkeypatch, keep_last=3)  # the restarted group
    live.save(_state(16.0), step=16)
    live.save(_state(17.0), step=17)
    frozen.save(_state(16.0), step=16)  # woken: its in-flight save lands
    with caplog.at_level(logging.WARNING, logger="elastic_kit.store"):
        live.save(_state(18.0), step=18)
        live.save(_state(19.0), step=19)
        live.wait()  # its retention, in the background
    assert "committed late by a process of an earlier worker group of this run" in caplog.text
    assert [i.step for i in CheckpointStore(url).list()] == [17, 18, 19]
    assert CheckpointStore(url).load().step == 19


def test_a_commit_of_another_run_is_still_a_conflict(tmp_path: Any, monkeypatch: Any) -> None:
    import pytest

    from elastic_kit.errors import CheckpointConflictError

    url = str(tmp_path / "ck")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    other = CheckpointStore(url, keep_last=3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    live = _second_process_store(url, monkeypatch, keep_last=3)
    live.save(_state(16.0), step=16)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    other.save(_state(3.0), step=3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-8")
    with pytest.raises(CheckpointConflictError, match="another job is writing checkpoints"):
        live.save(_state(17.0), step=17)
        live.wait()


def test_two_jobs_on_torchruns_default_run_id_are_still_a_conflict(
        tmp_path: Any, monkeypatch: Any) -> None:
    """torchrun sets ``TORCHELASTIC_RUN_ID=none`` for every launch without
    ``--rdzv-id`` (a static ``--master-addr`` launch): two such jobs on one URL are
    two jobs, and the other job's only checkpoint must not be deleted as a late commit."""
    import pytest

    from elastic_kit.errors import CheckpointConflictError

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    url = str(tmp_path / "ck")
    a = CheckpointStore(url, keep_last=2)
    a.save(_state(100.0), step=100)
    a.save(_state(200.0), step=200)
    b = _second_process_store(url, monkeypatch, keep_last=2)
    b.save(_state(10.0), step=10)
    with pytest.raises(CheckpointConflictError, match="another job is writing checkpoints"):
        a.save(_state(300.0), step=300)
        a.wait()
    assert [i.step for i in CheckpointStore(url).list()] == [10, 100, 200, 300]
