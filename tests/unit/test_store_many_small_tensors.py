"""A state of many small tensors (an optimizer's state of many small parameters, an
embedding per feature) through the store: every value back exactly, whatever its
dtype, size or layout, and the payload byte for byte what ``torch.save`` writes.

``torch.save`` writes each tensor as several small pieces; the store joins them in a
C buffer before its checksumming writer (``_serialize.save_into``) and passes pieces
larger than the buffer through as they are. These tests pin what that must not
change: the bytes on storage (so checkpoints of earlier releases and of this one read
alike, with any loader), the checksums, the order of pieces around large tensors, and
a failed write that leaves nothing written after its error.
"""

from __future__ import annotations

import errno
import io
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_kit import load_checkpoint, save_checkpoint
from elastic_kit.store import CheckpointStore
from elastic_kit.store import _serialize
from elastic_kit.store._serialize import (
    COALESCE_BYTES, HashingWriter, new_hasher, prepare_state, save_into, torch_zip_crc_off,
)

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64]


def _tensor(g: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g,
                         dtype=dtype)


def _state(n: int, *, seed: int = 0, large: bool = True) -> dict[str, Any]:
    """``n`` small tensors of every dtype and size from empty to a few hundred
    elements, 0-d ones, views (strided, transposed, of a larger storage), a tensor
    under two keys, a few tensors larger than the write buffer between them, and
    plain values."""
    g = torch.Generator().manual_seed(seed)
    small: dict[str, Any] = {}
    for i in range(n):
        dtype = _DTYPES[i % len(_DTYPES)]
        kind = i % 7
        if kind == 0:
            t = _tensor(g, dtype, ())                                 # 0-d
        elif kind == 1:
            t = _tensor(g, dtype, (0,))                               # empty
        elif kind == 2:
            t = _tensor(g, dtype, (int(torch.randint(1, 300, (), generator=g)),))
        elif kind == 3:
            t = _tensor(g, dtype, (3, 5)).t()                         # transposed view
        elif kind == 4:
            t = _tensor(g, dtype, (40,))[::3]                         # strided view
        elif kind == 5:
            t = _tensor(g, dtype, (1000,))[10:18]                     # view of a larger one
        else:
            t = _tensor(g, dtype, (2, 3, 4))
        small[f"p{i}"] = t
    state: dict[str, Any] = {"small": small, "step": 7, "names": ["a", "b"],
                             "lr": 0.125, "nested": {"list": [small["p2"], 3]}}
    state["tied"] = small["p2"]  # the same tensor under two keys
    if large:
        state["big"] = {
            "a": torch.randn(COALESCE_BYTES // 4 + 17, generator=g),   # just over the buffer
            "b": torch.randn(3 << 18, generator=g),                    # 3 MiB
            "c": torch.randn(COALESCE_BYTES // 4 - 3, generator=g),   # just under it
            "h": torch.randn(1 << 20, generator=g).half(),
        }
    return state


def _assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{path}/{i}")
    else:
        assert got == want and type(got) is type(want), path


def _torch_save_bytes(state: Any, *, blocking: bool = True) -> bytes:
    """What torch.save writes for ``state`` as the store stages it (a non-blocking
    save writes its contiguous staging copies), with torch's own zip CRC off as the
    store has it (its checksum covers every byte)."""
    buf = io.BytesIO()
    w = HashingWriter(buf, "xxh3_128")
    staged = (prepare_state(state, copy=False) if blocking
              else prepare_state(state, copy=True, pool={}, used={}))
    with torch_zip_crc_off(w):
        torch.save(staged, w)
    w.close()
    return buf.getvalue()


def _payload(store: CheckpointStore, step: int) -> bytes:
    (info,) = [i for i in store.list() if i.step == step]
    (name,) = info.manifest.files
    with open(os.path.join(info.path, name), "rb") as f:
        return f.read()


@pytest.mark.parametrize("blocking", [True, False])
def test_many_small_tensors_round_trip_exactly(tmp_path: Path, blocking: bool) -> None:
    state = _state(3000)
    with CheckpointStore(tmp_path / "ck") as store:
        store.save(state, step=1, blocking=blocking)
        store.wait()
        assert store.verify() == [(1, store.list()[0].path, None)]
        loaded = store.load()
        assert loaded is not None and loaded.step == 1
        _assert_same(loaded.state, state)
        # a tensor under two keys is still one tensor after the load
        assert loaded.state["tied"].data_ptr() == loaded.state["small"]["p2"].data_ptr()
        # plain torch.load of the payload reads the same values
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = torch.load(io.BytesIO(_payload(store, 1)), weights_only=True)
        _assert_same(plain, state)


@pytest.mark.parametrize("checksum", ["xxh3_128", "crc32", "sha256"])
@pytest.mark.parametrize("large", [True, False])
def test_the_payload_is_byte_for_byte_what_torch_save_writes(
        tmp_path: Path, checksum: str, large: bool) -> None:
    """However the pieces were joined, the file is torch.save's stream and the
    manifest's checksum is of that stream: any reader, of any release, reads it."""
    state = _state(1500, seed=1, large=large)
    with CheckpointStore(tmp_path / "ck", checksum=checksum) as store:
        store.save(state, step=3)
        store.save(state, step=4, blocking=False)
        store.wait()
        for step in (3, 4):
            want = _torch_save_bytes(state, blocking=step == 3)
            got = _payload(store, step)
            assert got == want
            (info,) = [i for i in store.list() if i.step == step]
            (entry,) = info.manifest.files.values()
            h = new_hasher(checksum)
            h.update(want)
            assert entry.size == len(want) and entry.checksum == h.hexdigest()


def _save_into_unbuffered(f: Any, path: str, state: Any, checksum: str, *,
                          fsync: bool) -> Any:
    """The payload writer as it was before its writes were joined: torch.save straight
    into the checksumming writer, one write per piece."""
    from elastic_kit.store._direct import DirectFile
    from elastic_kit.store._manifest import FileEntry
    from elastic_kit.store._tree import iter_tensors

    w = HashingWriter(f, checksum, stable=list(iter_tensors(state)))
    try:
        with torch_zip_crc_off(w):
            torch.save(state, w)
        if isinstance(f, DirectFile):
            f.finish(fsync=fsync)
        else:
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        size, digest = w.finish()
    finally:
        w.close()
    return FileEntry(size=size, checksum=digest)


def test_a_checkpoint_written_one_piece_at_a_time_still_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store written by the earlier writer (one write per piece) loads, verifies
    and is replaced by a re-save of the same step, with the same bytes."""
    state = _state(2000, seed=2)
    import elastic_kit.store._layout as layout_mod

    with monkeypatch.context() as m:
        m.setattr(layout_mod, "save_into", _save_into_unbuffered)
        with CheckpointStore(tmp_path / "ck") as old:
            old.save(state, step=5)
            before = _payload(old, 5)
    with CheckpointStore(tmp_path / "ck") as store:
        assert [problem for _, _, problem in store.verify()] == [None]
        loaded = store.load()
        assert loaded is not None and loaded.step == 5
        _assert_same(loaded.state, state)
        store.save(state, step=5)  # re-saved by this writer: the same bytes
        assert _payload(store, 5) == before
        into = {"small": {k: torch.zeros_like(v) for k, v in state["small"].items()}}
        got = load_checkpoint(into, store)
        assert got is not None and got.step == 5
        _assert_same(into["small"], state["small"])


def test_save_checkpoint_of_many_tiny_tensors_loads_into_a_dict(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(8, generator=g) for i in range(20_000)}
    save_checkpoint(state, str(tmp_path / "ck"), step=1)
    into = {k: torch.empty(8) for k in state}
    loaded = load_checkpoint(into, str(tmp_path / "ck"))
    assert loaded is not None and loaded.step == 1
    for k, v in state.items():
        assert torch.equal(into[k], v), k


class _FullDisk(io.RawIOBase):
    """A file that takes ``room`` bytes, then fails every write with ENOSPC, and
    records every write it was asked for."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.data = bytearray()
        self.after_error = 0
        self.failed = False

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if self.failed:
            self.after_error += 1
        if len(self.data) + mv.nbytes > self.room:
            self.failed = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.data += mv
        return mv.nbytes

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")


@pytest.mark.parametrize("room", [10, 100_000, 2 * COALESCE_BYTES + 5])
def test_a_failed_write_raises_and_nothing_is_written_after_it(room: int) -> None:
    state = prepare_state(_state(800, seed=4), copy=False)
    f = _FullDisk(room)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an "Exception ignored" on the way out fails
        with pytest.raises(OSError) as e:
            save_into(f, "/x/state.pt", state, "xxh3_128", fsync=False)
    assert e.value.errno == errno.ENOSPC and "/x/state.pt" in str(e.value)
    assert f.after_error == 0
    assert len(f.data) <= room


def test_large_pieces_are_still_hashed_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The join buffer passes a piece larger than itself through as the tensor's own
    memory: the hash thread gets it without a copy, as before the buffer."""
    big = torch.randn(3 << 18)  # 3 MiB: past the inline hashing and the buffer
    state = {"big": big, "small": [torch.randn(3) for _ in range(100)]}
    want = _torch_save_bytes(state)
    queued: list[Any] = []
    real = HashingWriter.write

    def spy(self: HashingWriter, b: Any) -> int:
        queued.append(memoryview(b).nbytes)
        return real(self, b)

    monkeypatch.setattr(HashingWriter, "write", spy)
    zero_copy: list[bool] = []
    real_stable = HashingWriter._is_stable

    def spy_stable(self: HashingWriter, mv: memoryview) -> bool:
        out = real_stable(self, mv)
        zero_copy.append(out)
        return out

    monkeypatch.setattr(HashingWriter, "_is_stable", spy_stable)
    buf = io.BytesIO()
    entry = save_into(buf, "/x", state, "xxh3_128", fsync=False)
    assert buf.getvalue() == want
    assert entry.size == len(buf.getvalue())
    assert big.nbytes in queued and True in zero_copy
    # the small pieces were joined: a handful of writes, not several per tensor
    assert len(queued) < 20
    assert _serialize.COALESCE_BYTES == COALESCE_BYTES
