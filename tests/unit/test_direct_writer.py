"""The O_DIRECT payload writer (``elastic_kit.store._direct``).

Every test asserts on what this machine's filesystems actually do: where ``O_DIRECT``
is refused, the fallback path is what is checked (never a skip).
"""

from __future__ import annotations

import errno
import json
import os
import random

import pytest
import torch

from elastic_kit import CheckpointStore
from elastic_kit.store import _direct
from elastic_kit.store._direct import ALIGN, DirectFile, open_direct
from elastic_kit.store._manifest import MANIFEST_NAME
from elastic_kit.store._serialize import hash_stream

BUF = 64 << 10  # small buffers: many hand-offs to the writer thread with little data


def _odirect_accepted(directory: str) -> bool:
    """Whether the filesystem holding ``directory`` accepts O_DIRECT at open."""
    if not getattr(os, "O_DIRECT", 0):
        return False
    probe = os.path.join(directory, f".probe-{os.getpid()}-{random.getrandbits(32):x}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as e:
        assert e.errno == errno.EINVAL, e
        return False
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    os.close(fd)
    return True


def _pieces(total: int, rng: random.Random, *, small: bool) -> list[bytes]:
    data = rng.randbytes(total)
    if not small:
        return [data] if total else []
    out, i = [], 0
    while i < total:
        k = rng.choice([1, 7, 100, 4095, 4096, 4097, 33333])
        out.append(data[i:i + k])
        i += k
    return out


def _write(path: str, pieces: list[bytes], *, buffer_size: int = BUF) -> DirectFile | None:
    f = open_direct(path, "wb", buffer_size=buffer_size)
    if f is None:
        with open(path, "wb") as g:
            for p in pieces:
                g.write(p)
        return None
    with f:
        for p in pieces:
            assert f.write(p) == len(p)
        assert f.finish() == sum(map(len, pieces))
    return f


SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, BUF, BUF + 1, 2 * BUF, 5 * BUF + 12345,
         3 * BUF - 1]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("small", [False, True], ids=["one-write", "many-writes"])
def test_the_file_is_byte_identical_with_the_exact_size(tmp_path, size, small):
    rng = random.Random(size * 2 + small)
    pieces = _pieces(size, rng, small=small)
    path = str(tmp_path / "f.bin")
    f = _write(path, pieces)
    assert (f is not None) == _odirect_accepted(str(tmp_path))
    if f is not None:
        assert f.closed and f.size == size
        assert f.direct_io == (size >= ALIGN)  # the aligned bulk went O_DIRECT
    assert os.path.getsize(path) == size
    with open(path, "rb") as g:
        assert g.read() == b"".join(pieces)


def test_a_huge_write_with_the_default_buffers_and_a_memoryview_of_floats(tmp_path):
    t = torch.rand((3 << 20) + 3)  # 12 MiB + 12 bytes, one write() of a non-byte view
    path = str(tmp_path / "big.bin")
    f = open_direct(path, "wb")
    expected = t.numpy().tobytes()
    if f is None:
        assert not _odirect_accepted(str(tmp_path))
        return
    with f:
        assert f.write(memoryview(t.numpy())) == len(expected)
        f.finish()
        assert f.size == len(expected) and f.direct_io  # the O_DIRECT writes worked here
    assert os.path.getsize(path) == len(expected)
    with open(path, "rb") as g:
        assert g.read() == expected


def test_close_without_finish_writes_everything_like_a_buffered_file(tmp_path):
    data = random.Random(3).randbytes(3 * BUF + 77)
    path = str(tmp_path / "c.bin")
    f = open_direct(path, "wb", buffer_size=BUF)
    if f is None:
        assert not _odirect_accepted(str(tmp_path))
        return
    with f:
        f.write(data)
    with open(path, "rb") as g:
        assert g.read() == data
    with pytest.raises(ValueError):
        f.write(b"x")


