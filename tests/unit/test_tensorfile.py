"""The flat tensor file: aligned raw bytes, an index that validates, range and mmap reads;
and the layout-independent digest of a tensor's global content."""

from __future__ import annotations

import json
import math

import fsspec
import pytest
import torch

from elastic_kit.errors import CheckpointCorruptError
from elastic_kit.store._digest import combine, partial, runs
from elastic_kit.store._direct import open_direct
from elastic_kit.store._shard_index import ShardIndex
from elastic_kit.store._tensorfile import (
    ALIGN, RangeReader, TensorEntry, map_file, plan, read_tensor, view, write_into, write_stream,
)


def _items() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(33, 7, generator=g)),
            ("half", torch.randn(5, generator=g).to(torch.bfloat16)),
            ("mask", torch.tensor([True, False, True])),
            ("scalar", torch.tensor(3.5, dtype=torch.float64)),
            ("empty", torch.zeros(0, 4)),
            ("idx", torch.arange(10, dtype=torch.int64).reshape(2, 5).t())]  # not contiguous


def test_tensors_start_aligned_and_read_back_exactly(tmp_path) -> None:
    path = str(tmp_path / "t.bin")
    with open(path, "wb") as f:
        entries, size, _ = write_stream(f, _items())
    assert size == (tmp_path / "t.bin").stat().st_size
    assert all(e.offset % ALIGN == 0 for e in entries)
    assert [e.offset for e in entries] == plan(_items())[0]
    with RangeReader.local(path) as r:
        for (key, t), e in zip(_items(), entries):
            got = read_tensor(r, e, checksum="xxh3_128")
            assert e.key == key and got.dtype == t.dtype and torch.equal(got, t)


def test_direct_file_and_fsspec_stream_write_the_same_bytes(tmp_path) -> None:
    a, b = str(tmp_path / "a.bin"), "memory://tf/b.bin"
    f = open_direct(a, "wb") or open(a, "wb")
    with f:
        ea, size_a, da = write_stream(f, _items())
        if hasattr(f, "finish"):
            f.finish(fsync=True)
    fs = fsspec.filesystem("memory")
    with fs.open(b, "wb") as g:
        eb, size_b, db = write_stream(g, _items())
    assert (ea, size_a, da) == (eb, size_b, db)
    # ranged reads through fsspec's cat_file give the same tensors
    r = RangeReader("/tf/b.bin", fs=fs)
    assert torch.equal(read_tensor(r, eb[0], checksum="xxh3_128"), _items()[0][1])


def test_write_into_a_mapped_file_gives_zero_copy_views(tmp_path) -> None:
    _, size = plan(_items())
    mapped = map_file(str(tmp_path / "shm.bin"), size)
    entries = write_into(mapped, _items())
    with open(tmp_path / "s.bin", "wb") as f:
        streamed, _, _ = write_stream(f, _items())
    assert entries == streamed  # same index, same checksums
    w = view(mapped, entries[0])
    assert torch.equal(w, _items()[0][1])
    w[0, 0] = 42.0  # a view of the mapping: the file's bytes change
    again = map_file(str(tmp_path / "shm.bin"), size)
    assert view(again, entries[0])[0, 0].item() == 42.0


def test_a_flipped_byte_is_corruption_naming_the_tensor(tmp_path) -> None:
    path = tmp_path / "t.bin"
    with open(path, "wb") as f:
        entries, _, _ = write_stream(f, _items())
    data = bytearray(path.read_bytes())
    data[entries[0].offset + 17] ^= 1
    path.write_bytes(bytes(data))
    with RangeReader.local(str(path)) as r, pytest.raises(CheckpointCorruptError,
                                                          match=r"tensor 'w'.*corrupt"):
        read_tensor(r, entries[0], checksum="xxh3_128")


def test_a_short_file_and_a_symlink_are_refused(tmp_path) -> None:
    path = tmp_path / "t.bin"
    with open(path, "wb") as f:
        entries, _, _ = write_stream(f, _items())
    path.write_bytes(path.read_bytes()[:entries[0].offset + 10])
    with RangeReader.local(str(path)) as r, pytest.raises(CheckpointCorruptError,
                                                          match="shorter"):
        read_tensor(r, entries[0], checksum="xxh3_128")
    (tmp_path / "link.bin").symlink_to(path)
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        RangeReader.local(str(tmp_path / "link.bin"))


