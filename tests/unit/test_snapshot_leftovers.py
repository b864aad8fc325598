"""What a worker killed in the middle of a snapshot's commit leaves in its snapshot
directory (a temporary directory, or a step without its manifest, each holding a whole
state's file) is removed by the next life of that directory's only writer, not after
the durable store's 600 s: in a crash loop each such kill added a state's size of
shared memory until the space check turned snapshots off."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import elastic_kit as ek
from elastic_kit.snapshot import SnapshotTier

MB = 1 << 20


def _tier(shm: str) -> SnapshotTier:
    return SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)


def _leftover(where: Path, name: str) -> Path:
    d = where / name
    d.mkdir(mode=0o700)
    (d / "tensors.bin").write_bytes(b"\0" * (4 * MB))
    return d


def test_a_killed_commits_leftovers_are_removed_by_the_next_life(shm: str) -> None:
    first = _tier(shm)
    state = {"model": {"w": torch.randn(256, 256)}}
    first.save(state, step=4, metadata={})
    assert first.wait(timeout=60) and first.written == [4]
    node = Path(first.write_dir)
    first.close(remove=False)
    # a predecessor SIGKILLed in its commit of step 6, and in its release of step 5
    tmp = _leftover(node, ".tmp-step-000000000006-0123456789abcdef-0badf00d")
    step5 = _leftover(node, "step-000000000005")

    second = _tier(shm)
    try:
        assert not tmp.exists()           # removed as the tier starts
        assert step5.exists()             # newer than the newest committed (4): kept...
        second.save(state, step=7, metadata={})
        assert second.wait(timeout=60) and second.written == [7]
        assert not step5.exists()         # ... until a newer step commits
        assert sorted(p.name for p in node.iterdir() if not p.name.startswith(".slot")) == [
            "step-000000000007"]
    finally:
        second.close(remove=True)
    assert not os.path.exists(node)
