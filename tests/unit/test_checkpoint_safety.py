"""Refusing what must not be saved or loaded, and surfacing failures where they happen."""

from __future__ import annotations

import collections
import json
import os
import pathlib

import fsspec
import numpy as np
import pytest
import torch

from elastic_kit.store import (
    MANIFEST_NAME, CheckpointStore, Manifest, load_checkpoint, save_checkpoint,
)
from elastic_kit.store._manifest import PAYLOAD_NAME
from elastic_kit.store._serialize import new_hasher
from elastic_kit.errors import CheckpointError, UnsafeCheckpointError
from elastic_kit.testing import FaultFileSystem


class _Evil:
    """Unpickling this would create the marker file: the code must never run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _replace_payload(path: str, obj) -> None:
    """Overwrite a checkpoint's payload with ``obj`` and re-seal its manifest."""
    payload = os.path.join(path, PAYLOAD_NAME)
    torch.save(obj, payload)
    data = open(payload, "rb").read()
    mpath = os.path.join(path, MANIFEST_NAME)
    m = Manifest.from_json(open(mpath).read())
    h = new_hasher(m.checksum)
    h.update(data)
    m.files[PAYLOAD_NAME] = type(m.files[PAYLOAD_NAME])(size=len(data), checksum=h.hexdigest())
    open(mpath, "w").write(m.to_json())


def test_pickled_object_is_refused_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"w": torch.ones(2)}, step=1)
    store.save({"w": torch.ones(2)}, step=2)
    _replace_payload(store.list()[-1].path, {"w": torch.ones(2), "x": _Evil(str(marker))})
    with pytest.raises(UnsafeCheckpointError, match="step-000000000002.*refusing to load"):
        store.load()
    assert not marker.exists()
    # the sealed-but-unsafe checkpoint verifies (its bytes are intact): it is the
    # content that is refused, so the CLI's verify does not hide it either
    assert all(p is None for _, _, p in store.verify())


@pytest.mark.parametrize("bad, path, why", [
    ({"sampler": {"pos": np.int64(3)}}, r"\['sampler'\]\['pos'\]", "numpy"),
    ({"opt": [1, collections.namedtuple("P", "a")(1)]}, r"\['opt'\]\[1\]", "namedtuple"),
    ({"model": torch.nn.Linear(2, 2)}, r"\['model'\]", "state_dict"),
    ({"d": {object(): 1}}, r"dict key", "must be str"),
])
def test_save_refuses_what_weights_only_load_cannot_read(tmp_path, bad, path, why):
    store = CheckpointStore(str(tmp_path / "ck"))
    with pytest.raises(TypeError, match=path) as ei:
        store.save(bad, step=1)
    assert why in str(ei.value)
    assert store.list() == [] and not (tmp_path / "ck").exists()


def test_metadata_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="metadata=.*JSON"):
        CheckpointStore(str(tmp_path)).save({}, step=1, metadata={"t": torch.ones(1)})


@pytest.mark.parametrize("kw, match", [
    ({"keep_last": 0}, "keep_last=0"), ({"checksum": "md5"}, "checksum='md5'"),
])
def test_bad_options_name_the_value(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        CheckpointStore(str(tmp_path), **kw)


@pytest.mark.parametrize("kw, match", [
    ({"node_local": "false"}, "node_local='false': expected True or False"),
    ({"reuse_staging": "no"}, "reuse_staging='no': expected True or False"),
    ({"private": 1}, "private=1: expected True or False"),
    ({"storage_options": 1}, "storage_options=1: expected a dict"),
])
def test_an_option_of_the_wrong_type_is_named(tmp_path, kw, match):
    with pytest.raises(TypeError, match=match):
        CheckpointStore(str(tmp_path), **kw)


@pytest.mark.parametrize("kw, match", [
    ({"blocking": "false"}, "blocking='false': expected True or False"),
    ({"metadata": [1]}, r"metadata=\[1\]: expected a dict"),
    ({"step": 2.0}, "step=2.0: expected an int"),
    ({"step": True}, "step=True: expected an int"),
])
def test_a_save_argument_of_the_wrong_type_is_named(tmp_path, kw, match):
    store = CheckpointStore(str(tmp_path / "ck"))
    with pytest.raises(TypeError, match=match):
        store.save({"w": torch.ones(1)}, **{"step": 1, **kw})
    assert store.list() == []


def test_a_numpy_step_is_an_int(tmp_path):
    np = pytest.importorskip("numpy")
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"w": torch.ones(1)}, step=np.int64(4))
    assert [(i.step, type(i.step)) for i in store.list()] == [(4, int)]
    with pytest.raises(ValueError, match=r"step=-1 must be an int in \[0, 10\*\*12\)"):
        store.save({"w": torch.ones(1)}, step=np.int64(-1))


