"""One "not found" from storage for a file a committed checkpoint lists (a lagging
gateway, a listing or metadata cache) proves nothing about the checkpoint: it must not
get the step deleted as an interrupted save's leftover, nor skipped as damaged at load
(training would roll back to the step before). A file still missing after the store's
retries, under an unchanged manifest, is damage as before.

Faults come from a real fsspec wrapper (:class:`elastic_kit.testing.FaultFileSystem`).
"""

from __future__ import annotations

import errno
from pathlib import Path

import fsspec
import pytest
import torch

import elastic_kit as ek
from elastic_kit.testing import FaultFileSystem


def _state(v: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(v))}


def _not_found() -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, "404 Not Found")


def _saved(tmp_path: Path, steps: list[int], **kw: object) -> tuple[FaultFileSystem, str]:
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    root = str(tmp_path / "ck")
    store = ek.CheckpointStore(root, filesystem=ffs, keep_last=None, **kw)  # type: ignore[arg-type]
    for s in steps:
        store.save(_state(s), step=s)
    store.close()
    return ffs, root


def test_one_not_found_for_an_old_steps_manifest_does_not_get_it_deleted(
        tmp_path: Path) -> None:
    # every directory without a manifest is old enough to be a leftover (0 s)
    ffs, root = _saved(tmp_path, [1, 2, 3], stale_after_s=0)
    store = ek.CheckpointStore(root, filesystem=ffs, keep_last=None, stale_after_s=0)
    ffs.add("info", match="step-000000000001/manifest.json", error=_not_found())
    store.save(_state(4), step=4)  # its cleanup looks at every older step
    store.close()
    assert ffs.fired("info") == 1
    assert [i.step for i in store.list()] == [1, 2, 3, 4]
    assert [(step, problem) for step, _, problem in store.verify()] == [
        (1, None), (2, None), (3, None), (4, None)]


def test_a_step_without_a_manifest_is_still_removed_as_a_leftover(tmp_path: Path) -> None:
    ffs, root = _saved(tmp_path, [1, 2], stale_after_s=0)
    (tmp_path / "ck" / "step-000000000001" / "manifest.json").unlink()  # an unfinished save
    store = ek.CheckpointStore(root, filesystem=ffs, keep_last=None, stale_after_s=0)
    store.save(_state(3), step=3)
    store.close()
    assert not (tmp_path / "ck" / "step-000000000001").exists()
    assert [i.step for i in store.list()] == [2, 3]


def test_one_not_found_for_the_newest_payload_still_loads_the_newest(tmp_path: Path) -> None:
    ffs, root = _saved(tmp_path, [1, 2, 3])
    ffs.add("info", match="step-000000000003/state.", error=_not_found())
    loaded = ek.CheckpointStore(root, filesystem=ffs).load()
    assert ffs.fired("info") == 1
    assert loaded is not None and loaded.step == 3
    assert loaded.state["w"].tolist() == [3.0] * 64


def test_a_payload_missing_at_every_look_is_damage_and_the_step_before_loads(
        tmp_path: Path) -> None:
    ffs, root = _saved(tmp_path, [1, 2, 3])
    ffs.add("info", match="step-000000000003/state.", error=_not_found(), times=None)
    store = ek.CheckpointStore(root, filesystem=ffs, read_attempts=3)
    loaded = store.load()
    assert ffs.fired("info") == 3  # looked for at each of the store's attempts
    assert loaded is not None and loaded.step == 2
    assert loaded.state["w"].tolist() == [2.0] * 64


def test_on_a_local_disk_a_missing_manifest_is_decided_at_the_first_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local step directory gets its manifest before it is renamed into place, so
    nothing waits to look again: the snapshot tier cleans its leftovers during a
    restore and after every snapshot, on a local tmpfs."""
    from elastic_kit.store import _layout, _store

    root = tmp_path / "ck"
    _saved(tmp_path, [1, 2, 3])
    store = ek.CheckpointStore(str(root), keep_last=None, stale_after_s=0)
    for s in (1, 2):
        (root / f"step-00000000000{s}" / "manifest.json").unlink()  # interrupted saves
    slept: list[float] = []
    monkeypatch.setattr(_layout.time, "sleep", slept.append)
    monkeypatch.setattr(_store.time, "sleep", slept.append)
    found = store.verify()
    assert [(step, p is None) for step, _, p in found] == [(1, False), (2, False), (3, True)]
    store.save(_state(4), step=4)  # its cleanup removes both leftovers
    store.close()
    assert slept == []
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-000000000003", "step-000000000004"]
