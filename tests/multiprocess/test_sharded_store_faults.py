"""Sharded checkpoints on two real gloo ranks meeting storage that changes or fails
under them: a load whose shard files are deleted mid-read by another job's retention,
a step whose shards prove corrupt (it must not count as verified), and an exchange
that fails after every rank wrote its shards (nothing of the save may stay behind).

Each rank saves a (4, 2) DTensor sharded over dim 0 and filled with the step number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from elastic_kit.testing import FaultFileSystem, spawn_multi_process

pytestmark = pytest.mark.timeout(120)


def _state(mesh: Any, v: float) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"w": distribute_tensor(torch.full((4, 2), float(v)), mesh, [Shard(0)])}


def _save_steps(root: str, steps: list[int]) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh

    import elastic_kit as ek

    ek.init_distributed()
    mesh = init_device_mesh("cpu", (2,))
    store = ek.CheckpointStore(root, keep_last=None)
    for step in steps:
        store.save(_state(mesh, step), step=step)
    store.close()
    return [i.step for i in store.list()]


# ---------------------------------------------------------------------- vanished shards
def test_a_load_whose_shards_are_deleted_mid_read_reads_the_store_again(tmp_path: Path) -> None:
    import elastic_kit as ek

    root = str(tmp_path / "ck")
    assert spawn_multi_process(2, _save_steps, root, [5])[0] == [5]

    def training_commits_step_6(path: str) -> None:
        trainer = ek.CheckpointStore(root, keep_last=1)
        trainer.save({"w": torch.full((4, 2), 6.0)}, step=6)
        trainer.close()  # its retention deleted step 5

    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("cat", match="shards-00001", before=training_commits_step_6)  # mid-load
    loaded = ek.CheckpointStore(root, filesystem=ffs).load()
    assert ffs.fired("cat") == 1
    assert loaded is not None and loaded.step == 6
    assert loaded.state["w"][:, 0].tolist() == [6.0] * 4


def test_one_not_found_for_a_shard_file_still_loads_the_newest_step(tmp_path: Path) -> None:
    # one 404 (a lagging gateway or cache) proves nothing: the file is looked for again
    import elastic_kit as ek

    root = tmp_path / "ck"
    spawn_multi_process(2, _save_steps, str(root), [5, 6])
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("cat", match="step-000000000006/shards-00001",
            error=FileNotFoundError(2, "404 Not Found"))
    loaded = ek.CheckpointStore(str(root), filesystem=ffs).load()
    assert ffs.fired("cat") == 1
    assert loaded is not None and loaded.step == 6
    assert loaded.state["w"][:, 0].tolist() == [6.0] * 4


def test_a_shard_file_gone_under_an_unchanged_manifest_is_damage_and_skipped(
        tmp_path: Path) -> None:
    # nothing saved or deleted the checkpoint: its missing file is damage (the step
    # before loads), not a read error that stops the load
    import elastic_kit as ek

    root = tmp_path / "ck"
    spawn_multi_process(2, _save_steps, str(root), [5, 6])
    gone = root / "step-000000000006" / "shards-00001.bin"
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("cat", match="step-000000000006/shards-00001", before=lambda p: gone.unlink())
    loaded = ek.CheckpointStore(str(root), filesystem=ffs).load()
    assert ffs.fired("cat") == 1
    assert loaded is not None and loaded.step == 5
    assert loaded.state["w"][:, 0].tolist() == [5.0] * 4


# ---------------------------------------------------------------------- corrupt shards
def _load_then_resave(root: str) -> dict:
    """Restore (the newest step's shards are corrupt), then save the restored step again
    (as a SIGTERM right after a restore does) with keep_last=2."""
    from torch.distributed.device_mesh import init_device_mesh

    import elastic_kit as ek

    ek.init_distributed()
    mesh = init_device_mesh("cpu", (2,))
    store = ek.CheckpointStore(root, keep_last=2)
    live = _state(mesh, 0)
    loaded = store.load(into=live)
    store.save(loaded.state, step=loaded.step)
    store.close()
    return {"loaded": loaded.step, "w": loaded.state["w"].full_tensor()[:, 0].tolist(),
            "steps": [i.step for i in store.list()]}


def test_a_step_whose_shards_prove_corrupt_does_not_count_towards_keep_last(
        tmp_path: Path) -> None:
    root = tmp_path / "ck"
    spawn_multi_process(2, _save_steps, str(root), [1, 2, 3])
    shard = root / "step-000000000003" / "shards-00001.bin"
    data = bytearray(shard.read_bytes())
    entry = json.loads((shard.parent / "manifest.json").read_text())["sharded"]["chunks"]
    offset = next(c["entry"]["offset"] for c in entry if c["file"] == shard.name)
    data[offset] ^= 0xFF  # a flipped bit in step 3's bytes: its size still matches
    shard.write_bytes(bytes(data))
    got = spawn_multi_process(2, _load_then_resave, str(root))
    for r in got:
        assert r["loaded"] == 2 and r["w"] == [2.0] * 4
        # keep_last=2 keeps two verified steps (1 and 2); corrupt step 3 is not one of
        # them, and stays as a step newer than any verified one
        assert r["steps"] == [1, 2, 3]


# ---------------------------------------------------------------------- failed exchange
def _exchange_dies_after_the_writes(root: str) -> dict:
    """A re-save of step 1 whose exchange of file entries fails on both ranks (a peer
    gone) after each rank wrote its shard file into the committed step directory."""
    from torch.distributed.device_mesh import init_device_mesh

    import elastic_kit as ek
    from elastic_kit.store._sharded import save_sharded

    info = ek.init_distributed()
    mesh = init_device_mesh("cpu", (2,))
    store = ek.CheckpointStore(root, keep_last=None)
    store.save(_state(mesh, 1), step=1)

    def gather(obj: Any) -> list[Any]:
        if "file" in obj:  # the file entries, after the writes
            raise RuntimeError("the exchange's peer died")
        return store._gather(obj)

    try:
        save_sharded(store._layout, _state(mesh, 2), step=1, checksum=store.checksum,
                     metadata={}, rank=info.rank, world_size=2, gather=gather,
                     broadcast=store._broadcast)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    store.close()
    return {"raised": raised}


def test_a_failed_exchange_leaves_no_rank_s_shard_file_behind(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    got = spawn_multi_process(2, _exchange_dies_after_the_writes, str(root))
    assert [r["raised"] for r in got] == ["the exchange's peer died"] * 2
    step = root / "step-000000000001"
    named = set(json.loads((step / "manifest.json").read_text())["files"])
    assert sorted(p.name for p in step.iterdir()) == sorted(named | {"manifest.json"})
    assert named == {"shards-00000.bin", "shards-00001.bin", "state.pt"}


# ---------------------------------------------------------------------- named failures
def _save_with_a_failing_shard_upload(root: str) -> str:
    import errno

    from torch.distributed.device_mesh import init_device_mesh

    import elastic_kit as ek

    info = ek.init_distributed()
    mesh = init_device_mesh("cpu", (2,))
    ffs = FaultFileSystem(fsspec.filesystem("file"))  # an object store's way of writing
    if info.rank == 1:
        ffs.add("close", match="step-000000000002/shards-00001",
                error=OSError(errno.EIO, "503 Slow Down"))
    store = ek.CheckpointStore(root, filesystem=ffs, keep_last=None)
    store.save(_state(mesh, 1), step=1)
    try:
        store.save(_state(mesh, 2), step=2)
        raised = ""
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    steps = [i.step for i in store.list()]
    store.close()
    return f"{steps} {raised}"


def test_a_failed_shard_upload_is_reported_on_every_rank_naming_the_file(
        tmp_path: Path) -> None:
    got = spawn_multi_process(2, _save_with_a_failing_shard_upload, str(tmp_path / "ck"))
    named = "OSError: [Errno 5] cannot write checkpoint file "
    assert got[0].startswith("[1] CheckpointError: sharded checkpoint step 2: rank 1 could "
                             "not write its shards: " + named), got[0]
    assert got[1].startswith("[1] " + named), got[1]  # the failed rank: its own error
    for out in got:
        assert "/step-000000000002/shards-00001" in out and out.endswith(": 503 Slow Down"), out