def test_unknown_protocol_and_missing_extra_are_clear(tmp_path):
    with pytest.raises(ValueError, match="url='nope://x/y'.*unknown protocol 'nope'"):
        CheckpointStore("nope://x/y")
    for url, extra in (("gs://b/run", "gcs"), ("az://c/run", "azure"), ("abfs://c/run", "azure")):
        pkg = {"gcs": "gcsfs", "azure": "adlfs"}[extra]
        try:
            __import__(pkg)
            continue  # installed here: nothing to report
        except ImportError:
            pass
        with pytest.raises(ImportError, match=rf"url='{url}'.*elastic_kit\[{extra}\]"):
            CheckpointStore(url)


def test_background_failure_surfaces_on_wait_then_saving_works_again(tmp_path):
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    disk_full = ffs.add("open", mode="wb", match="/state.",  # the payload, fresh-named
                        error=OSError(28, "No space left on device"))  # the first save only
    store = CheckpointStore(str(tmp_path / "ck"), filesystem=ffs)
    store.save({"w": torch.ones(3)}, step=1, blocking=False)  # returns: the error comes later
    with pytest.raises(OSError, match="No space left"):
        store.wait()
    assert disk_full.fired == 1
    store.wait()  # reported once, not forever
    store.save({"w": torch.ones(3)}, step=2, blocking=False)
    store.close()
    assert [i.step for i in store.list()] == [2]


def test_background_failure_surfaces_on_next_save(tmp_path):
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("open", mode="wb", error=CheckpointError("bucket gone"), times=None)
    store = CheckpointStore(str(tmp_path / "ck"), filesystem=ffs)
    store.save({"w": torch.ones(3)}, step=1, blocking=False)
    with pytest.raises(CheckpointError, match="bucket gone"):
        store.save({"w": torch.ones(3)}, step=2, blocking=False)


def test_second_nonblocking_save_waits_for_the_first(tmp_path):
    """Each write, from opening its payload to writing its manifest (the commit), is
    slowed down; a second non-blocking save must not start writing before the first
    committed."""
    import posixpath
    import threading
    import time

    lock, writing, overlaps = threading.Lock(), set(), []

    def payload_opened(path: str) -> None:
        step_dir = posixpath.dirname(path)
        with lock:
            if step_dir in writing:  # the same write, opening again once its directory exists
                return
            if writing:
                overlaps.append((sorted(writing), step_dir))
            writing.add(step_dir)
        time.sleep(0.2)

    def committed(path: str) -> None:
        with lock:
            writing.discard(posixpath.dirname(path))

    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("open", match="/state.", mode="wb", before=payload_opened, times=None)
    ffs.add("pipe", match=MANIFEST_NAME, before=committed, times=None)
    store = CheckpointStore(str(tmp_path / "ck"), keep_last=None, filesystem=ffs)
    for step in range(3):
        store.save({"w": torch.full((4,), float(step))}, step=step, blocking=False)
    store.close()
    assert ffs.fired("pipe") == 3  # every save committed through the hook
    assert overlaps == [] and [i.step for i in store.list()] == [0, 1, 2]
    assert store.load().state["w"].tolist() == [2.0] * 4


def test_views_of_large_storages_are_saved_small(tmp_path):
    big = torch.zeros(1_000_000)
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"w": big[:10]}, step=1)
    assert store.list()[0].size_bytes < 10_000
    assert store.load().state["w"].shape == (10,)


