"""A peer dies in the middle of a step: the survivor's collective fails and, as it
exits, it writes the state of the last step every rank finished to its node's memory.
The restart redoes only the step in progress, and ends bitwise equal to a run that
was never interrupted (batch norm's statistics and dropout's generator included) with
every sample audited exactly once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.snapshot import snapshot_dir
from elastic_kit.testing import MultiProcessError, spawn_multi_process

pytestmark = pytest.mark.timeout(240)

N = 48
BATCH = 4  # per rank: 6 steps an epoch over two ranks
EPOCHS = 2


def _run(url: str, shm: str, die_at: int | None, where: str = "forward",
         snapshot_every: int = 100, freeze: bool = False,
         marks: str | None = None, validate: str | None = None) -> dict[str, Any]:
    """Train (two ranks, each its own "node"); rank 1 SIGKILLs itself in the step after
    ``die_at``, after its forward pass (``where="forward"``) or after its optimizer
    step (``where="optimizer"``: every step then sums the loss over the ranks after
    the optimizer's step, where rank 0 fails with its parameters already changed;
    ``where="unrecorded"``: rank 0 records the step, takes its snapshot, and fails in
    the next forward pass). ``freeze=True``: rank 1 SIGSTOPs itself there instead, as a
    frozen host: rank 0 waits in its collective until its heartbeat finds rank 1
    silent (1.5 s) and exits from the heartbeat's thread. ``marks``: a directory where
    rank 0 writes its pid and rank 1 a file ``frozen`` before it stops; the ranks then
    handle SIGTERM (for a test that sends rank 0 one while it waits). ``validate``: each
    epoch ends with a "validation" (an all-reduce) and then a per-epoch scheduler step,
    in the PyTorch ImageNet example's order; ``"die"``: rank 1 SIGKILLs itself in epoch
    0's validation, after the epoch's last step."""
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{os.environ['GROUP_RANK']}"
    if freeze:
        os.environ["ELASTIC_KIT_HEARTBEAT_TIMEOUT"] = "1.5"
    fail = signal.SIGSTOP if freeze else signal.SIGKILL
    torch.set_num_threads(1)
    info = ek.init_distributed()
    if marks is not None and info.rank == 0:
        Path(marks, "rank0.pid").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(),
                                      nn.Dropout(0.3), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if validate else None
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    sampler = ek.ElasticDistributedSampler(torch.utils.data.TensorDataset(xs, ys), seed=3)
    state = ek.TrainState(model, opt, scheduler=sched, sampler=sampler)
    with ek.Checkpointer(state, url, every_steps=1000, snapshot_every=snapshot_every,
                         audit=True, handle_signals=marks is not None) as ckpt:
        start = ckpt.restore()
        for epoch in range(start, EPOCHS):
            sampler.set_epoch(epoch)
            order = list(sampler)  # no DataLoader: its seed would draw from torch's generator
            for i in range(0, len(order), BATCH):
                idx = order[i:i + BATCH]
                dying = info.rank == 1 and state.step == die_at
                loss = nn.functional.mse_loss(model(xs[idx]), ys[idx])
                if dying and where == "forward":
                    if marks is not None:
                        Path(marks, "frozen").write_text("")
                    os.kill(os.getpid(), fail)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if dying and where == "unrecorded":
                    os.kill(os.getpid(), fail)
                if where == "optimizer":  # a script that sums the loss for its log
                    if dying:
                        os.kill(os.getpid(), fail)
                    torch.distributed.all_reduce(loss.detach())
                ckpt.step(len(idx))
            if sched is not None:
                if validate == "die" and epoch == 0 and info.rank == 1:
                    os.kill(os.getpid(), fail)
                torch.distributed.all_reduce(torch.zeros(1))  # the validation's sum
                sched.step()
            ckpt.end_epoch()
    return {"step": state.step, "history": state.history,
            "lr": None if sched is None else sched.get_last_lr(),
            "params": {k: v.numpy().copy()  # numpy: a tensor would be shared by descriptor
                       for k, v in ek.unwrap_model(model).state_dict().items()},
            "audit": [(a.epoch, a.count, a.ok) for _, a in sorted(state.audit.epochs.items())]}


def _steps(shm: Path, url: str, node: str) -> list[str]:
    d = Path(snapshot_dir(str(shm), "test", url)) / node
    return sorted(p.name for p in d.iterdir() if p.name.startswith("step-"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "shm").mkdir()
    return spawn_multi_process(2, _run, str(tmp / "ref"), str(tmp / "shm"), None,
                               local_world_size=1)[0]


def test_the_survivor_writes_the_last_finished_step_and_the_restart_redoes_only_the_next(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    url, shm = str(tmp_path / "run"), tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(MultiProcessError):
        spawn_multi_process(2, _run, url, str(shm), 8, local_world_size=1)
    assert _steps(shm, url, "node0") == ["step-000000000008"]   # no periodic one: every 100
    manifest = Path(snapshot_dir(str(shm), "test", url)) / "node0" / "step-000000000008"
    meta = json.loads((manifest / "manifest.json").read_text())["metadata"]
    assert meta["at_exit"] is True
    assert meta["audit_derived"] == [1, 0, 16]  # epoch 1's steps 7 and 8, 8 samples each
    out = spawn_multi_process(2, _run, url, str(shm), None, local_world_size=1)
    last = out[0]["history"][-1]
    assert last["restored_step"] == 8 and last["restored_from"] == "memory"
    assert out[0]["step"] == reference["step"] == EPOCHS * N // (2 * BATCH)
    assert out[0]["params"].keys() == reference["params"].keys()
    for k, v in reference["params"].items():
        np.testing.assert_array_equal(out[0]["params"][k], v, err_msg=k)
    assert out[0]["audit"] == [(0, N, True), (1, N, True)]


def test_no_snapshot_at_exit_between_an_epochs_last_step_and_its_end_epoch(
        tmp_path: Path) -> None:
    """A peer dies in the validation after an epoch's last step, before the script's
    per-epoch scheduler step and ``end_epoch()``: a state written there would resume at
    the next epoch with the scheduler an epoch behind (the script's end-of-epoch work is
    not redone), so none is; the restart redoes from an earlier state, exactly."""
    url, shm = str(tmp_path / "run"), tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(MultiProcessError):
        spawn_multi_process(2, _run, url, str(shm), None, "forward", 100, False, None, "die",
                            local_world_size=1)
    node0 = Path(snapshot_dir(str(shm), "test", url)) / "node0"
    assert not node0.is_dir() or _steps(shm, url, "node0") == []
    out = spawn_multi_process(2, _run, url, str(shm), None, "forward", 100, False, None, "ok",
                              local_world_size=1)
    assert out[0]["history"][-1]["restored_step"] is None  # nothing to restore: the start
    assert out[0]["step"] == EPOCHS * N // (2 * BATCH)
    assert out[0]["lr"] == [0.05 * 0.5 ** EPOCHS]  # one scheduler step per epoch
    assert out[0]["audit"] == [(0, N, True), (1, N, True)]


def test_no_snapshot_at_exit_once_the_optimizer_began_the_next_step(tmp_path: Path) -> None:
    """Rank 0 fails in a collective after its optimizer step changed the parameters,
    before the step was recorded: the state is no longer a step's, so nothing is
    written."""
    url, shm = str(tmp_path / "run"), tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(MultiProcessError):
        spawn_multi_process(2, _run, url, str(shm), 8, "optimizer", local_world_size=1)
    assert _steps(shm, url, "node0") == []


def test_a_snapshot_whose_audit_sum_the_dead_peer_never_joined_is_replaced(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """A snapshot every step: rank 1 dies after its optimizer step, before recording
    step 9; rank 0 records it and takes its snapshot, whose audit sum rank 1 never
    joins. The survivor's snapshot of step 9 replaces it (not the one of step 8)."""
    url, shm = str(tmp_path / "run"), tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(MultiProcessError):
        spawn_multi_process(2, _run, url, str(shm), 8, "unrecorded", 1, local_world_size=1)
    assert _steps(shm, url, "node0") == ["step-000000000009"]
    out = spawn_multi_process(2, _run, url, str(shm), None, "forward", 1, local_world_size=1)
    last = out[0]["history"][-1]
    assert last["restored_step"] == 9 and last["restored_from"] == "memory"
    for k, v in reference["params"].items():
        np.testing.assert_array_equal(out[0]["params"][k], v, err_msg=k)
    assert out[0]["audit"] == [(0, N, True), (1, N, True)]


