"""Sharded saves on two real gloo ranks where the ranks do not go through a save alike:
one rank slow, one rank failing before the save's first exchange, ranks holding
different sharded tensors. Every save either commits its own step's shards on every
rank or fails on every rank, and the group's collectives still pair up afterwards.

Each rank saves a (4, 2) DTensor sharded over dim 0 and filled with the step number,
so a committed step holds ``[step] * 4`` down its first column, whoever wrote it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_kit.testing import spawn_multi_process

pytestmark = pytest.mark.timeout(120)


def _state(mesh: Any, v: float) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"w": distribute_tensor(torch.full((4, 2), float(v)), mesh, [Shard(0)])}


def _outcome(fn: Any) -> str:
    try:
        fn()
        return "committed"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _columns(root: Path) -> dict[int, list[float]]:
    """Each committed step's first column, loaded whole in this process (newest first:
    each step is loaded once the newer ones are moved out of the way)."""
    import elastic_kit as ek

    out = {}
    while True:
        loaded = ek.CheckpointStore(str(root), keep_last=None).load()
        if loaded is None:
            return out
        out[loaded.step] = loaded.state["w"][:, 0].tolist()
        shutil.rmtree(root / f"step-{loaded.step:012d}")


# ---------------------------------------------------------------------- background saves
def _background_job(root: str, slow_rank_0: bool, unstageable_at: int | None) -> dict:
    """Four background saves (steps 1-4) with a 0.75 s exchange timeout: rank 0's first
    payload upload takes 2 s (``slow_rank_0``), or rank 1's state at step
    ``unstageable_at`` holds a value it cannot stage."""
    import time

    import fsspec
    from torch.distributed.device_mesh import init_device_mesh

    import elastic_kit as ek
    import elastic_kit.store._store as store_module
    from elastic_kit.testing import FaultFileSystem

    store_module.SHARDED_EXCHANGE_TIMEOUT = 0.75  # stands for the default, scaled down
    info = ek.init_distributed()
    mesh = init_device_mesh("cpu", (2,))
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    if slow_rank_0 and info.rank == 0:
        ffs.add("open", match="/state", mode="wb", before=lambda p: time.sleep(2.0))
    store = ek.CheckpointStore(root, filesystem=ffs, keep_last=None)
    saved, handles = {}, {}
    for step in (1, 2, 3, 4):
        state = _state(mesh, step)
        if step == unstageable_at and info.rank == 1:
            state["note"] = object()  # weights-only loading refuses it: staging fails
        try:
            handles[step] = store.save(state, step=step, blocking=False)
            saved[step] = "submitted"
        except Exception as e:
            saved[step] = f"{type(e).__name__}: {e}"
    committed = {step: _outcome(h.wait) for step, h in handles.items()}
    return {"saved": saved, "committed": committed,
            "closed": _outcome(store.close)}


def test_a_slow_rank_0_is_waited_for_and_every_step_holds_its_own_shards(tmp_path) -> None:
    root = tmp_path / "ck"
    got = spawn_multi_process(2, _background_job, str(root), True, None)
    for r in got:
        assert r["committed"] == {s: "committed" for s in (1, 2, 3, 4)}, r
        assert r["closed"] == "committed"
    assert _columns(root) == {s: [float(s)] * 4 for s in (4, 3, 2, 1)}


def test_a_save_one_rank_cannot_stage_fails_everywhere_and_the_next_holds_its_own_step(
        tmp_path) -> None:
    root = tmp_path / "ck"
    got = spawn_multi_process(2, _background_job, str(root), False, 2)
    assert got[1]["saved"][2].startswith("TypeError: ")  # raised by save() on that rank
    assert "rank 1 could not take part: TypeError" in got[0]["committed"][2]
    # rank 0 learns of it in the background: its next save raises it, as every
    # background save's error is raised by the next one, and fails on both ranks
    assert got[0]["saved"][3].startswith(
        f"SaveRefused: sharded checkpoint step 2 in {root} was not saved: rank 1")
    assert "rank 0 could not take part: SaveRefused" in got[1]["committed"][3]
    for r in got:
        assert r["committed"][1] == r["committed"][4] == "committed", r
        assert r["closed"] == "committed"
    # steps 2 and 3 were never committed; step 4 holds step 4's shards of both ranks
    assert _columns(root) == {4: [4.0] * 4, 1: [1.0] * 4}


# ---------------------------------------------------------------------- blocking saves
def _blocking_job(root: str, failing: str) -> dict:
    """Blocking saves of steps 1 and 2 where, at step 2, rank 0 alone knows of a second
    writer (``failing="conflict"``: its retention of step 1 saw another writer's
    commit) or rank 1 alone holds a value it cannot save (``failing="value"``); after
    each save the ranks all-reduce, as the Checkpointer does."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import elastic_kit as ek
    from elastic_kit.store._layout import Layout

    info = ek.init_distributed(timeout=timedelta(seconds=5))
    mesh = init_device_mesh("cpu", (2,))
    store = ek.CheckpointStore(root, keep_last=2)
    if failing == "conflict" and info.rank == 0:  # another job's process (its own run id)
        import fsspec
        import os

        run = os.environ["TORCHELASTIC_RUN_ID"]
        os.environ["TORCHELASTIC_RUN_ID"] = "another-job"
        try:
            Layout(fsspec.filesystem("file"), root, url=root, writer_id="f" * 32).commit(
                {"x": torch.zeros(1)}, step=0, checksum="xxh3_128", metadata={},
                world_size=1)
        finally:
            os.environ["TORCHELASTIC_RUN_ID"] = run
    out: dict[str, Any] = {}
    for step in (1, 2, 3):
        state = _state(mesh, step)
        if failing == "value" and step == 2 and info.rank == 1:
            state["note"] = object()
        out[f"save{step}"] = _outcome(lambda: store.save(state, step=step))
        total = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(total)
        out[f"sum{step}"] = total.item()
    _outcome(store.close)
    return out


