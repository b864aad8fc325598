"""The pieces a verification of a sharded step is made of, without a process group:
a box's digest share computed from its bytes as they stream in (any piece sizes)
equals the one computed from the tensor; an index whose chunks overlap is refused even
when they add up to the tensor; a tensor file is read once in bounded pieces; and a
flat step whose index (not its file) was damaged fails verification.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from elastic_kit.errors import CheckpointCorruptError
from elastic_kit.store import _chunk_listing
from elastic_kit.store._digest import BoxShare, partial
from elastic_kit.store._shard_index import ShardIndex
from elastic_kit.store._tensorfile import dtype_name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
@pytest.mark.parametrize("box", [((0, 0, 0), (5, 7, 3)), ((1, 2, 0), (3, 4, 3)),
                                 ((0, 3, 1), (5, 2, 1)), ((4, 6, 2), (1, 1, 1)),
                                 ((2, 0, 0), (0, 7, 3))])
def test_a_box_share_from_streamed_bytes_is_the_share_of_the_box(
        dtype: torch.dtype, box: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    offsets, shape = box
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(5, 7, 3, generator=g) * 50).to(dtype)
    local = full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))].contiguous()
    want = partial(local, offsets, full.shape)
    data = local.reshape(-1).view(torch.uint8).numpy() if local.numel() else np.zeros(0, np.uint8)
    for piece in (1, 3, 5, 8, 13, 1 << 20):
        seen = bytearray()
        s = BoxShare(shape, offsets, full.shape, full.element_size(), visit=seen.extend)
        for a in range(0, len(data), piece):
            s.update(data[a:a + piece])
        assert s.value == want, piece
        assert bytes(seen) == data.tobytes()  # every byte visited once, in order
    if local.numel():
        assert want != 0  # random values: the check above is not vacuous
        with pytest.raises(ValueError, match="more bytes than the box holds"):
            BoxShare(shape, offsets, full.shape, full.element_size()).update(
                np.zeros(len(data) + 1, np.uint8))


def _index(boxes: list[tuple[list[int], list[int]]], shape: list[int]) -> dict[str, Any]:
    chunks, pos = [], 0
    for k, (offsets, cshape) in enumerate(boxes):
        n = int(np.prod(cshape)) * 4
        chunks.append({"tensor": 0, "file": "f.bin", "offsets": offsets,
                       "entry": {"key": f"0@{k}", "dtype": "float32", "shape": cshape,
                                 "offset": pos, "nbytes": n, "checksum": "0" * 32}})
        pos += (n + 4095) // 4096 * 4096
    return {"digest": "elastic_kit.wsum64/1",
            "tensors": [{"path": "w", "dtype": dtype_name(torch.float32), "shape": shape,
                         "placements": "S(0)", "mesh": [2], "digest": "0" * 16}],
            "chunks": chunks}


def test_chunks_that_tile_their_tensor_parse() -> None:
    grid = [([r, c], [2, 3]) for r in (0, 2, 4) for c in (0, 3)]
    ShardIndex.from_json(_index(grid, [6, 6]), files={"f.bin": 1 << 20}, checksum="xxh3_128")
    rows = [([r, 0], [1, 5]) for r in range(7)] + [([7, 0], [0, 5])]  # an empty one too
    ShardIndex.from_json(_index(rows, [7, 5]), files={"f.bin": 1 << 20}, checksum="xxh3_128")


@pytest.mark.parametrize("boxes", [
    [([0, 0], [4, 1]), ([2, 0], [2, 2])],  # as many elements, one column uncovered
    [([0, 0], [2, 2]), ([0, 0], [2, 2])],  # one box twice (with a gap elsewhere)
    [([0, 0], [3, 2]), ([2, 0], [1, 2])],
])
def test_chunks_that_overlap_are_refused_even_when_they_add_up(
        boxes: list[tuple[list[int], list[int]]]) -> None:
    d = _index(boxes, [4, 2])
    if boxes[1] == ([0, 0], [2, 2]):
        d["tensors"][0]["shape"] = [2, 4]
    with pytest.raises(ValueError, match=r"the chunks of w at .* overlap"):
        ShardIndex.from_json(d, files={"f.bin": 1 << 20}, checksum="xxh3_128")


# ---------------------------------------------------------------------- flat steps
def _flat(tmp_path: Path) -> tuple[Any, Path]:
    from tests.unit.test_store_serialization_flat_listing import _commit

    return _commit(tmp_path, {"a": torch.arange(2048.0), "b": torch.full((1024,), 2.0)},
                   chunk_bytes=4096)


def _edit(d: Path, change: Any) -> None:
    m = json.loads((d / "manifest.json").read_text())
    change(m["sharded"])
    (d / "manifest.json").write_text(json.dumps(m))


def test_an_undamaged_flat_step_verifies(tmp_path: Path) -> None:
    layout, _ = _flat(tmp_path)
    assert layout.verify(layout.dir_of(1), deep=True).step == 1


def _digest(index: dict[str, Any]) -> None:
    t = index["tensors"][0]
    t["digest"] = ("0" if t["digest"][0] != "0" else "1") + t["digest"][1:]


def _rows_swapped(index: dict[str, Any]) -> None:
    a, b = [c for c in index["chunks"] if c["tensor"] == 0][:2]
    a["offsets"], b["offsets"] = b["offsets"], a["offsets"]


@pytest.mark.parametrize("change", [_digest, _rows_swapped])
def test_a_flat_step_whose_index_lies_about_a_tensor_fails_verification(
        tmp_path: Path, change: Any) -> None:
    # the file's listing checksum covers each chunk's place in the file and its bytes,
    # not which tensor (or where in it) a chunk is: the tensor's digest does
    layout, d = _flat(tmp_path)
    _edit(d, change)
    with pytest.raises(CheckpointCorruptError, match=r"sharded tensor \['a'\] does not match its "
                                                     r"saved digest"):
        layout.verify(layout.dir_of(1), deep=True)


# ---------------------------------------------------------------------- one bounded pass
class _Reads(io.RawIOBase):
    def __init__(self, data: bytes) -> None:
        self.f, self.sizes = io.BytesIO(data), []

    def read(self, n: int = -1) -> bytes:
        self.sizes.append(n)
        return self.f.read(n)


def test_a_tensor_file_is_read_once_in_bounded_pieces_and_a_short_read_is_no_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_kit.store._manifest import Manifest

    layout, d = _flat(tmp_path)
    m = Manifest.from_json((d / "manifest.json").read_bytes())
    name = _chunk_listing.flat_file(m)
    data = (d / name).read_bytes()
    monkeypatch.setattr(_chunk_listing, "_READ", 1000)
    f = _Reads(data)
    shares = _chunk_listing.verify_tensor_file(f, m, name, where=str(d))
    assert max(f.sizes) <= 1000 and f.f.tell() == len(data)
    _chunk_listing.check_digests(m, shares, where=str(d))
    with pytest.raises(OSError, match="a read cut short"):
        _chunk_listing.verify_tensor_file(_Reads(data[:5000]), m, name, where=str(d))
