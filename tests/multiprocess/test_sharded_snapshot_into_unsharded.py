"""A job that shards its model only at world size > 1 (``if info.world_size > 1:
fully_shard(model)``), run on two nodes with a snapshot every step, loses a node:
the survivor restarts at world size 1 with a plain model and restores the newest
step from the parts in its memory (its own and the lost node's replica), whole and
verified; parts that do not cover the state are passed over, with a note, and
never loaded in part. Grown back to two nodes, the sharded group restores the whole
snapshots its unsharded group wrote.

Nodes are simulated by ``local_world_size``: each "node" has its own snapshot
directory (``node<i>``); a lost node is its directory deleted.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_kit.snapshot import snapshot_dir
from elastic_kit.testing import spawn_multi_process
from tests.multiprocess.test_sharded_state import _full

pytestmark = pytest.mark.timeout(300)


def _job(url: str, shm: str, stop_at: int | None) -> dict[str, Any]:
    """Train (a snapshot every step, nothing durable) until ``stop_at``, then 'die'
    with the snapshots and their streams to the next node landed; without
    ``stop_at``, only restore. The model is sharded only at world size > 1."""
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{os.environ.get('GROUP_RANK', '0')}"
    torch.set_num_threads(1)
    import elastic_kit as ek

    info = ek.init_distributed()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 4),
                                torch.nn.Linear(4, 2))
    if info.world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ek.TrainState(model, opt)
    ckpt = ek.Checkpointer(state, url, every_steps=1000, handle_signals=False,
                           snapshot_every=1)
    ckpt.restore()
    if stop_at is None:
        tier = ckpt.snapshots
        out = {"restored": ckpt.restored_step, "from": ckpt.restored_from,
               "sharded": state.sharded, "ignored": list(tier.ignored) if tier else None,
               "full": _full(model, opt)}
        ckpt.close()
        return out
    g = torch.Generator().manual_seed(5)
    while state.step < stop_at:
        model(torch.randn(4, 5, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(4)
    full = _full(model, opt)
    tier = ckpt.snapshots
    assert tier is not None and tier.sharded == state.sharded == (info.world_size > 1)
    tier.close(remove=False)  # written, and streamed to the next node
    torch.distributed.barrier()  # the other ranks' streams are in too
    return {"stopped": state.step, "full": full}


@pytest.fixture()
def shm(tmp_path: Path) -> str:
    root = tmp_path / "shm"
    root.mkdir()
    return str(root)


def test_a_lone_unsharded_survivor_restores_the_parts_in_its_memory(
        tmp_path: Path, shm: str) -> None:
    url = str(tmp_path / "run")
    saved = spawn_multi_process(2, _job, url, shm, 7, local_world_size=1)[0]
    assert saved["stopped"] == 7
    shutil.rmtree(Path(snapshot_dir(shm, "test", url)) / "node1")  # node 1 is lost
    (out,) = spawn_multi_process(1, _job, url, shm, None, local_world_size=1)
    assert (out["restored"], out["from"], out["sharded"]) == (7, "memory", False)
    assert out["ignored"] == []
    # the same bytes, parameters and optimizer state alike (nothing was recomputed)
    assert out["full"] == saved["full"]


def test_parts_that_do_not_cover_the_state_are_passed_over_with_a_note(
        tmp_path: Path, shm: str) -> None:
    url = str(tmp_path / "run")
    spawn_multi_process(2, _job, url, shm, 7, local_world_size=1)
    run = Path(snapshot_dir(shm, "test", url))
    shutil.rmtree(run / "node1")
    shutil.rmtree(run / "node0" / "replicas")  # rank 1's part is nowhere now
    (fresh,) = spawn_multi_process(1, _job, str(tmp_path / "other"), shm, None,
                                   local_world_size=1)
    (out,) = spawn_multi_process(1, _job, url, shm, None, local_world_size=1)
    # nothing durable: a fresh start, the model as initialized, nothing in part
    assert (out["restored"], out["from"]) == (None, None)
    assert out["full"] == fresh["full"]
    assert len(out["ignored"]) == 1
    assert "snapshot step 7 in" in out["ignored"][0]
    assert "no node holds the part of rank(s) 1" in out["ignored"][0]


def test_a_sharded_group_restores_the_whole_snapshot_of_an_unsharded_one(
        tmp_path: Path, shm: str) -> None:
    """2 nodes (parts, step 4) -> 1 node (whole snapshots, restored from the parts,
    step 9) -> 2 nodes: the whole snapshot of step 9, newer than the parts, is given
    to both ranks, each taking its shards."""
    url = str(tmp_path / "run")
    spawn_multi_process(2, _job, url, shm, 4, local_world_size=1)
    shutil.rmtree(Path(snapshot_dir(shm, "test", url)) / "node1")
    (alone,) = spawn_multi_process(1, _job, url, shm, 9, local_world_size=1)
    assert alone["stopped"] == 9
    out = spawn_multi_process(2, _job, url, shm, None, local_world_size=1)[0]
    assert (out["restored"], out["from"], out["sharded"]) == (9, "memory", True)
    assert out["ignored"] == []
    assert out["full"] == alone["full"]
