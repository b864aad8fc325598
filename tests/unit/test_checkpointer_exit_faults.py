"""The checkpointer's exits under faults: a survivor writes the last step although a
non-blocking save of it was handed off (its writer may be the peer that died), a run
that ends where a restore from memory put it keeps that state, a SIGTERM's save is
made even after an earlier background save failed, and a planned leave's choice
between memory and the durable store is the same on every rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic_kit as ek
import elastic_kit.checkpointer._lifecycle as lifecycle
import elastic_kit.checkpointer._restore as restore_module


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 8)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _train(m: torch.nn.Module, o: torch.optim.Optimizer, ck: ek.Checkpointer, n: int) -> None:
    for _ in range(n):
        m(torch.randn(4, 8)).sum().backward()
        o.step()
        o.zero_grad()
        ck.step(4)


def test_a_survivor_writes_the_step_whose_background_save_its_writer_took_along(
        shm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This rank (local rank 0 of node 1) handed step 5's non-blocking save to the
    store, whose writer is rank 0 on another node; rank 0 dies with the write in flight:
    step 5 is not known committed, so the exit writes it to this node's memory."""
    store = str(tmp_path / "store")
    monkeypatch.setattr(restore_module, "agree_run_identity",
                        lambda st, info: st.run_identity())
    info = ek.DistInfo(rank=1, local_rank=0, world_size=2, node_rank=1, num_nodes=2)
    m, o = _model()
    ck = ek.Checkpointer(ek.TrainState(m, o), store, handle_signals=False, snapshot_every=100,
                         every_steps=5, info=info, heartbeat_timeout=0,
                         handle_preemption=False)
    ck.restore()
    _train(m, o, ck, 5)
    assert ck.last_saved_step == 5 and ek.CheckpointStore(store).list() == []
    m(torch.randn(4, 8)).sum().backward()   # step 6 in progress: the collective fails
    ck.abandon()
    assert ck.snapshots is not None and ck.snapshots.written == [5]


