"""The store under faults and hostile input: what a review found, each case reproduced.

Faults come from :class:`elastic_kit.testing.FaultFileSystem`, a real fsspec filesystem
wrapped so that chosen calls raise (a 403, a dropped connection, a full disk) or run
another writer's work at an exact moment; the wrapped store takes the object-store
code path (no rename), on a local directory or on the moto S3 server. Hostile
manifests and names are written by hand into real stores.
"""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing as mp
import os
import pathlib
import shutil
import socket
import threading
from typing import Any

import fsspec
import pytest
import torch

from elastic_kit.store import CheckpointStore, save_checkpoint
from elastic_kit.store._manifest import MANIFEST_NAME, PAYLOAD_NAME
from elastic_kit.store._serialize import new_hasher
from elastic_kit.cli import EXIT_CORRUPT, EXIT_USAGE, main
from elastic_kit.errors import CheckpointConflictError, CheckpointError
from elastic_kit.testing import FaultFileSystem
from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (session fixtures)

LOG = "elastic_kit.store"


def _state(v: float, n: int = 20_000) -> dict[str, Any]:
    return {"w": torch.full((n,), float(v)), "v": v}


def _faulty(url: str, target: fsspec.AbstractFileSystem | None = None,
            **kw: Any) -> tuple[CheckpointStore, FaultFileSystem]:
    ffs = FaultFileSystem(target or fsspec.filesystem("file"))
    return CheckpointStore(url, filesystem=ffs, **kw), ffs


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path) -> tuple[str, fsspec.AbstractFileSystem]:
    """(url, real filesystem) on a local directory and on the moto server."""
    if request.param == "local":
        return str(tmp_path / "ck"), fsspec.filesystem("file")
    pytest.importorskip("s3fs")
    url, opts = request.getfixturevalue("s3_bucket")
    import s3fs

    return f"{url[len('s3://'):]}/run", s3fs.S3FileSystem(**opts)


# ---------------------------------------------------------------- 1. read errors
@pytest.mark.parametrize("error", [
    PermissionError(errno.EACCES, "403 Forbidden"),
    OSError(errno.EIO, "503 Service Unavailable"),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
], ids=["403", "503", "reset"])
def test_a_transient_read_error_is_retried_not_taken_for_corruption(backend, error):
    url, fs = backend
    store, ffs = _faulty(url, fs, keep_last=2)
    store.save(_state(1), step=1)
    store.save(_state(2), step=2)
    # the first two reads of the newest payload fail part way
    # (the payload: named afresh by each save through a filesystem wrapper)
    ffs.add("read", match="step-000000000002/state.", error=error, times=2,
            after_bytes=1000)
    loaded = store.load()
    assert loaded is not None and loaded.step == 2 and loaded.state["v"] == 2
    assert ffs.fired("read") == 2


def test_a_read_error_that_persists_is_raised_naming_the_url_never_an_older_step(tmp_path):
    store, ffs = _faulty(str(tmp_path / "ck"), keep_last=2, read_attempts=3)
    store.save(_state(1), step=1)
    store.save(_state(2), step=2)
    ffs.add("open", match="step-000000000002/", mode="rb", times=None,
            error=PermissionError(errno.EACCES, "403 Forbidden"))
    with pytest.raises(CheckpointError, match=r"step-000000000002.*3 attempt\(s\).*403 Forbidden"):
        store.load()
    ffs.clear()
    assert store.load().step == 2


def test_retention_never_deletes_a_newer_checkpoint_than_the_newest_verified(tmp_path):
    url = str(tmp_path / "ck")
    first = CheckpointStore(url, keep_last=None)
    first.save(_state(5), step=5)
    first.save(_state(10), step=10)
    # A store that never saw step 10 verify (e.g. a load that could not read it)
    # saves an older step with keep_last=1: 5 goes, 10 stays.
    second = CheckpointStore(url, keep_last=1)
    second.save(_state(6), step=6)
    second.wait()
    assert [i.step for i in second.list()] == [6, 10]
    assert CheckpointStore(url).load().step == 10


# ---------------------------------------------------------------- 2. monotonic commit
def _committed_v(url: str, fs: fsspec.AbstractFileSystem) -> Any:
    """What a fresh reader loads right now (its step and value)."""
    loaded = CheckpointStore(url, filesystem=fs).load()
    return None if loaded is None else (loaded.step, loaded.state["v"])


