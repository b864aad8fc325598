"""Opening a flat snapshot checks its chunk listing as verifying one does: a manifest
whose chunks do not match the file's listing checksum, or overlap, is corruption,
even when every listed chunk's own bytes match their checksum.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from elastic_kit.errors import CheckpointCorruptError
from elastic_kit.store import (
    FLAT_NAME, MANIFEST_NAME, Layout, commit_flat, copy_tensors, hash_flat, map_file, open_flat,
    plan_flat, split_state, tensor_views,
)
from elastic_kit.store._chunk_listing import listing_digest


def _commit(tmp_path: Path, state: dict[str, Any], *, chunk_bytes: int) -> tuple[Layout, Path]:
    layout = Layout(fsspec.filesystem("file"), str(tmp_path / "store"),
                    url=str(tmp_path / "store"))
    payload, items = split_state(state)
    plan = plan_flat(items, chunk_bytes=chunk_bytes)
    mapped = map_file(str(tmp_path / "slot.bin"), plan.size)
    copy_tensors([(v, t) for v, (_, t) in zip(tensor_views(mapped, plan), items)])
    d, _ = commit_flat(layout, step=1, flat_path=str(tmp_path / "slot.bin"), plan=plan,
                       hashes=hash_flat(mapped, plan), payload=payload, metadata={})
    return layout, Path(d)


def _edit(d: Path, change: Any, *, relist: bool) -> None:
    """Apply ``change`` to the manifest's chunks; ``relist``: recompute the file's listing
    checksum to match (so only the other checks can catch the edit)."""
    m = json.loads((d / MANIFEST_NAME).read_text())
    chunks = m["sharded"]["chunks"]
    change(chunks)
    if relist:
        entry = m["files"][FLAT_NAME]
        entry["checksum"] = listing_digest(
            entry["size"], [(c["entry"]["offset"], c["entry"]["nbytes"], c["entry"]["checksum"])
                            for c in chunks], m["checksum"])
    (d / MANIFEST_NAME).write_text(json.dumps(m))


def test_the_untouched_snapshot_opens_with_its_values(tmp_path: Path) -> None:
    layout, _ = _commit(tmp_path, {"w": torch.arange(2048.0)}, chunk_bytes=4096)
    assert torch.equal(open_flat(layout, layout.dir_of(1)).state["w"], torch.arange(2048.0))


@pytest.mark.parametrize("verify", [True, False])
def test_a_chunk_listed_twice_in_place_of_another_is_corruption(tmp_path: Path,
                                                                verify: bool) -> None:
    layout, d = _commit(tmp_path, {"w": torch.zeros(2048)}, chunk_bytes=4096)

    def twice(chunks: list[dict[str, Any]]) -> None:
        assert [c["entry"]["offset"] for c in chunks] == [0, 4096]
        chunks[1] = json.loads(json.dumps(chunks[0]))

    _edit(d, twice, relist=False)
    with open(d / FLAT_NAME, "r+b") as f:  # the bytes no chunk lists any more
        f.seek(4096 + 8)
        f.write(b"\xff" * 16)
    # (the two boxes of w that overlap are refused when the manifest is parsed)
    with pytest.raises(CheckpointCorruptError,
                       match=r"the chunks of tensors\.bin do not match its xxh3_128"
                             r"|the chunks of \['w'\] at \[0\] .* overlap"):
        open_flat(layout, layout.dir_of(1), verify=verify)


def test_a_chunk_moved_onto_another_tensors_bytes_is_corruption(tmp_path: Path) -> None:
    layout, d = _commit(tmp_path, {"a": torch.ones(1024), "b": torch.full((1024,), 2.0)},
                        chunk_bytes=4096)

    def onto_a(chunks: list[dict[str, Any]]) -> None:
        a, b = chunks
        assert (a["tensor"], a["entry"]["offset"], b["tensor"], b["entry"]["offset"]) == \
            (0, 0, 1, 4096)
        b["entry"]["offset"], b["entry"]["checksum"] = 0, a["entry"]["checksum"]

    _edit(d, onto_a, relist=True)
    with pytest.raises(CheckpointCorruptError,
                       match=r"chunk \[0, 4096\) of tensors\.bin overlaps another"):
        open_flat(layout, layout.dir_of(1))