def test_function_forms_load_into_a_module_and_a_dict(tmp_path):
    url = str(tmp_path / "ck")
    model = torch.nn.Linear(3, 2)
    save_checkpoint(model, url, step=5, metadata={"epoch": 1}, keep_last=2)
    fresh = torch.nn.Linear(3, 2)
    loaded = load_checkpoint(fresh, url)
    assert loaded.step == 5 and loaded.metadata == {"epoch": 1}
    assert torch.equal(fresh.weight, model.weight)
    target: dict = {}
    store = CheckpointStore(url)
    assert load_checkpoint(target, store).step == 5 and set(target) == {"weight", "bias"}
    with pytest.raises(TypeError, match="keep_last"):
        save_checkpoint(model, store, step=6, keep_last=1)


def test_node_rank_template_and_manifest_contents(tmp_path):
    from elastic_kit.distributed import DistInfo

    store = CheckpointStore(str(tmp_path / "n{node_rank}"), info=DistInfo(node_rank=4, world_size=1))
    store.save({"w": torch.ones(2)}, step=3, metadata={"epoch": 2, "world_size": 1})
    info = store.list()[0]
    assert info.path.startswith(str(tmp_path / "n4"))
    m = json.loads(open(os.path.join(info.path, MANIFEST_NAME)).read())
    assert m["step"] == 3 and m["epoch"] == 2 and m["checksum"] == "xxh3_128"
    assert m["torch_version"] == torch.__version__ and m["elastic_kit_version"]
    assert set(m["files"]) == {PAYLOAD_NAME} and m["files"][PAYLOAD_NAME]["size"] > 0
    assert not [n for n in os.listdir(tmp_path / "n4") if n.startswith(".tmp")]


