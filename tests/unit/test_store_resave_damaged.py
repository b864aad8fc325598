"""A step whose manifest does not validate (damage, a newer release's format) is
skipped at load; the next save of that step, which a job resumed from the step before
makes when it reaches it again, replaces the damage on every save path: a manifest
that does not validate is no other writer's commit. (The whole-state path is in the
store contract.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from elastic_kit.store import (
    MANIFEST_NAME, CheckpointStore, Layout, commit_flat, copy_tensors, hash_flat, map_file,
    open_flat, plan_flat, split_state, tensor_views,
)
from elastic_kit.store._sharded import save_sharded

_DAMAGE = {"bad_manifest": b'{"format": "elastic_kit.checkpoint/1", "step": ',
           "newer_format": b'{"format": "elastic_kit.checkpoint/99", "step": 2}'}


def _damage(fs: Any, step_dir: str, damage: str) -> None:
    fs.pipe_file(f"{step_dir}/{MANIFEST_NAME}", _DAMAGE[damage])


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_sharded_save_replaces_a_damaged_step(tmp_path: Path, where: str,
                                                damage: str) -> None:
    root = (str(tmp_path / "ck") if where == "local"
            else f"memory://ek-resave-{os.getpid()}-{tmp_path.name}")
    store = CheckpointStore(root, keep_last=None)

    def save(v: float, step: int) -> Any:
        return save_sharded(store._layout, {"w": torch.full((4,), v)}, step=step,
                            checksum="xxh3_128", metadata={}, rank=0, world_size=1,
                            gather=lambda m: [m], broadcast=lambda h: h)

    save(1.0, 1)
    save(0.0, 2)
    _damage(store.fs, store.list()[-1].path, damage)
    resumed = CheckpointStore(root, keep_last=None)
    assert resumed.load().step == 1
    assert save(2.0, 2) is not None
    loaded = CheckpointStore(root).load()
    assert loaded is not None and loaded.step == 2
    assert loaded.state["w"].tolist() == [2.0] * 4
    assert [(step, problem) for step, _, problem in CheckpointStore(root).verify()] == [
        (1, None), (2, None)]
    for s in (store, resumed):
        s.close()
    if where == "memory":
        store.fs.rm(store.root, recursive=True)


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_a_flat_commit_replaces_a_damaged_step(tmp_path: Path, damage: str) -> None:
    root = str(tmp_path / "store")
    layout = Layout(fsspec.filesystem("file"), root, url=root)

    def commit(v: float, slot: str) -> str:
        payload, items = split_state({"w": torch.full((1024,), v), "step": 2})
        plan = plan_flat(items, chunk_bytes=4096)
        mapped = map_file(str(tmp_path / slot), plan.size)
        copy_tensors([(view, t) for view, (_, t) in zip(tensor_views(mapped, plan), items)])
        d, _ = commit_flat(layout, step=2, flat_path=str(tmp_path / slot), plan=plan,
                           hashes=hash_flat(mapped, plan), payload=payload, metadata={})
        return d

    d = commit(0.0, "a.bin")
    _damage(layout.fs, d, damage)
    commit(2.0, "b.bin")
    opened = open_flat(layout, layout.dir_of(2))
    assert opened.state["w"].tolist() == [2.0] * 1024 and opened.state["step"] == 2