def test_a_resave_keeps_the_step_committed_at_every_moment_and_a_failed_one_keeps_the_old(
        backend):
    url, fs = backend
    store, ffs = _faulty(url, fs, keep_last=None)
    store.save(_state(1), step=4)
    seen: list[Any] = []
    ffs.add("write", match=".pt", before=lambda p: seen.append(_committed_v(url, fs)),
            after_bytes=100, times=1)
    ffs.add("pipe", match=MANIFEST_NAME, before=lambda p: seen.append(_committed_v(url, fs)))
    store.save(_state(2), step=4)
    assert seen == [(4, 1), (4, 1)]  # mid-upload and right before the switch: the old one
    assert _committed_v(url, fs) == (4, 2)
    # a re-save that fails part way leaves the previous state committed
    ffs.add("write", match=".pt", after_bytes=5000,
            error=ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"))
    with pytest.raises(OSError, match="Connection reset"):
        store.save(_state(3), step=4)
    assert _committed_v(url, fs) == (4, 2)
    assert [s for s, _, p in store.verify() if p is None] == [4]
    # only the payload the manifest names is left in the step directory
    files = sorted(p.rsplit("/", 1)[-1] for p in fs.find(f"{store.root}/step-000000000004"))
    assert len(files) == 2 and MANIFEST_NAME in files


def test_a_local_resave_switches_the_manifest_atomically(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep_last=None)
    store.save(_state(1), step=4)
    store.save(_state(2), step=4)
    step_dir = tmp_path / "ck" / "step-000000000004"
    m = json.loads((step_dir / MANIFEST_NAME).read_text())
    assert m["payload"] != PAYLOAD_NAME and sorted(os.listdir(step_dir)) == sorted(
        [MANIFEST_NAME, m["payload"]])
    assert store.load().state["v"] == 2


# ---------------------------------------------------------------- 3-5. hostile manifests
def _seal(path: pathlib.Path, **changes: Any) -> None:
    """Rewrite a manifest with ``changes`` (a value of None removes the key)."""
    mpath = path / MANIFEST_NAME
    m = json.loads(mpath.read_text())
    for k, v in changes.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    mpath.write_text(json.dumps(m))


def _digest(data: bytes) -> str:
    h = new_hasher("xxh3_128")
    h.update(data)
    return str(h.hexdigest())


def _two_steps(tmp_path: pathlib.Path) -> tuple[CheckpointStore, pathlib.Path]:
    store = CheckpointStore(tmp_path / "ck", keep_last=None)
    store.save(_state(1), step=1)
    store.save(_state(2), step=2)
    return store, tmp_path / "ck" / "step-000000000002"


def _hostile(kind: str, newest: pathlib.Path, tmp_path: pathlib.Path) -> None:
    m = json.loads((newest / MANIFEST_NAME).read_text())
    entry = m["files"][PAYLOAD_NAME]
    if kind == "no_files":
        _seal(newest, files={})
    elif kind == "other_file_only":
        (newest / "x.bin").write_bytes(b"x")
        _seal(newest, files={"x.bin": {"size": 1, "checksum": _digest(b"x")}})
    elif kind == "huge_size":
        (newest / MANIFEST_NAME).write_text(
            (newest / MANIFEST_NAME).read_text().replace(f'"size": {entry["size"]}',
                                                         '"size": 1e400'))
    elif kind == "nested":
        text = (newest / MANIFEST_NAME).read_text()
        (newest / MANIFEST_NAME).write_text(
            text[:-1] + ', "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif kind == "manifest_dir":
        os.remove(newest / MANIFEST_NAME)
        os.mkdir(newest / MANIFEST_NAME)
    elif kind == "bool_step":
        _seal(newest, step=True)
    elif kind == "float_world":
        _seal(newest, world_size=2.5)
    elif kind == "bad_checksum_algo":
        _seal(newest, checksum="md5")
    elif kind == "escape":  # a payload outside the store with a matching checksum
        outside = tmp_path / "x"
        shutil.copy(newest / PAYLOAD_NAME, outside)
        data = outside.read_bytes()
        _seal(newest, files={"../../x": {"size": len(data), "checksum": _digest(data)}},
              payload="../../x")
    elif kind == "absolute":
        _seal(newest, files={"/etc/hostname": entry}, payload="/etc/hostname")
    elif kind == "fifo":
        os.remove(newest / PAYLOAD_NAME)
        os.mkfifo(newest / PAYLOAD_NAME)
    elif kind == "symlink_dev_zero":
        os.remove(newest / PAYLOAD_NAME)
        os.symlink("/dev/zero", newest / PAYLOAD_NAME)
    else:  # pragma: no cover
        raise AssertionError(kind)


HOSTILE = {
    "no_files": "files must be an object of 1",
    "other_file_only": "payload 'state.pt' is not among the listed files",
    "huge_size": "size=inf must be an int",
    "nested": "nested too deeply",
    "manifest_dir": "is not a regular file",
    "bool_step": "step=True must be an int",
    "float_world": "world_size=2.5 must be an int",
    "bad_checksum_algo": "checksum='md5' must be one of",
    "escape": "'../../x' is not a plain file name",
    "absolute": "'/etc/hostname' is not a plain file name",
    "fifo": "is not a regular file",
    "symlink_dev_zero": "is a symbolic link",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_manifest_or_file_is_skipped_with_its_reason_everywhere(
        tmp_path, kind, caplog, capsys):
    store, newest = _two_steps(tmp_path)
    _hostile(kind, newest, tmp_path)
    reason = HOSTILE[kind]
    result: list[Any] = []
    # a FIFO or /dev/zero would block or never end: load in a thread, bounded
    with caplog.at_level(logging.WARNING, logger=LOG):
        t = threading.Thread(target=lambda: result.append(CheckpointStore(tmp_path / "ck").load()))
        t.start()
        t.join(60)
    assert not t.is_alive(), f"load() hangs on {kind}"
    assert result[0].step == 1 and result[0].state["v"] == 1
    assert any("step-000000000002" in r.getMessage() and reason in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    problems = dict((s, p) for s, _, p in store.verify())
    assert problems[1] is None and reason in problems[2], problems
    committed = [i.step for i in store.list()]
    assert 1 in committed and (2 not in committed or kind in ("fifo", "symlink_dev_zero"))
    assert main(["verify", str(tmp_path / "ck")]) == EXIT_CORRUPT
    out = capsys.readouterr()
    assert "CORRUPT  step 2" in out.out and reason in out.out and "Traceback" not in out.err
    assert main(["ls", str(tmp_path / "ck")]) == 0


def test_a_file_outside_the_store_is_never_opened_nor_its_size_leaked(tmp_path, caplog):
    store, newest = _two_steps(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 12345)
    _seal(newest, files={"../../secret": {"size": 1, "checksum": "0" * 32}},
          payload="../../secret")
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert store.load().step == 1
    assert "12345" not in caplog.text and "../../secret" in caplog.text


# ---------------------------------------------------------------- 6. leftovers, two jobs
def test_prune_from_another_pid_namespace_spares_an_in_flight_save(tmp_path, capsys):
    url = tmp_path / "ck"
    CheckpointStore(url, keep_last=None).save(_state(1), step=1)
    # An in-flight save of a job in another container: its pid means nothing here
    # (the old cleaner read "pid 999999 is dead on this host" and deleted it).
    host = socket.gethostname().replace("-", "_")
    tmp = url / f".tmp-step-000000000002-{host}-999999-abcd1234"
    tmp.mkdir()
    (tmp / PAYLOAD_NAME).write_bytes(b"being written")
    assert main(["prune", str(url), "--keep", "1"]) == 0
    assert tmp.exists() and (tmp / PAYLOAD_NAME).read_bytes() == b"being written"
    # once nothing in it changed for stale_after_s (10 minutes by default) it is a leftover
    old = (tmp / PAYLOAD_NAME).stat().st_mtime - 3600
    for p in (tmp / PAYLOAD_NAME, tmp):
        os.utime(p, (old, old))
    assert main(["prune", str(url), "--keep", "1"]) == 0
    assert not tmp.exists()
    assert [i.step for i in CheckpointStore(url).list()] == [1]


def _other_job_saves(url: str, step: int) -> None:
    CheckpointStore(url, keep_last=1).save(_state(step), step=step)


def test_a_second_job_writing_the_same_url_is_refused_and_its_saves_kept(tmp_path, caplog):
    url = str(tmp_path / "ck")
    store = CheckpointStore(url, keep_last=1)
    store.save(_state(1), step=1)
    other = mp.get_context("forkserver").Process(target=_other_job_saves, args=(url, 7))
    other.start()
    other.join(60)
    assert other.exitcode == 0
    with caplog.at_level(logging.ERROR, logger=LOG):
        store.save(_state(2), step=2)  # committed; retention sees the other job's step 7
        with pytest.raises(CheckpointConflictError, match="another job is writing checkpoints"):
            store.wait()
    assert "another job is writing checkpoints to" in caplog.text
    # this store deleted nothing (step 1 went to the other job's retention: it
    # predates that job, which started afterwards and kept only its newest)
    assert [i.step for i in store.list()] == [2, 7]
    with pytest.raises(CheckpointConflictError, match="step-000000000007.*own URL"):
        store.save(_state(3), step=3)


# ---------------------------------------------------------------- 7. load vs retention
def test_a_load_racing_retention_reads_the_newest_again(tmp_path):
    url = str(tmp_path / "ck")
    saver = CheckpointStore(url, keep_last=1)
    saver.save(_state(1), step=1)
    reader, ffs = _faulty(url)
    # just as the reader opens step 1's payload, the saver commits 2 and deletes 1
    ffs.add("open", match="step-000000000001/state.", mode="rb",
            before=lambda p: (saver.save(_state(2), step=2), saver.wait()))
    loaded = reader.load()
    assert ffs.fired("open") == 1
    assert loaded is not None and loaded.step == 2 and loaded.state["v"] == 2


def test_concurrent_loads_during_saves_at_keep_last_1_always_get_a_whole_checkpoint(tmp_path):
    url = str(tmp_path / "ck")
    saver = CheckpointStore(url, keep_last=1)
    saver.save(_state(0, n=200_000), step=0)
    stop = threading.Event()
    results: list[Any] = []

    def read() -> None:
        reader = CheckpointStore(url)
        while not stop.is_set():
            try:
                got = reader.load()
                results.append(None if got is None else (got.step, got.state["v"]))
            except Exception as e:  # recorded: the assertion below names it
                results.append(repr(e))

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for step in range(1, 25):
        saver.save(_state(step, n=200_000), step=step)
    stop.set()
    for t in threads:
        t.join(60)
    assert results and all(isinstance(r, tuple) and r[0] == r[1] for r in results), [
        r for r in results if not isinstance(r, tuple) or r[0] != r[1]][:3]


# ---------------------------------------------------------------- 8. canonical names
def test_only_canonical_step_directories_count_and_retention_leaves_others_alone(tmp_path):
    url = tmp_path / "ck"
    scratch = CheckpointStore(tmp_path / "scratch", keep_last=None)
    for step in (5, 12):
        scratch.save(_state(step), step=step)
    url.mkdir()
    odd = {"step-5": 5, "step-\u0661\u0662": 12, "step-12\n": 12, "step-0000000000012": 12}
    for name, step in odd.items():
        shutil.copytree(tmp_path / "scratch" / f"step-{step:012d}", url / name)
    store = CheckpointStore(url, keep_last=1)
    assert store.load() is None and store.list() == []
    store.save(_state(3), step=3)
    store.save(_state(4), step=4)
    store.wait()
    assert [i.step for i in store.list()] == [4]
    assert store.load().step == 4
    assert sorted(os.listdir(url)) == sorted([*odd, "step-000000000004"])


# ---------------------------------------------------------------- weak spots
def test_a_full_disk_is_named_and_leaves_nothing_behind(tmp_path):
    store, ffs = _faulty(str(tmp_path / "ck"), keep_last=None)
    store.save(_state(1), step=1)
    ffs.add("write", match="/state.", after_bytes=4096,
            error=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError) as ei:
        store.save(_state(2), step=2)
    assert ei.value.errno == errno.ENOSPC
    assert "no space left on device" in str(ei.value) and "step-000000000002" in str(ei.value)
    step2 = tmp_path / "ck" / "step-000000000002"
    assert not step2.exists() or [p for p in os.listdir(step2) if p.startswith("state.")] == []
    assert store.load().step == 1


def _save_under_fsize_limit(url: str, conn: Any) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    try:
        CheckpointStore(url).save(_state(1, n=1 << 20), step=1)
        conn.send(("saved", 0, ""))
    except Exception as e:
        conn.send((type(e).__name__, getattr(e, "errno", None), str(e)))


def test_a_local_write_error_is_raised_as_the_oserror_and_the_temp_dir_removed(tmp_path):
    """A real kernel write error on the local-disk path (RLIMIT_FSIZE gives EFBIG, the
    same path as ENOSPC) surfaces as that OSError, not torch's 'unexpected pos'."""
    ctx = mp.get_context("forkserver")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_save_under_fsize_limit, args=(str(tmp_path / "ck"), send))
    p.start()
    assert recv.poll(120), "the child did not report"
    name, err, msg = recv.recv()
    p.join(30)
    assert (name, err) == ("OSError", errno.EFBIG), (name, err, msg)
    assert "file too large" in msg and "state.pt" in msg and "unexpected pos" not in msg
    assert os.listdir(tmp_path / "ck") == []


def test_a_root_that_is_a_file_gives_the_same_clear_error_everywhere(tmp_path):
    (tmp_path / "f").write_text("x")
    store = CheckpointStore(tmp_path / "f")
    for call in (store.load, store.list, store.verify,
                 lambda: store.save(_state(1), step=1)):
        with pytest.raises(NotADirectoryError, match=r"url='.*/f' is a file, expected a dir"):
            call()


@pytest.mark.s3
def test_a_missing_bucket_is_reported_alike_on_load_and_save(s3_server):  # noqa: F811
    store = CheckpointStore("s3://no-such-bucket-ek/run", storage_options=s3_server.storage_options)
    for call in (store.load, store.list, lambda: store.save(_state(1), step=1)):
        with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket-ek' does not exist"):
            call()


class _Blackhole:
    """A TCP server that accepts connections and never answers (a hung endpoint)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.s3
def test_an_unresponsive_endpoint_fails_the_save_after_io_timeout_not_minutes():
    pytest.importorskip("s3fs")
    hole = _Blackhole()
    try:
        opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": hole.url,
                                                             "region_name": "us-east-1"}}
        store = CheckpointStore("s3://bucket/run", storage_options=opts, io_timeout=1.0,
                                read_attempts=1)
        errors: list[BaseException] = []

        def save_and_wait() -> None:
            try:
                store.save(_state(1), step=1, blocking=False)
                store.wait()
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=save_and_wait, daemon=True)
        t.start()
        t.join(120)  # a hang detector, not a timing claim: botocore's defaults took 411 s
        assert not t.is_alive(), "wait() still blocked on the unresponsive endpoint"
        assert errors and "timeout" in repr(errors[0]).lower(), errors
    finally:
        hole.close()


# ---------------------------------------------------------------- 9. CLI exit codes
def test_cli_unreachable_endpoint_and_bad_options_exit_2_without_a_traceback(tmp_path):
    import subprocess
    import sys

    from elastic_kit.testing import reserve_port

    with reserve_port() as hole:  # held, never listening: nothing can answer there
        opts = json.dumps({"key": "k", "secret": "s", "client_kwargs": {
            "endpoint_url": f"http://{hole.endpoint}", "region_name": "us-east-1"}})
        for argv in (["ls", "s3://bucket/run", "--storage-options", opts],
                     ["verify", "s3://bucket/run", "--storage-options", '{"no_such_option": 1}'],
                     ["prune", "s3://bucket/run", "--keep", "1", "--storage-options",
                      '{"client_kwargs": {"endpoint_url": "nope"}}']):
            run = subprocess.run([sys.executable, "-m", "elastic_kit", *argv], capture_output=True,
                                 text=True, timeout=300)
            assert run.returncode == EXIT_USAGE, (argv, run.stdout, run.stderr)
            assert "Traceback" not in run.stderr, run.stderr
            assert run.stderr.splitlines()[-1].startswith("error: "), run.stderr


def test_pathlib_paths_are_accepted_by_every_entry_point(tmp_path):
    save_checkpoint({"w": torch.ones(2)}, tmp_path / "ck", step=1)
    assert [i.step for i in CheckpointStore(tmp_path / "ck").list()] == [1]