@pytest.mark.parametrize("where,every,written", [("forward", 100, 8), ("unrecorded", 1, 9)])
def test_a_survivor_leaving_a_frozen_peer_behind_writes_the_last_finished_step(
        tmp_path: Path, reference: dict[str, Any], where: str, every: int, written: int) -> None:
    """Rank 1 freezes (SIGSTOP) in a step; rank 0 sits in a collective it never joins
    until the heartbeat ends rank 0's process. Before it ends, rank 0 writes the last
    step every rank finished, and gives up the audit sum of a snapshot the frozen peer
    never joined (``"unrecorded"``, a snapshot every step): a restart redoes only the
    step in progress, as after a peer's SIGKILL."""
    url, shm = str(tmp_path / "run"), tmp_path / "shm"
    shm.mkdir()
    with pytest.raises(RuntimeError, match=r"exit codes \{0: 75, 1: -9\}"):
        spawn_multi_process(2, _run, url, str(shm), 8, where, every, True, local_world_size=1)
    assert _steps(shm, url, "node0") == [f"step-{written:012d}"]
    manifest = Path(snapshot_dir(str(shm), "test", url)) / "node0" / f"step-{written:012d}"
    assert json.loads((manifest / "manifest.json").read_text())["metadata"]["at_exit"] is True
    out = spawn_multi_process(2, _run, url, str(shm), None, "forward", every, local_world_size=1)
    last = out[0]["history"][-1]
    assert last["restored_step"] == written and last["restored_from"] == "memory"
    for k, v in reference["params"].items():
        np.testing.assert_array_equal(out[0]["params"][k], v, err_msg=k)
    assert out[0]["audit"] == [(0, N, True), (1, N, True)]