@pytest.mark.parametrize("field, value, why", [
    ("dtype", "object", "dtype"),
    ("offset", 4097, "multiple of 4096"),
    ("nbytes", 12, "nbytes=12"),
    ("shape", [-1], "shape"),
    ("offset", 1 << 60, "offset"),
    ("checksum", "zz", "checksum"),
    ("key", "", "key"),
])
def test_a_hostile_index_entry_is_refused(field: str, value, why: str) -> None:
    good = TensorEntry("w", "float32", (2, 3), 4096, 24, "0" * 32).to_json()
    assert TensorEntry.from_json(good, checksum="xxh3_128", file_size=8192).shape == (2, 3)
    with pytest.raises(ValueError, match=why):
        TensorEntry.from_json({**good, field: value}, checksum="xxh3_128")
    with pytest.raises(ValueError, match="beyond the file"):
        TensorEntry.from_json(good, checksum="xxh3_128", file_size=4100)


def _index(**chunk) -> dict:
    entry = TensorEntry("0@0,0", "float32", (2, 3), 0, 24, "0" * 32).to_json()
    return {"digest": "elastic_kit.wsum64/1",
            "tensors": [{"path": "['w']", "dtype": "float32", "shape": [4, 3],
                         "placements": "Shard(dim=0)", "mesh": [2], "digest": "0" * 16}],
            "chunks": [{"tensor": 0, "file": "a.bin", "offsets": [0, 0], "entry": entry},
                       {"tensor": 0, "file": "a.bin", "offsets": [2, 0],
                        "entry": {**entry, "offset": 4096}, **chunk}]}


@pytest.mark.parametrize("chunk, why", [
    ({"offsets": [3, 0]}, "does not lie inside"),
    ({"tensor": 1}, "must index"),
    ({"file": "../x.bin"}, "not a listed file"),
    ({"offsets": [2]}, "does not lie inside"),
])
def test_a_hostile_shard_index_is_refused(chunk: dict, why: str) -> None:
    files = {"a.bin": 8192}
    assert len(ShardIndex.from_json(_index(), files=files, checksum="xxh3_128").chunks) == 2
    with pytest.raises(ValueError, match=why):
        ShardIndex.from_json(_index(**chunk), files=files, checksum="xxh3_128")
    short = _index()
    short["chunks"].pop()
    with pytest.raises(ValueError, match="hold 6 elements, the tensor 12"):
        ShardIndex.from_json(short, files=files, checksum="xxh3_128")
    json.dumps(_index())  # what the manifest stores is plain JSON


def _boxes(shape: tuple[int, ...], dim: int, parts: int):
    pieces = torch.arange(shape[dim]).chunk(parts)
    for p in pieces:
        offsets = [0] * len(shape)
        offsets[dim] = int(p[0])
        size = list(shape)
        size[dim] = len(p)
        yield tuple(offsets), tuple(size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8,
                                   torch.bool, torch.complex64])
def test_the_digest_does_not_depend_on_the_sharding(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 1500, generator=g) * 50).to(dtype)
    whole = combine([partial(x, (0, 0), x.shape)])
    for dim, parts in ((0, 2), (0, 3), (1, 4), (0, 37)):
        shards = [partial(x[tuple(slice(o, o + s) for o, s in zip(off, size))], off, x.shape)
                  for off, size in _boxes(tuple(x.shape), dim, parts)]
        assert combine(shards) == whole, (dim, parts)


def test_the_digest_sees_a_changed_or_moved_element() -> None:
    x = torch.randn(300, 500)
    whole = combine([partial(x, (0, 0), x.shape)])
    y = x.clone()
    y.view(torch.int32).view(-1)[123_456] ^= 1  # one bit
    assert combine([partial(y, (0, 0), x.shape)]) != whole
    z = x.clone()
    z[[7, 8]] = z[[8, 7]]  # two rows swapped
    assert combine([partial(z, (0, 0), x.shape)]) != whole
    # a shard put at the wrong offset
    top, bottom = x[:150], x[150:]
    assert combine([partial(top, (150, 0), x.shape), partial(bottom, (0, 0), x.shape)]) != whole


def test_runs_of_a_box_cover_it_in_c_order() -> None:
    got = list(runs((2, 3), (1, 2), (4, 6)))
    assert got == [(0, 8, 3), (3, 14, 3)]
    assert sum(n for *_, n in runs((4, 6), (0, 0), (4, 6))) == math.prod((4, 6))