def test_xb_refuses_an_existing_file_and_wb_truncates_it(tmp_path):
    path = tmp_path / "e.bin"
    path.write_bytes(b"y" * 100_000)
    if not _odirect_accepted(str(tmp_path)):
        assert open_direct(str(path), "wb") is None
        return
    with pytest.raises(FileExistsError):
        open_direct(str(path), "xb")
    assert path.read_bytes() == b"y" * 100_000
    with open_direct(str(path), "wb") as f:
        f.write(b"abc")
        f.finish()
    assert path.read_bytes() == b"abc"


def _mount_type(path: str) -> str | None:
    """The filesystem type of the longest mount point containing ``path`` (/proc/mounts)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    path = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if path == point or path.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) > best[0]:
                best = (len(point), kind)
    return best[1] if best else None


def _shm_dir() -> str | None:
    ok = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    return "/dev/shm" if ok else None


def test_memory_filesystem_agrees_with_the_mount_table(tmp_path):
    for d in filter(None, [str(tmp_path), _shm_dir(), os.getcwd()]):
        kind = _mount_type(d)
        expected = kind if kind in ("tmpfs", "ramfs") else None
        assert _direct.memory_filesystem(d) == expected, (d, kind)


def test_on_a_memory_filesystem_open_direct_writes_buffered_and_leaves_nothing():
    """/dev/shm (the in-memory snapshots) is tmpfs: its pages are the storage, so
    O_DIRECT (accepted there since Linux 6.6) would only add a staging copy."""
    d = _shm_dir()
    if d is None or _direct.memory_filesystem(d) is None:
        pytest.skip("no writable memory filesystem at /dev/shm")
    path = os.path.join(d, f"ek-direct-test-{os.getpid()}-{random.getrandbits(32):x}")
    try:
        assert open_direct(path, "xb", buffer_size=BUF) is None
        assert not os.path.exists(path)
        # DirectFile itself still does what the filesystem allows: exact bytes when
        # the flag is accepted, a refusal (and no file) when it is not.
        data = random.Random(5).randbytes(BUF + 4099)
        if not _odirect_accepted(d):
            with pytest.raises(_direct.DirectIORefused):
                DirectFile(path, "xb", buffer_size=BUF)
            assert not os.path.exists(path)
            return
        with DirectFile(path, "xb", buffer_size=BUF) as f:
            f.write(data)
            f.finish()
        with open(path, "rb") as g:
            assert g.read() == data
    finally:
        if os.path.exists(path):
            os.remove(path)


def test_without_o_direct_on_the_platform_open_direct_returns_none(tmp_path, monkeypatch):
    monkeypatch.setattr(_direct, "_O_DIRECT", 0)
    path = tmp_path / "n.bin"
    assert open_direct(str(path), "xb") is None
    assert not path.exists()


def test_a_refusal_at_the_first_write_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """Some filesystems accept O_DIRECT at open and refuse the I/O (EINVAL): the file is
    then written buffered, transparently, and still comes out exact."""
    import fcntl

    if not _odirect_accepted(str(tmp_path)):
        assert open_direct(str(tmp_path / "r.bin"), "wb") is None
        return
    real = os.pwrite
    refused = []

    def pwrite(fd: int, data, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(_direct, "_pwrite", pwrite)
    data = random.Random(7).randbytes(4 * BUF + 999)
    path = str(tmp_path / "r.bin")
    with open_direct(path, "wb", buffer_size=BUF) as f:
        f.write(data)
        f.finish()
        assert f.direct_io is False
    assert refused == [0]
    with open(path, "rb") as g:
        assert g.read() == data


@pytest.mark.parametrize("at", ["write", "finish"])
def test_a_writer_thread_error_reaches_the_caller(tmp_path, monkeypatch, at):
    """ENOSPC in the background writer is raised by the next write() (or finish())."""
    path = str(tmp_path / "full.bin")
    calls = []

    def full(fd: int, data, offset: int) -> int:
        calls.append(offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_direct, "_pwrite", full)
    f = open_direct(path, "wb", buffer_size=BUF)
    if f is None:  # no O_DIRECT here: the buffered fallback has no writer thread
        assert not _odirect_accepted(str(tmp_path))
        return
    with f:
        with pytest.raises(OSError) as ei:
            if at == "write":
                for _ in range(8):  # 2 buffers: the error shows within a few hand-offs
                    f.write(b"z" * BUF)
            else:
                f.write(b"z" * (BUF + 5))
                f.finish()
        assert ei.value.errno == errno.ENOSPC
        with pytest.raises(OSError) as again:  # and keeps being raised
            f.finish()
        assert again.value.errno == errno.ENOSPC
    assert calls and calls[0] == 0


def test_a_store_round_trip_is_bitwise_and_the_checksum_verifies(tmp_path, monkeypatch):
    from elastic_kit.store import _backend_local

    opened: list[DirectFile | None] = []

    def recording(path, mode):
        opened.append(open_direct(path, mode))
        return opened[-1]

    monkeypatch.setattr(_backend_local, "open_direct", recording)
    g = torch.Generator().manual_seed(0)
    state = {
        "a": torch.rand((3 << 20) // 4 + 3, generator=g),  # 3 MiB + 12 bytes
        "odd": torch.randint(0, 256, ((3 << 20) + 13,), generator=g, dtype=torch.uint8),
        "b": torch.rand(13, generator=g, dtype=torch.float64),
        "c": torch.randn(1023, 517, generator=g),
        "h": torch.rand(4097, generator=g).to(torch.bfloat16),
        "meta": {"lr": 0.1, "name": "x"},
    }
    root = tmp_path / "s"
    store = CheckpointStore(str(root))
    store.save(state, step=1)
    store.save(state, step=1)  # a re-save of a committed step ("xb" path)
    accepted = _odirect_accepted(str(tmp_path))
    assert len(opened) == 2 and all((f is not None) == accepted for f in opened)
    assert all(f.direct_io and f.closed for f in opened if f is not None)
    loaded = store.load()
    assert loaded.step == 1
    for k in ("a", "odd", "b", "c", "h"):
        assert loaded.state[k].dtype == state[k].dtype
        assert torch.equal(loaded.state[k].view(torch.uint8), state[k].view(torch.uint8))
    assert loaded.state["meta"] == state["meta"]
    info = store.list()[0]
    assert store.verify() == [(1, info.path, None)]
    manifest = json.loads((root / "step-000000000001" / MANIFEST_NAME).read_text())
    (name, entry), = manifest["files"].items()
    payload = root / "step-000000000001" / name
    assert os.path.getsize(payload) == entry["size"]
    with open(payload, "rb") as f:
        assert hash_stream(f, manifest["checksum"]) == (entry["size"], entry["checksum"])
    assert sorted(os.listdir(root / "step-000000000001")) == sorted([MANIFEST_NAME, name])


def test_finding_statfs_starts_no_process(tmp_path, monkeypatch):
    """The first save's background thread looks up libc's ``statfs``. Through
    ``ctypes.util.find_library`` that ran ``ldconfig`` in a subprocess, and a DataLoader
    worker forked by the training thread meanwhile inherited the pipe ``subprocess``
    waits on for the child's exec: the save hung for as long as that worker lived. The
    lookup must start no process."""
    import subprocess

    started: list[object] = []

    def no_process(*args, **kwargs):
        started.append(args)
        raise OSError("no process may be started here")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    _direct._libc_statfs.cache_clear()
    try:
        kind = _direct.memory_filesystem(str(tmp_path))
        assert started == []
        assert kind == (_mount_type(str(tmp_path)) if _mount_type(str(tmp_path)) in (
            "tmpfs", "ramfs") else None)
        assert _direct._libc_statfs() is not None
    finally:
        _direct._libc_statfs.cache_clear()