def test_sha256_checksum_option_verifies_and_catches_a_flipped_byte(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"), checksum="sha256")
    store.save({"w": torch.ones(2)}, step=1)
    assert store.list()[0].manifest.checksum == "sha256"
    assert len(store.list()[0].manifest.files[PAYLOAD_NAME].checksum) == 64
    store.save({"w": torch.ones(2)}, step=2)
    payload = os.path.join(store.list()[-1].path, PAYLOAD_NAME)
    data = bytearray(open(payload, "rb").read())
    data[-30] ^= 0x01
    open(payload, "wb").write(bytes(data))
    assert store.load().step == 1


@pytest.mark.parametrize("checksum", ["crc32", "sha256", "xxh3_128"])
def test_every_checksum_detects_a_flipped_byte_and_a_default_store_reads_them(
        tmp_path, checksum, caplog):
    """Checkpoints written with any algorithm (crc32 was the first default) load in a
    store with the current default, and a flipped byte falls back with a reason."""
    old = CheckpointStore(str(tmp_path), checksum=checksum, keep_last=None)
    old.save({"w": torch.full((1000,), 1.0)}, step=1)
    old.save({"w": torch.full((1000,), 2.0)}, step=2)
    infos = old.list()
    assert [i.manifest.checksum for i in infos] == [checksum, checksum]
    store = CheckpointStore(str(tmp_path))  # default checksum: xxh3_128
    assert store.load().state["w"][0].item() == 2.0
    payload = os.path.join(infos[-1].path, PAYLOAD_NAME)
    data = bytearray(open(payload, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(payload, "wb").write(bytes(data))
    with caplog.at_level("WARNING"):
        assert store.load().state["w"][0].item() == 1.0
    assert "corrupt payload" in caplog.text and f"has {checksum} " in caplog.text


def test_local_saves_start_writeback_in_contiguous_ranges_and_still_verify(
        tmp_path, monkeypatch):
    """Every WRITEBACK_EVERY bytes the writer asks the kernel to start writing the new
    range (then fsyncs at the end); the ranges tile the payload without gaps. This is
    the buffered path, used where O_DIRECT is refused (forced here)."""
    from elastic_kit.store import _fs as fs_mod
    from elastic_kit.store import _backend_local
    from elastic_kit.store import _serialize as serialize

    monkeypatch.setattr(_backend_local, "open_direct", lambda path, mode: None)

    calls: list[tuple[int, int]] = []
    real = fs_mod.start_writeback

    def record(fd: int, offset: int, nbytes: int) -> bool:
        calls.append((offset, nbytes))
        return real(fd, offset, nbytes)

    monkeypatch.setattr(serialize, "start_writeback", record)
    monkeypatch.setattr(serialize, "WRITEBACK_EVERY", 1 << 20)
    store = CheckpointStore(str(tmp_path / "ck"))
    state = {f"w{i}": torch.rand(1 << 18) for i in range(6)}  # 6 records of 1 MiB
    store.save(state, step=1)
    info = store.list()[0]
    assert len(calls) >= 5
    assert calls[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:]))
    assert calls[-1][0] + calls[-1][1] <= info.size_bytes
    assert store.verify() == [(1, info.path, None)]
    loaded = store.load().state
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_start_writeback_works_on_this_linux_file(tmp_path):
    from elastic_kit.store._fs import start_writeback

    p = tmp_path / "f"
    with open(p, "wb") as f:
        f.write(b"x" * (1 << 20))
        f.flush()
        assert start_writeback(f.fileno(), 0, 1 << 20) is True


def test_hostname_in_the_url_names_this_hosts_directory(tmp_path) -> None:
    import socket

    store = CheckpointStore(str(tmp_path / "ck" / "{hostname}"), node_local=True)
    assert store.url == str(tmp_path / "ck" / socket.gethostname())
    assert store.url_template == str(tmp_path / "ck" / "{hostname}")


@pytest.mark.parametrize("wrap", ["faults", "dir"])
def test_a_wrapped_local_filesystem_creates_the_run_identity_in_a_new_directory(
        tmp_path, wrap) -> None:
    """A local disk behind an fsspec wrapper (a ``dir://`` prefix, a fault or caching
    layer) has real directories: creating the run identity in a new store's directory
    failed (FileNotFoundError), so in-memory snapshots were off for the whole run."""
    local = fsspec.filesystem("file")
    if wrap == "faults":
        fs, url = FaultFileSystem(local), str(tmp_path / "new" / "run")
    else:
        fs = fsspec.filesystem("dir", path=str(tmp_path), fs=local)
        url = "new/run"
    store = CheckpointStore(url, filesystem=fs)
    identity = store.run_identity()
    assert len(identity) == 32 and int(identity, 16) >= 0
    assert CheckpointStore(url, filesystem=fs).run_identity(create=False) == identity
    assert (tmp_path / "new" / "run" / "run-identity").read_text().strip() == identity


def test_a_step_the_jobs_retention_deletes_during_verify_is_not_reported(tmp_path) -> None:
    """``verify`` beside a live job on the same URL (as the docs invite): a step its
    retention deleted between verify's listing and its read was reported CORRUPT
    ("manifest.json is missing"), and the CLI exited 1."""
    import shutil

    url = str(tmp_path / "ck")
    store = CheckpointStore(url, keep_last=None)
    for step in (1, 2, 3):
        store.save({"w": torch.full((10,), float(step))}, step=step)
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("open", match="step-000000000001/", before=lambda _: shutil.rmtree(
        os.path.join(url, "step-000000000001"), ignore_errors=True))
    got = CheckpointStore(url, filesystem=ffs).verify()
    assert ffs.fired("open") == 1
    assert [(step, problem) for step, _, problem in got] == [(2, None), (3, None)]


def test_an_identity_replaced_by_two_processes_at_once_is_the_adopted_one(
        tmp_path, monkeypatch) -> None:
    """Two processes replacing a node-local directory's identity with the run's (a
    directory shared by accident): the one whose removal finds the file gone, or whose
    file the other removed, still holds the run's identity; it failed, and turned the
    snapshots off for the whole group."""
    import uuid

    from elastic_kit.store import CheckpointStore

    url = str(tmp_path / "node")
    CheckpointStore(url, node_local=True).run_identity()  # an old run's
    store = CheckpointStore(url, node_local=True)
    backend = store._layout.backend
    remove = backend.remove_file

    def removed_by_the_other_first(path: str) -> None:
        remove(path)
        raise FileNotFoundError(path)

    monkeypatch.setattr(backend, "remove_file", removed_by_the_other_first)
    run = uuid.uuid4().hex
    assert store.run_identity(adopt=run, replace=True) == run
    assert CheckpointStore(url, node_local=True).run_identity(create=False) == run
