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

from elastic_kit.snapshot import snapshot_dir
from elastic_kit.testing import spawn_multi_process
from tests.train_script import TrainConfig, train

N, BATCH, EPOCHS = 48, 4, 2
ORDERS = ("epoch_end", "save_after", "save_before")
#: The script's calls after an epoch's steps, per save order.
EPOCH_END = {"epoch_end": ("end_epoch",), "save_after": ("end_epoch", "save"),
             "save_before": ("save", "end_epoch"),
             "snapshot_inside": ("snapshot", "end_epoch", "save")}


def _life(url: str, shm: str, order: str, crash: str | None) -> TrainConfig:
    """The DDP tutorial's shape: probe the batch size with ``next(iter(loader))``, then
    train the epoch; save in ``order`` (``snapshot_inside``: a snapshot of the last step
    with the epoch still open, then a durable save after ``end_epoch``). ``crash``: stop
    without closing after the first epoch's end (``"after_epoch"``) or right before
    its ``end_epoch`` (``"before_end_epoch"``)."""
    Path(shm).mkdir(parents=True, exist_ok=True)
    return TrainConfig(url=url, dataset_size=N, target="x0", data_seed=5, sampler_seed=2,
                       epochs=EPOCHS, batch_size=BATCH, probe=True,
                       checkpoint={"audit": True, "blocking": True,
                                   "save_at_epoch_end": order == "epoch_end",
                                   "snapshot_every": 1000 if order == "snapshot_inside" else 1},
                       epoch_end=EPOCH_END[order], stop_at=crash, stop_how="kill",
                       snapshot_dir=shm)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rank 0's result of an uninterrupted two-rank run."""
    tmp = tmp_path_factory.mktemp("reference")
    return spawn_multi_process(2, train, _life(str(tmp / "ref"), str(tmp / "shm"), "epoch_end",
                                               None), local_world_size=1)[0]


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
    assert (out["start"], out["sampler_at_start"], out["restored_from"], out["restored"]) == (
        1, (1, 0), tier, steps_2)
    assert out["audit"] == [(0, N, True), (1, N, True)]
    assert out["step"] == steps_2 + -(-N // (BATCH * world))
    if world == 2:
        for a, b in zip(out["params"], reference["params"]):
            np.testing.assert_array_equal(a, b)


TIERS = ("memory", "peer", "store")


#: Every (order, tier) pair once; each order and each tier meets both world sizes.
@pytest.mark.parametrize("order,tier,world", [
    (order, tier, 2 + (i + j) % 2) for i, order in enumerate(ORDERS)
    for j, tier in enumerate(TIERS)])
def test_a_group_stopped_after_an_epoch_resumes_at_the_next_epoch(
        tmp_path: Path, order: str, tier: str, world: int, reference: dict[str, Any]) -> None:
    url, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    crashed = spawn_multi_process(2, train, _life(url, shm, order, "after_epoch"),
                                  local_world_size=1)
    assert crashed[0] == {"crashed_at": N // (BATCH * 2)}
    _forget(shm, url, tier)
    out = spawn_multi_process(world, train, _life(url, shm, order, None), local_world_size=1)
    _check_resumed_at_next_epoch(out[0], tier, world, reference)


@pytest.mark.parametrize("world", [2, 3])
def test_a_save_before_end_epoch_resumes_at_the_next_epoch(
        tmp_path: Path, world: int, reference: dict[str, Any]) -> None:
    """``ckpt.save()`` at the last step, then a stop before ``end_epoch``: the only
    state of that step is the exhausted epoch, and the restore closes it."""
    url, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    spawn_multi_process(2, train, _life(url, shm, "save_before", "before_end_epoch"),
                        local_world_size=1)
    out = spawn_multi_process(world, train, _life(url, shm, "save_before", None),
                              local_world_size=1)
    _check_resumed_at_next_epoch(out[0], "store", world, reference)


def test_a_later_durable_state_of_the_same_step_wins_over_memory(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """A snapshot of the last step taken with the epoch open, and a durable save of
    the same step after ``end_epoch``: the durable state is the later one."""
    url, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    spawn_multi_process(2, train, _life(url, shm, "snapshot_inside", "after_epoch"),
                        local_world_size=1)
    out = spawn_multi_process(2, train, _life(url, shm, "snapshot_inside", None),
                              local_world_size=1)
    _check_resumed_at_next_epoch(out[0], "store", 2, reference)
