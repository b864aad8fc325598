"""A failed checkpoint write names the file it was writing, wherever the storage
failed: an object store's upload completing at ``close()`` (s3fs and gcsfs send a
small file's only PUT there), the manifest's PUT, a client's own (non-OSError) error
in the middle of the payload, and a local re-save's new manifest on a full disk.
OSErrors keep their type and errno; another library's error becomes a
``CheckpointError`` caused by it. Nothing is committed, the step before stays, and
the next save works.

Faults come from a real fsspec wrapper (:class:`elastic_kit.testing.FaultFileSystem`)
and, for the local disk, from the kernel (``RLIMIT_FSIZE``).
"""

from __future__ import annotations

import errno
import resource
import signal
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

import elastic_kit as ek
from elastic_kit.testing import FaultFileSystem


class HttpError(Exception):
    """What an object store client raises for a failed request (gcsfs's has this name)."""


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((20_000,), v)}


@pytest.fixture
def object_store() -> tuple[FaultFileSystem, ek.CheckpointStore]:
    ffs = FaultFileSystem(fsspec.filesystem("memory"))
    root = f"memory://ek-test-{uuid.uuid4().hex}/run-1"
    store = ek.CheckpointStore(root, filesystem=ffs, keep_last=None)
    store.save(_state(1.0), step=1)
    yield ffs, store
    store.close()
    fsspec.filesystem("memory").rm(root.removeprefix("memory://").split("/")[0],
                                   recursive=True)


def _only_step_1_then_saves(ffs: FaultFileSystem, store: ek.CheckpointStore) -> None:
    assert [i.step for i in store.list()] == [1]
    ffs.clear()
    store.save(_state(2.0), step=2)
    loaded = store.load()
    assert loaded is not None and loaded.step == 2 and loaded.state["w"][0].item() == 2.0


@pytest.mark.parametrize("error", [PermissionError(errno.EACCES, "Access Denied"),
                                   OSError(errno.EDQUOT, "Disk quota exceeded")])
def test_an_upload_failing_at_close_names_the_payload(object_store, error: OSError) -> None:
    ffs, store = object_store
    ffs.add("close", match="step-000000000002/state.", error=error)
    with pytest.raises(type(error)) as exc:
        store.save(_state(2.0), step=2)
    assert ffs.fired("close") == 1
    assert exc.value.errno == error.errno
    assert "cannot write checkpoint file " in str(exc.value)
    assert "run-1/step-000000000002/state." in str(exc.value)
    _only_step_1_then_saves(ffs, store)


def test_a_failed_manifest_put_names_the_manifest(object_store) -> None:
    ffs, store = object_store
    ffs.add("pipe", match="step-000000000002/manifest.json",
            error=OSError(errno.EIO, "503 Slow Down"))
    with pytest.raises(OSError) as exc:
        store.save(_state(2.0), step=2)
    assert exc.value.errno == errno.EIO
    assert "run-1/step-000000000002/manifest.json: 503 Slow Down" in str(exc.value)
    _only_step_1_then_saves(ffs, store)


def test_a_clients_own_error_mid_payload_is_named_not_torchs_unexpected_pos(
        object_store) -> None:
    ffs, store = object_store
    cause = HttpError("503 backendError")
    ffs.add("write", match="step-000000000002/state.", error=cause, after_bytes=30_000)
    with pytest.raises(ek.CheckpointError) as exc:
        store.save(_state(2.0), step=2)
    assert "run-1/step-000000000002/state." in str(exc.value)
    assert str(exc.value).endswith(": HttpError: 503 backendError")
    assert exc.value.__cause__ is cause
    _only_step_1_then_saves(ffs, store)


def test_a_local_resaves_manifest_on_a_full_disk_names_it(tmp_path: Path) -> None:
    store = ek.CheckpointStore(str(tmp_path / "ck"), keep_last=None)
    store.save({"w": torch.ones(4)}, step=1)
    # a re-save whose payload fits and whose manifest (large metadata) does not: the
    # kernel refuses writes past RLIMIT_FSIZE with EFBIG (SIGXFSZ ignored)
    big = {"note": "x" * 200_000}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(OSError) as exc:
            store.save({"w": torch.full((4,), 2.0)}, step=1, metadata=big)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert exc.value.errno == errno.EFBIG
    assert "cannot write checkpoint file " in str(exc.value)
    assert "step-000000000001/.manifest.json." in str(exc.value)
    loaded = store.load()
    assert loaded is not None and loaded.step == 1 and loaded.state["w"].tolist() == [1.0] * 4
    store.save({"w": torch.full((4,), 3.0)}, step=1)
    loaded = store.load()
    assert loaded is not None and loaded.state["w"].tolist() == [3.0] * 4
    store.close()


def test_torchs_own_and_builtin_errors_keep_their_type() -> None:
    from elastic_kit.store._fs import named_write_error

    for e in (torch.OutOfMemoryError("CUDA out of memory"), TypeError("bad value")):
        assert named_write_error(e, "/ck/step-000000000002/state.pt") is e
    named = named_write_error(HttpError("503"), "/ck/step-000000000002/state.pt")
    assert isinstance(named, ek.CheckpointError)
    assert str(named) == ("cannot write checkpoint file /ck/step-000000000002/state.pt: "
                          "HttpError: 503")