def test_a_blocking_save_a_rank_alone_refuses_fails_on_every_rank_and_the_group_goes_on(
        tmp_path) -> None:
    root = tmp_path / "conflict"
    got = spawn_multi_process(2, _blocking_job, str(root), "conflict", timeout=60)
    assert got[0]["save1"] == got[1]["save1"] == "committed"
    for step in (2, 3):  # every later save refused, on both ranks together
        assert got[0][f"save{step}"].startswith("CheckpointConflictError: another job")
        assert got[1][f"save{step}"].startswith(
            f"SaveRefused: sharded checkpoint step {step} in {root} was not saved: "
            f"rank 0 could not take part: CheckpointConflictError")
    assert [r[f"sum{s}"] for r in got for s in (1, 2, 3)] == [3.0] * 6

    root = tmp_path / "value"
    got = spawn_multi_process(2, _blocking_job, str(root), "value", timeout=60)
    assert got[1]["save2"].startswith("TypeError: ")
    assert got[0]["save2"].startswith(
        f"SaveRefused: sharded checkpoint step 2 in {root} was not saved: rank 1 could "
        f"not take part: TypeError")
    for r in got:
        assert r["save1"] == r["save3"] == "committed"
        assert [r[f"sum{s}"] for s in (1, 2, 3)] == [3.0] * 3
    assert _columns(root) == {3: [3.0] * 4, 1: [1.0] * 4}


# ---------------------------------------------------------------------- different trees
def _stages_job(root: str) -> dict:
    """Pipeline-like state: each rank holds the DTensor of its own stage only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import elastic_kit as ek

    info = ek.init_distributed()
    stage_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    state = {"model": {f"layers.{info.rank}.weight": distribute_tensor(
        torch.full((4, 3), float(info.rank + 1)), stage_mesh, [Shard(0)])}, "step": 7}
    store = ek.CheckpointStore(root)
    raised = _outcome(lambda: store.save(state, step=1))
    return {"raised": raised, "steps": [i.step for i in store.list()]}


def test_ranks_holding_different_sharded_tensors_are_refused_on_every_rank(tmp_path) -> None:
    got = spawn_multi_process(2, _stages_job, str(tmp_path / "ck"))
    for r in got:
        assert r["raised"].startswith(
            "ValueError: sharded checkpoint step 1: rank 0 and rank 1 hold different "
            "sharded tensors (['model']['layers.0.weight'], ['model']['layers.1.weight'])")
        assert r["steps"] == []


# ---------------------------------------------------------------------- the job's store
def _groups_job(root: str, ports: list[int]) -> dict:
    """Two process groups in turn, with restart counts that differ between the ranks'
    agents (node 1 joined the job later: its agent counts from 0; node 0's counted a
    failure)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import elastic_kit as ek
    import elastic_kit.store._store as store_module
    from elastic_kit.distributed import group_id

    store_module.SHARDED_EXCHANGE_TIMEOUT = 0.75  # stands for the default, scaled down
    rank = int(os.environ["RANK"])
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(1 - rank)
    # each group's store is rank 0's, at its own port (as torchrun's with
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), not the harness's agent store
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    ids, committed = [], {}
    for group, port in enumerate(ports):
        os.environ["MASTER_PORT"] = str(port)
        ek.init_distributed()
        ids.append(group_id())
        assert group_id() == ids[-1]                     # agreed once per group
        mesh = init_device_mesh("cpu", (2,))
        store = ek.CheckpointStore(root, keep_last=None)
        step = 10 * group + 1
        handle = store.save(_state(mesh, step), step=step, blocking=False)
        committed[step] = _outcome(handle.wait)
        store.close()
        dist.barrier()
        ek.destroy_distributed()
    return {"ids": ids, "committed": committed}


def test_sharded_saves_pair_up_whatever_each_agent_counts_and_each_group_its_own_keys(
        tmp_path) -> None:
    from elastic_kit.testing import reserve_port

    root = tmp_path / "ck"
    with reserve_port() as a, reserve_port() as b:  # held while rank 0 hosts each group
        got = spawn_multi_process(2, _groups_job, str(root), [a.port, b.port])
    assert got[0]["ids"] == got[1]["ids"]
    assert len(set(got[0]["ids"])) == 2 and all(len(i) == 32 for i in got[0]["ids"])
    for r in got:
        assert r["committed"] == {1: "committed", 11: "committed"}, r
    assert _columns(root) == {11: [11.0] * 4, 1: [1.0] * 4}
