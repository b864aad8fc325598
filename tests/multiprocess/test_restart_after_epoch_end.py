"""ElasticLoop and a script's own loop after a state whose epoch has nothing left.

A save at an epoch's last step before the end-of-epoch work (``loop.save()`` from a
hook, or a SIGTERM acted on there) leaves the exhausted epoch as the newest state
when the group is lost during that work. The next group
resumes at the next epoch (the loop trains no empty epoch, and first runs the lost
epoch's end-of-epoch work). A group restarted after
training finished exits at once and never touches its data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic_kit.testing import spawn_multi_process
from tests.train_script import TrainConfig, train

N, BATCH, EPOCHS = 32, 4, 2
STEPS = N // (BATCH * 2)  # per epoch at world size 2


def _loop_life(url: str, stop_at_epoch_end: bool, forbidden: bool = False) -> TrainConfig:
    """ElasticLoop; ``stop_at_epoch_end``: a save from the step hook at epoch 0's last
    step, then the group is lost during its end-of-epoch work."""
    return TrainConfig(url=url, loop="elastic", dataset_size=N, target="x0", data_seed=5,
                       loop_seed=1, momentum=0.0, epochs=EPOCHS, global_batch_size=BATCH * 2,
                       micro_batch_size=BATCH,
                       checkpoint={"blocking": True, "handle_signals": False},
                       epoch_end=("save", "end_epoch") if stop_at_epoch_end else ("end_epoch",),
                       stop_at="before_end_epoch" if stop_at_epoch_end else None,
                       snapshot_dir="/nonexistent",  # the durable store only
                       forbid_data=forbidden)


def _own_life(url: str, stop_before_end: bool, forbidden: bool = False) -> TrainConfig:
    """A script's own loop that probes ``next(iter(loader))`` first (the DDP
    tutorial) and saves after each epoch's steps; ``stop_before_end``: lost after that
    save of the last epoch, before ``end_epoch``."""
    return TrainConfig(url=url, dataset_size=N, target="x0", data_seed=5, sampler_seed=1,
                       momentum=0.0, epochs=EPOCHS, batch_size=BATCH, probe=True,
                       checkpoint={"audit": True, "blocking": True, "save_at_epoch_end": False},
                       epoch_end=("save", "end_epoch"),
                       stop_at="before_end_epoch" if stop_before_end else None,
                       stop_epoch=EPOCHS - 1, stop_how="kill",
                       snapshot_dir="/nonexistent",  # the durable store only
                       forbid_data=forbidden)


def test_elastic_loop_resumes_a_closed_out_epoch_at_the_next_one(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    assert spawn_multi_process(2, train, _loop_life(url, True))[0] == {"crashed_at": STEPS}
    out = spawn_multi_process(2, train, _loop_life(url, False))[0]
    assert out["restored"] == STEPS
    # epoch 0 is not trained again: its end-of-epoch work (cut short by the loss)
    # runs first, with a summary of no steps, then epoch 1 trains
    assert out["epochs_trained"] == [(0, 0), (1, STEPS)]
    assert out["step"] == EPOCHS * STEPS
    assert out["audit"] == [(0, N, True), (1, N, True)]


def test_a_group_restarted_after_the_end_exits_without_reading_data(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    spawn_multi_process(2, train, _loop_life(url, False))
    out = spawn_multi_process(2, train, _loop_life(url, False, True))[0]
    assert (out["restored"], out["step"], out["epochs_trained"]) == (
        EPOCHS * STEPS, EPOCHS * STEPS, [])


def test_own_loop_restarted_after_an_unclosed_last_epoch_exits_without_reading_data(
        tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    lost = spawn_multi_process(2, train, _own_life(url, True))[0]
    assert lost == {"crashed_at": EPOCHS * STEPS}
    out = spawn_multi_process(2, train, _own_life(url, False, True))[0]
    assert out["start"] == EPOCHS and out["restored"] == out["step"] == EPOCHS * STEPS
    assert out["audit"] == [(0, N, True), (1, N, True)]


def _loop_peer_lost_in_epoch_end(url: str, shm: str, die: bool) -> dict[str, Any]:
    """ElasticLoop with snapshots, a per-epoch scheduler; ``die``: rank 1 SIGKILLs itself
    in epoch 0's ``on_epoch_end`` (a validation with a collective)."""
    import os
    import signal

    import torch
    from torch import nn

    import elastic_kit as ek
    from elastic_kit.loop import LoopConfig

    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{os.environ['GROUP_RANK']}"
    torch.set_num_threads(1)
    info = ek.init_distributed()
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=g),
                                          torch.randn(N, 1, generator=g))
    state = ek.TrainState(model, opt, scheduler=sched)
    ends: list[int] = []

    def on_epoch_end(_: Any, summary: Any) -> None:
        for group in opt.param_groups:  # a state change (a manual decay) before
            group["weight_decay"] += 0.01  # the validation's collective
        if die and summary.epoch == 0 and info.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        torch.distributed.all_reduce(torch.zeros(1))  # the validation's sum
        ends.append(summary.epoch)

    cfg = LoopConfig(epochs=EPOCHS, global_batch_size=BATCH * 2, micro_batch_size=BATCH,
                     progress_bar=False,
                     checkpoint=ek.CheckpointerConfig(every_steps=1000, snapshot_every=100))
    ek.ElasticLoop(state, data, loss_fn=lambda m, b: ((m(b[0]) - b[1]) ** 2).squeeze(1),
                   store=url, config=cfg, on_epoch_end=on_epoch_end).run()
    return {"restored": state.history[-1]["restored_step"],
            "from": state.history[-1].get("restored_from"), "ends": ends,
            "lr": sched.get_last_lr(), "step": state.step,
            "weight_decay": opt.param_groups[0]["weight_decay"]}


def test_a_peer_lost_in_on_epoch_end_applies_the_hooks_changes_once(tmp_path: Path) -> None:
    """The loop's state at an epoch's last step holds its scheduler step, and the loop
    runs the epoch's ``on_epoch_end`` after a restore of it; but once ``on_epoch_end``
    has begun, the state may hold its changes, which that second run would apply again:
    a rank that exits there writes no snapshot, and the restart redoes the epoch."""
    from elastic_kit.testing import MultiProcessError

    url, shm = str(tmp_path / "run"), tmp_path / "shm"
    shm.mkdir()
    try:
        spawn_multi_process(2, _loop_peer_lost_in_epoch_end, url, str(shm), True,
                            local_world_size=1)
    except MultiProcessError:
        pass  # rank 1 killed itself; rank 0's collective failed
    else:
        raise AssertionError("the first life should have failed")
    out = spawn_multi_process(2, _loop_peer_lost_in_epoch_end, url, str(shm), False,
                              local_world_size=1)[0]
    assert out["restored"] is None  # no snapshot (every 100 steps), none written at exit
    assert out["ends"] == [0, 1] and out["step"] == EPOCHS * STEPS
    assert out["lr"] == [0.05 * 0.5 ** EPOCHS]
    assert out["weight_decay"] == pytest.approx(0.02)  # once per epoch