def test_a_run_that_ends_where_a_memory_restore_put_it_keeps_that_state(
        shm: str, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    m, o = _model()
    ck = ek.Checkpointer(ek.TrainState(m, o), store, handle_signals=False, snapshot_every=1)
    ck.restore()
    _train(m, o, ck, 3)
    assert ck.snapshots is not None and ck.snapshots.wait(timeout=60)
    ck.abandon()                             # killed in its final durable save
    m2, o2 = _model()
    again = ek.Checkpointer(ek.TrainState(m2, o2), store, handle_signals=False,
                            snapshot_every=1)
    again.restore()
    assert (again.restored_from, again.restored_step) == ("memory", 3)
    assert again.last_saved_step is None     # not in the durable store
    again.close()                            # nothing left to train
    m3, o3 = _model()
    third = ek.Checkpointer(ek.TrainState(m3, o3), store, handle_signals=False,
                            snapshot_every=1)
    third.restore()
    assert (third.restored_from, third.restored_step) == ("memory", 3)
    assert torch.equal(m3.weight, m.weight)
    third.save()
    third.close()                            # saved now: the snapshots go
    assert [i.step for i in ek.CheckpointStore(store).list()] == [3]


def test_a_sigterms_save_is_made_after_an_earlier_background_save_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    store = str(tmp_path / "store")
    m, o = _model()
    ck = ek.Checkpointer(ek.TrainState(m, o), store, every_steps=2, handle_signals=False,
                         heartbeat_timeout=0, handle_preemption=False)
    ck.restore()
    assert ck.store is not None
    write, calls = ck.store._write, [0]

    def flaky(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError("503 Service Unavailable")
        return write(*a, **k)

    monkeypatch.setattr(ck.store, "_write", flaky)
    _train(m, o, ck, 2)                      # step 2's save fails in the background
    ck.request_stop(restart=True)            # SIGTERM in step 3
    with pytest.raises(SystemExit) as stop:
        _train(m, o, ck, 1)
    assert stop.value.code == ck.exit_code
    assert [i.step for i in ek.CheckpointStore(store).list()] == [3]
    assert "503 Service Unavailable" in caplog.text


def test_a_planned_leave_chooses_like_every_other_rank(
        shm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a writing rank learns that snapshots failed; the choice between leaving the
    state in memory and a durable save (a collective) is agreed."""
    m, o = _model()
    ck = ek.Checkpointer(ek.TrainState(m, o), str(tmp_path / "store"), handle_signals=False,
                         snapshot_every=1)
    ck.restore()
    chosen: list[bool] = []

    def leave(info: Any, step: int, *, snapshot: Any, **_: Any) -> None:
        chosen.append(snapshot())

    monkeypatch.setattr(ck._departure, "leave", leave)
    monkeypatch.setattr(lifecycle, "is_dist_ready", lambda: True)
    monkeypatch.setattr(lifecycle, "all_reduce_max", lambda v: 1)  # another rank's are off
    ck._leave()
    monkeypatch.setattr(lifecycle, "all_reduce_max", lambda v: v)  # this rank's view only
    ck._leave()
    assert chosen == [False, True]
    monkeypatch.undo()
    ck.close()


def test_an_optimizer_given_after_the_restore_waits_for_a_background_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-hook that holds the optimizer's step until a non-blocking save copied
    the parameters moves to an optimizer the state is given later (a new phase)."""
    import threading

    torch.manual_seed(0)
    m = torch.nn.Linear(256, 256)
    state = ek.TrainState(m, torch.optim.SGD(m.parameters(), lr=0.1))
    ck = ek.Checkpointer(state, str(tmp_path / "s"), handle_signals=False,
                         heartbeat_timeout=0, handle_preemption=False)
    ck.restore()
    state.optimizer = later = torch.optim.SGD(m.parameters(), lr=1.0)
    assert ck.store is not None
    gate = threading.Event()
    stage = ck.store._stage_write_retain

    def held(*a: Any, **k: Any) -> Any:  # the copy waits on the writer thread a while
        gate.wait(30)
        return stage(*a, **k)

    monkeypatch.setattr(ck.store, "_stage_write_retain", held)
    threading.Timer(0.5, gate.set).start()
    before = m.weight.detach().clone()
    state.step = 1
    ck.save(blocking=False)
    m(torch.randn(4, 256)).sum().backward()
    later.step()                              # waits for the copy, then changes the weight
    ck.store.wait()
    saved = ek.CheckpointStore(str(tmp_path / "s")).load()
    assert saved is not None and torch.equal(saved.state["model"]["weight"], before)
    assert not torch.equal(m.weight.detach(), before)
    ck.close()


def test_a_close_that_fails_in_its_collective_still_lets_this_ranks_writes_finish(
        shm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``close()`` whose first collective fails (a peer died at the end of training)
    raises, and its ``with`` block does not abandon: the snapshot being written
    still commits and the writer threads stop, as when abandoning (they are daemon
    threads: the process's exit would otherwise cut the write off)."""
    m, o = _model()
    ck = ek.Checkpointer(ek.TrainState(m, o), str(tmp_path / "store"),
                         handle_signals=False, snapshot_every=1)
    ck.restore()
    _train(m, o, ck, 3)
    monkeypatch.setattr(lifecycle, "is_dist_ready", lambda: True)

    def peer_gone() -> Any:
        raise RuntimeError("connection closed by peer")

    monkeypatch.setattr(ck._cadence, "resolve", peer_gone)
    with pytest.raises(RuntimeError, match="closed by peer"):
        ck.close()
    assert ck.snapshots is not None and ck.snapshots.written[-1] == 3
    assert not [t.name for t in __import__("threading").enumerate()
                if t.name.startswith("ek-ckpt-snapshot")]
    ck.abandon()                             # the at-exit handler's call: nothing left
    ck.close()
