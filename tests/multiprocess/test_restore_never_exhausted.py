"""A restore never hands the script an exhausted epoch.

Whatever order a script saves in (``save_at_epoch_end`` on or off, ``ckpt.save()``
before or after ``ckpt.end_epoch()``) and whichever tier the restore reads (this
node's memory, a peer node's, the durable store), at the same or another world size:
a group that stopped after an epoch's last step resumes at the next epoch, position
0, and a loop that calls ``next(iter(loader))`` first (the DDP tutorial's batch-size
probe) runs on. A snapshot and a durable checkpoint of the same step agree, or the
later state by ``(step, epoch, position)`` wins.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elastic_kit as ek
from elastic_kit.snapshot import snapshot_dir
from elastic_kit.testing import spawn_multi_process

N, BATCH, EPOCHS = 48, 4, 2
ORDERS = ("epoch_end", "save_after", "save_before")


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 5, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _life(url: str, shm: str, order: str, crash: str | None) -> dict[str, Any]:
    """The DDP tutorial's shape: probe the batch size with ``next(iter(loader))``, then
    train the epoch; save in ``order``. ``crash``: stop without closing after the first
    epoch's end (``"after_epoch"``) or right before its ``end_epoch`` (``"before_end"``).
    """
    node = os.environ.get("GROUP_RANK", "0")
    os.makedirs(shm, exist_ok=True)
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{node}"
    torch.set_num_threads(1)
    ek.init_distributed()
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ds = _dataset()
    sampler = ek.ElasticDistributedSampler(ds, seed=2)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler)
    crit = nn.CrossEntropyLoss(reduction="none")
    state = ek.TrainState(model, opt, sampler=sampler)
    snapshot_inside = order == "snapshot_inside"
    ckpt = ek.Checkpointer(state, url, audit=True, handle_signals=False, blocking=True,
                           save_at_epoch_end=order == "epoch_end",
                           snapshot_every=1000 if snapshot_inside else 1)
    start = ckpt.restore()
    restored = {"start": start, "sampler": (sampler.epoch, sampler.consumed),
                "from": ckpt.restored_from, "step": ckpt.restored_step}

    def stop() -> dict[str, Any]:
        if ckpt.snapshots is not None:  # a kill comes after the snapshot's stream here
            ckpt.snapshots.close(remove=False)
            torch.distributed.barrier()
        return {"crashed_at": state.step}

    for epoch in range(start, EPOCHS):
        sampler.set_epoch(epoch)
        probe = len(next(iter(loader))[0])  # StopIteration on an exhausted epoch
        assert probe == BATCH
        for x, y in loader:
            loss = (crit(model(x), y) * ckpt.sample_weights(len(x))).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(len(x))
        if snapshot_inside:  # a snapshot of the last step with the epoch still open
            ckpt.snapshot()
        if order == "save_before":
            ckpt.save()
        if crash == "before_end":
            return stop()
        ckpt.end_epoch()
        if order in ("save_after", "snapshot_inside"):
            ckpt.save()
        if crash == "after_epoch":
            return stop()
    ckpt.close()
    return {
        "restored": restored,
        "step": state.step,
        "params": [p.detach().numpy().copy() for p in ek.unwrap_model(model).parameters()],
        "audit": [(a.epoch, a.count, a.ok) for _, a in sorted(state.audit.epochs.items())],
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rank 0's result of an uninterrupted two-rank run."""
    tmp = tmp_path_factory.mktemp("reference")
    return spawn_multi_process(2, _life, str(tmp / "ref"), str(tmp / "shm"), "epoch_end",
                               None, local_world_size=1)[0]


def _forget(shm: str, url: str, tier: str) -> None:
    """Leave the restore only ``tier``: memory as it is, a peer's (rank 0's node lost
    its memory), or the store (every node lost it)."""
    run = snapshot_dir(shm, "test", url)
    if tier == "peer":
        shutil.rmtree(os.path.join(run, "node0"))
    elif tier == "store":
        shutil.rmtree(run)


def _check_resumed_at_next_epoch(out: dict[str, Any], tier: str, world: int,
                                 reference: dict[str, Any]) -> None:
    steps_2 = N // (BATCH * 2)
    assert out["restored"] == {"start": 1, "sampler": (1, 0), "from": tier, "step": steps_2}
    assert out["audit"] == [(0, N, True), (1, N, True)]
    assert out["step"] == steps_2 + -(-N // (BATCH * world))
    if world == 2:
        for a, b in zip(out["params"], reference["params"]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("tier", ["memory", "peer", "store"])
@pytest.mark.parametrize("order", ORDERS)
def test_a_group_stopped_after_an_epoch_resumes_at_the_next_epoch(
        tmp_path: Path, order: str, tier: str, world: int, reference: dict[str, Any]) -> None:
    url, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    crashed = spawn_multi_process(2, _life, url, shm, order, "after_epoch", local_world_size=1)
    assert crashed[0] == {"crashed_at": N // (BATCH * 2)}
    _forget(shm, url, tier)
    out = spawn_multi_process(world, _life, url, shm, order, None, local_world_size=1)
    _check_resumed_at_next_epoch(out[0], tier, world, reference)


@pytest.mark.parametrize("world", [2, 3])
def test_a_save_before_end_epoch_resumes_at_the_next_epoch(
        tmp_path: Path, world: int, reference: dict[str, Any]) -> None:
    """``ckpt.save()`` at the last step, then a stop before ``end_epoch``: the only
    state of that step is the exhausted epoch, and the restore closes it."""
    url, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    spawn_multi_process(2, _life, url, shm, "save_before", "before_end", local_world_size=1)
    out = spawn_multi_process(world, _life, url, shm, "save_before", None, local_world_size=1)
    _check_resumed_at_next_epoch(out[0], "store", world, reference)


def test_a_later_durable_state_of_the_same_step_wins_over_memory(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """A snapshot of the last step taken with the epoch open, and a durable save of
    the same step after ``end_epoch``: the durable state is the later one."""
    url, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    spawn_multi_process(2, _life, url, shm, "snapshot_inside", "after_epoch",
                        local_world_size=1)
    out = spawn_multi_process(2, _life, url, shm, "snapshot_inside", None, local_world_size=1)
    _check_resumed_at_next_epoch(out[0], "store", 2, reference)
