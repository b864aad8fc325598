"""The last step is written once, and the process does not end before it is: the
training thread abandoning the checkpointer (an exception, the interpreter's exit)
and another thread leaving for it (the heartbeat's on a silent peer, the SIGTERM
watcher's on an unheard signal) may race; whichever writes, the other waits."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import elastic_kit as ek


def _checkpointer(tmp_path: Path) -> ek.Checkpointer:
    model = torch.nn.Linear(4, 4)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return ek.Checkpointer(state, str(tmp_path / "durable"), handle_signals=False,
                           info=ek.DistInfo(run_id="job"))


def _held_write(ck: ek.Checkpointer, monkeypatch: pytest.MonkeyPatch,
                events: list[str]) -> threading.Event:
    """Make the last step's write wait for the returned event, then note it."""
    gate = threading.Event()

    def write(**_: object) -> None:
        assert gate.wait(30)
        events.append("written")
    monkeypatch.setattr(ck, "_snapshot_at_exit", write)
    return gate


def _until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_training_threads_abandon_waits_for_the_last_step_another_thread_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = _checkpointer(tmp_path)
    events: list[str] = []
    gate = _held_write(ck, monkeypatch, events)
    leaving = threading.Thread(target=ck._leave_alone,
                               args=("test", lambda: events.append("left")))
    leaving.start()
    _until(lambda: ck._hooks.closed)                # the leave's write has begun
    threading.Timer(0.3, gate.set).start()
    ck.abandon()                                    # an exception on the training thread
    assert events[:1] == ["written"]                # returned only after the write
    leaving.join(30)
    assert events == ["written", "left"]


def test_a_leave_waits_for_the_last_step_the_training_threads_abandon_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = _checkpointer(tmp_path)
    events: list[str] = []
    gate = _held_write(ck, monkeypatch, events)
    abandoning = threading.Thread(target=ck.abandon)
    abandoning.start()
    _until(lambda: ck._hooks.closed)                # abandon's write has begun
    threading.Timer(0.3, gate.set).start()
    ck._leave_alone("test", lambda: events.append("left"))
    assert events == ["written", "left"]            # the process ends after the write
    abandoning.join(30)
    assert not abandoning.is_alive()


def test_a_leave_right_after_abandon_closed_the_hooks_still_waits_for_its_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leave starts in the instant between abandon closing the hooks and saying
    it abandons: it must still wait for abandon's write, not end the process."""
    ck = _checkpointer(tmp_path)
    events: list[str] = []
    gate = _held_write(ck, monkeypatch, events)
    close = ck._hooks.close
    leaving: list[threading.Thread] = []

    def close_then_leave(**kw: bool) -> bool:
        closed = close(**kw)
        if closed and threading.current_thread() is threading.main_thread():
            t = threading.Thread(target=ck._leave_alone,
                                 args=("test", lambda: events.append("left")))
            t.start()
            leaving.append(t)
            t.join(1.0)                             # a leave here must not finish
        return closed

    monkeypatch.setattr(ck._hooks, "close", close_then_leave)
    threading.Timer(0.3, gate.set).start()
    ck.abandon()
    leaving[0].join(30)
    assert events == ["written", "left"]
