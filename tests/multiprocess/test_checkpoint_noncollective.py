"""Saving the way scripts call it: ``if rank == 0: save_checkpoint(...)`` inside DDP.

``save``/``wait``/``close`` are not collective: the writer writes and every other rank
returns at once, so a save on rank 0 only cannot pair with (or wait on) the DDP
gradient all-reduce of the other rank. ``load`` stays collective and says so when it
is called on some ranks only.
"""

from __future__ import annotations

import pathlib
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from elastic_kit.store import CheckpointStore, load_checkpoint, save_checkpoint
from elastic_kit.distributed import init_distributed, wrap_ddp
from elastic_kit.errors import CheckpointError
from elastic_kit.testing import spawn_multi_process


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, i: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randn(8, 4, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()  # DDP's gradient all-reduce
    opt.step()


def _snapshot(model: nn.Module) -> dict[str, list[Any]]:
    return {k: v.detach().clone().tolist() for k, v in model.state_dict().items()}


def _ddp_job(root: str) -> dict[str, Any]:
    info = init_distributed()
    torch.manual_seed(0)
    model = wrap_ddp(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store = CheckpointStore(pathlib.Path(root) / "store", keep_last=None)
    at: dict[int, dict[str, list[Any]]] = {}
    for i in range(1, 13):
        _train_step(model, opt, i, info.rank)
        at[i] = _snapshot(model.module)
        if i == 3 and info.rank == 0:  # torchvision's save_on_master, function form
            save_checkpoint(model.module, pathlib.Path(root) / "fn", step=3,
                            metadata={"epoch": 1})
        if i == 5 and info.rank == 0:  # blocking, rank 0 only
            store.save(model.module.state_dict(), step=5, metadata={"epoch": 1})
        if i == 7 and info.rank == 0:  # non-blocking, rank 0 only; waited later
            store.save(model.module.state_dict(), step=7, blocking=False,
                       metadata={"epoch": 2})
        if i == 9 and info.rank == 0:
            store.wait()
        if i == 10:  # every rank calls it: only rank 0 writes
            store.save(model.module.state_dict(), step=10, blocking=False,
                       metadata={"epoch": 3})
    store.wait()  # not collective: returns at once on rank 1
    loaded = store.load()  # collective
    fn_loaded = load_checkpoint(None, pathlib.Path(root) / "fn")
    store.close()
    return {"params": _snapshot(model.module), "at": at,
            "loaded": (loaded.step, loaded.epoch, loaded.world_size,
                       {k: v.tolist() for k, v in loaded.state.items()}),
            "fn": (fn_loaded.step, fn_loaded.epoch,
                   {k: v.tolist() for k, v in fn_loaded.state.items()}),
            "steps": [i.step for i in store.list()]}


def test_rank0_only_saves_inside_a_ddp_loop_keep_ranks_in_step_and_load_collectively(tmp_path):
    results = spawn_multi_process(2, _ddp_job, str(tmp_path), timeout=150)
    r0, r1 = results
    # DDP steps after the rank-0-only saves kept both replicas identical
    assert r0["params"] == r1["params"] == r0["at"][12]
    for r in results:
        step, epoch, world_size, state = r["loaded"]
        assert (step, epoch, world_size) == (10, 3, 2)
        assert state == r0["at"][10]  # the state of step 10, broadcast to every rank
        fn_step, fn_epoch, fn_state = r["fn"]
        assert (fn_step, fn_epoch) == (3, 1) and fn_state == r0["at"][3]
    assert r0["steps"] == [5, 7, 10]


def _load_on_rank0_only(root: str) -> str:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    info = init_distributed()
    kv = _get_default_store()
    if info.rank == 0:
        store = CheckpointStore(root, load_timeout=2.0)
        try:
            store.load()
            outcome = "loaded"
        except CheckpointError as e:
            outcome = str(e)
        kv.set("test/done", "1")
    else:  # busy elsewhere (no collective: it would wait out the collective timeout)
        kv.wait(["test/done"], timedelta(seconds=60))
        outcome = "waited"
    dist.barrier()  # the group still works: load ran no collective
    return outcome


def test_load_on_a_subset_of_ranks_fails_clearly_within_load_timeout(tmp_path):
    solo = CheckpointStore(str(tmp_path), info=__import__("elastic_kit").DistInfo())
    solo.save({"w": torch.ones(2)}, step=1)
    r0, r1 = spawn_multi_process(2, _load_on_rank0_only, str(tmp_path), timeout=120)
    assert r1 == "waited"
    assert r0.startswith("load() is collective: call it on every rank"), r0
    assert "load_timeout" in r0 and "only 1 of 2 ranks" in r0


def _load_on_rank0_only_in_a_group_torch_made(root: str) -> tuple[str, float]:
    """The script keeps torch's own init_process_group (no ek.init_distributed): rank
    0 loads alone while rank 1 goes on to its gradient all-reduce."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    outcome = "all-reduce only"
    if rank == 0:
        try:
            load_checkpoint(None, CheckpointStore(root, load_timeout=2.0))
            outcome = "loaded"
        except CheckpointError as e:
            outcome = str(e)
    grad = torch.full((3,), float(rank + 1))
    dist.all_reduce(grad)  # pairs with the peer's all-reduce, not with a load's collective
    dist.destroy_process_group()
    return outcome, grad[0].item()


def test_load_on_a_subset_of_ranks_runs_no_collective_in_a_group_torch_made(tmp_path):
    solo = CheckpointStore(str(tmp_path), info=__import__("elastic_kit").DistInfo())
    solo.save({"w": torch.ones(2)}, step=1)
    (r0, sum0), (r1, sum1) = spawn_multi_process(
        2, _load_on_rank0_only_in_a_group_torch_made, str(tmp_path), timeout=60)
    assert r0.startswith("load() is collective: call it on every rank"), r0
    assert "only 1 of 2 ranks" in r0 and r1 == "all-reduce only"
    assert sum0 == sum1 == 3.0


def _writer_failure_job(root: str) -> str:
    info = init_distributed()
    store = CheckpointStore(root)  # a file, not a directory: the write fails
    try:
        store.save({"w": torch.ones(2)}, step=1)
        return "returned"
    except NotADirectoryError as e:
        return f"raised {e}"


def test_a_failed_write_raises_on_the_writer_only(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    r0, r1 = spawn_multi_process(2, _writer_failure_job, str(tmp_path / "file"), timeout=120)
    assert r0.startswith("raised") and "is a file, expected a directory" in r0
    assert r1 == "returned"


def test_loaded_checkpoint_has_epoch_and_world_size_and_pathlike_urls_work(tmp_path):
    from elastic_kit.distributed import DistInfo

    store = CheckpointStore(tmp_path / "ck", info=DistInfo(world_size=1))
    store.save({"w": torch.ones(2)}, step=4, metadata={"epoch": 2})
    loaded = load_checkpoint(None, tmp_path / "ck")
    assert (loaded.step, loaded.epoch, loaded.world_size) == (4, 2, 1)
    assert loaded.path == str(tmp_path / "ck" / "step-000000000004")


@pytest.mark.parametrize("blocking", [True, False])
def test_non_writer_ranks_return_without_touching_storage(tmp_path, blocking):
    from elastic_kit.distributed import DistInfo

    store = CheckpointStore(tmp_path / "ck", info=DistInfo(rank=1, world_size=2))
    store.save({"w": torch.ones(2)}, step=1, blocking=blocking)
    store.wait()
    store.close()
    assert not (tmp_path / "ck").exists()
    with pytest.raises(TypeError, match="weights_only"):  # validated on every rank
        store.save({"x": object()}, step=2)