def test_a_sigterm_unheard_in_a_hung_collective_still_writes_the_last_step(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """Both ranks on one node (no heartbeat between them); rank 1 freezes in a step and
    rank 0 waits in a collective that never returns, where Python cannot run its
    SIGTERM handler. torchrun's SIGTERM (sent here by the test) is still heard by the
    watcher thread: after its grace rank 0 writes the last step every rank finished
    and exits 143, before torchrun's SIGKILL would come; the restart redoes only the
    step in progress."""
    url, shm, marks = str(tmp_path / "run"), tmp_path / "shm", tmp_path / "marks"
    shm.mkdir(), marks.mkdir()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            spawn_multi_process(2, _run, url, str(shm), 8, "forward", 100, True, str(marks),
                                local_world_size=2, timeout=90)
        except BaseException as e:
            failed.append(e)

    group = threading.Thread(target=run)
    group.start()
    deadline = time.monotonic() + 90
    while not (marks / "frozen").exists() and group.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (marks / "frozen").exists(), failed
    time.sleep(1.0)  # rank 0 reaches the collective rank 1 never joins
    os.kill(int((marks / "rank0.pid").read_text()), signal.SIGTERM)
    group.join(120)
    assert not group.is_alive()
    assert len(failed) == 1 and "exit codes {0: 143, 1: -9}" in str(failed[0]), failed
    assert _steps(shm, url, "node0") == ["step-000000000008"]
    manifest = Path(snapshot_dir(str(shm), "test", url)) / "node0" / "step-000000000008"
    assert json.loads((manifest / "manifest.json").read_text())["metadata"]["at_exit"] is True
    out = spawn_multi_process(2, _run, url, str(shm), None, local_world_size=2)
    last = out[0]["history"][-1]
    assert last["restored_step"] == 8 and last["restored_from"] == "memory"
    for k, v in reference["params"].items():
        np.testing.assert_array_equal(out[0]["params"][k], v, err_msg=k)
    assert out[0]["audit"] == [(0, N, True), (1, N, True)]
