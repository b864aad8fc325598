"""``CheckpointStore.verify`` (``python -m elastic_kit verify``) beside a live job on an
object store, where a step's manifest is deleted before its files (retention) and
written after them (a save): a step found without a manifest is looked at again
before it is reported, so a deletion in progress is not reported, a save that
commits meanwhile is verified, and a leftover that stays is. ``verify(step=N)``
reads only step N. Faults and interleavings come from a real fsspec wrapper
(:class:`elastic_kit.testing.FaultFileSystem`, which the store treats as an object
store)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import fsspec
import torch

import elastic_kit as ek
from elastic_kit.testing import FaultFileSystem


def _store(tmp_path: Path) -> tuple[FaultFileSystem, ek.CheckpointStore, Path]:
    root = tmp_path / "ck"
    plain = ek.CheckpointStore(str(root), keep_last=None)
    for step in (10, 20, 30):
        plain.save({"w": torch.full((8,), float(step))}, step=step)
    plain.close()
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    return ffs, ek.CheckpointStore(str(root), filesystem=ffs, keep_last=None), root


def _problems(store: ek.CheckpointStore, **kw: object) -> list[tuple[int, str | None]]:
    return [(step, problem) for step, _, problem in store.verify(**kw)]  # type: ignore[arg-type]


def test_a_step_whose_deletion_is_in_progress_is_not_reported(tmp_path: Path) -> None:
    ffs, store, root = _store(tmp_path)
    step10 = root / "step-000000000010"
    (step10 / "manifest.json").unlink()  # retention deleted the manifest first ...
    # ... and the rest a moment after verify's first look at the directory
    ffs.add("info", match="step-000000000010", skip=2,
            before=lambda _: shutil.rmtree(step10, ignore_errors=True))
    assert _problems(store) == [(20, None), (30, None)]
    assert ffs.fired("info") == 1


def test_a_step_that_commits_while_it_is_looked_at_is_verified(tmp_path: Path) -> None:
    ffs, store, root = _store(tmp_path)
    manifest = root / "step-000000000020" / "manifest.json"
    text = manifest.read_text()
    manifest.unlink()  # the save's files are there, its manifest not yet ...
    ffs.add("info", match="step-000000000020", skip=1,
            before=lambda _: manifest.write_text(text))  # ... and then it is
    assert _problems(store) == [(10, None), (20, None), (30, None)]


def test_a_leftover_that_stays_without_a_manifest_is_reported(tmp_path: Path) -> None:
    _, store, root = _store(tmp_path)
    (root / "step-000000000020" / "manifest.json").unlink()  # an interrupted save
    got = _problems(store)
    assert [s for s, _ in got] == [10, 20, 30] and got[0][1] is None and got[2][1] is None
    assert "manifest.json is missing" in str(got[1][1])


def test_verify_of_one_step_reads_no_other(tmp_path: Path) -> None:
    ffs, store, _ = _store(tmp_path)
    ffs.add("open", match="step-000000000010", error=OSError(errno.EIO, "EIO"), times=None)
    ffs.add("info", match="step-000000000010", error=OSError(errno.EIO, "EIO"), times=None)
    assert _problems(store, step=20) == [(20, None)]
    assert ffs.fired() == 0
    assert not [p for _, p in ffs.calls if "step-000000000010" in p]
