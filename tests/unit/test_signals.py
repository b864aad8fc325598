"""TerminationFlag's watcher: a signal heard by the main thread but not acted on in
``unacted_after_s`` (the script is away from the code that acts on it) is handed to
``on_unheard`` as an unheard one is; acknowledging it in time stops the watch."""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic_kit.state import TerminationFlag


def _wait(seconds: float) -> None:
    """The main thread busy elsewhere (it runs the handler between bytecodes)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.02)


@pytest.mark.parametrize("acknowledge", [False, True])
def test_a_heard_signal_not_acted_on_is_handed_over(acknowledge: bool) -> None:
    called: list[tuple[int, bool]] = []
    flag = TerminationFlag(on_unheard=lambda s: called.append((s, flag.heard)),
                           unheard_after_s=0.3)
    flag.unacted_after_s = 0.6
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(0.2)
        assert flag.is_set() and flag.heard
        if acknowledge:
            flag.acknowledge()
        _wait(1.0)
    finally:
        flag.uninstall()
    assert called == ([] if acknowledge else [(signal.SIGTERM, True)])


def test_without_unacted_after_s_a_heard_signal_is_left_to_the_caller() -> None:
    called: list[int] = []
    flag = TerminationFlag(on_unheard=called.append, unheard_after_s=0.3)
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(1.0)
    finally:
        flag.uninstall()
    assert flag.heard and called == []


def test_a_checkpointer_arms_the_unacted_watch_for_twice_a_steps_wall_time(
        tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Armed at a fixed 15 s, a SIGTERM during a 20 s step (many micro-batches) ended
    the process before the step's end, where the stop's durable save would have come;
    before the first step (a torch.compile warm-up) it is not armed at all."""
    import types

    import torch
    from torch.utils.data import DataLoader

    import elastic_kit as ek
    from elastic_kit.checkpointer import _checkpointer

    clock = [1000.0]
    monkeypatch.setattr(_checkpointer, "time", types.SimpleNamespace(
        monotonic=lambda: clock[0], perf_counter=lambda: clock[0]))
    model = torch.nn.Linear(2, 1)
    sampler = ek.ElasticDistributedSampler(list(range(64)), num_replicas=1, rank=0)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler)
    ckpt = ek.Checkpointer(state, str(tmp_path / "ck"), snapshot_every=0,
                           info=ek.DistInfo())
    try:
        ckpt.restore()
        stop = ckpt._hooks.stop
        assert stop.unacted_after_s is None
        sampler.set_epoch(0)
        walls = iter([1.0, 20.0])
        for _ in DataLoader(list(range(64)), batch_size=4, sampler=sampler):
            ckpt.step(4)
            if stop.unacted_after_s is None:
                assert state.step == 1
            clock[0] += next(walls, 1.0)
            if state.step == 2:
                assert stop.unacted_after_s == 15.0  # a 1 s step: the floor
            if state.step == 3:
                assert stop.unacted_after_s == 40.0  # a 20 s step: twice it
                break
    finally:
        ckpt.close()


def test_an_acknowledged_flag_is_not_handed_over_even_unheard() -> None:
    """What runs after acknowledge(unheard=True) (close()'s final save, in a
    collective its peer joins a little later) is not cut short as an unheard signal's
    hung collective would be."""
    import threading

    called: list[int] = []
    flag = TerminationFlag(on_unheard=called.append, unheard_after_s=0.3)
    flag.install()
    try:
        flag.acknowledge(unheard=True)
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        # the main thread in a call that does not return to Python (as a collective):
        # the signal goes to another thread, and the handler waits for the main one
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            time.sleep(1.0)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _wait(0.1)
    finally:
        flag.uninstall()
    assert flag.heard and called == []


def test_on_received_runs_in_the_handler_while_the_main_thread_waits_on_a_future() -> None:
    """A training thread waiting in ``save()`` for the save in flight (a Future) runs
    the handler there: ``on_received`` is what can end that wait (it hurries the save,
    whose dead peer would hold it past torchrun's grace); it is called once, for the
    first signal, and an exception in it does not reach the interrupted code."""
    from concurrent.futures import Future

    calls: list[int] = []
    waited: Future[str] = Future()

    def received(signum: int) -> None:
        calls.append(signum)
        waited.set_result("ended by the signal")
        raise RuntimeError("must not reach the interrupted wait")

    flag = TerminationFlag(on_received=received)
    flag.install()
    try:
        # the signal comes while the main thread sits in the Future's wait
        import threading
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert waited.result(timeout=30) == "ended by the signal"
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(0.2)
    finally:
        flag.uninstall()
    assert calls == [signal.SIGTERM] and flag.received == signal.SIGTERM


def test_a_signal_that_went_to_a_handler_set_since_is_not_handed_over(caplog) -> None:  # type: ignore[no-untyped-def]
    """A script that sets its own SIGTERM handler after the checkpointer's (to clean up
    in its own way) gets the signal; the watcher, which never sees the flag's handler
    run, must not take the main thread for stuck and end the process."""
    called: list[int] = []
    got: list[int] = []
    flag = TerminationFlag(on_unheard=called.append, unheard_after_s=0.3)
    flag.install()
    previous = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(0.8)
    finally:
        signal.signal(signal.SIGTERM, previous)
        flag.uninstall()
    assert got == [signal.SIGTERM] and not flag.heard and called == []
    assert any("went to a handler set after the checkpointer's" in r.getMessage()
               for r in caplog.records)


def test_uninstall_keeps_a_handler_the_script_set_since_and_one_that_chains_gets_through(
        ) -> None:
    """The script's handler set after the flag's stays at uninstall; when it chains to
    the one it replaced (the flag's), the signal goes on to what the flag replaced
    when that is a handler (here one of the script's), as the chain would have without
    the flag, never into a flag nobody reads."""
    got: list[str] = []
    before = signal.signal(signal.SIGTERM, lambda s, f: got.append("before"))
    try:
        flag = TerminationFlag(unheard_after_s=0.3)
        flag.install()
        chained = flag._handle

        def mine(s: int, f: object) -> None:
            got.append("mine")
            chained(s, f)  # type: ignore[arg-type]

        signal.signal(signal.SIGTERM, mine)
        flag.uninstall()
        assert signal.getsignal(signal.SIGTERM) is mine  # not put back to what was before
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(0.1)
        assert got == ["mine", "before"] and flag.received is None
        flag.install()  # installed again: its own handler once more
        flag.uninstall()
        assert signal.getsignal(signal.SIGTERM) is mine
        os.kill(os.getpid(), signal.SIGTERM)  # mine still chains here: passed on again
        _wait(0.1)
        assert got == ["mine", "before"] * 2 and flag.received is None
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_flag_put_back_after_uninstall_hands_the_signal_to_what_it_replaced() -> None:
    """Three ways the process's handler is an uninstalled flag's again: the script's
    handler puts back the one it replaced and raises the signal again; a second flag,
    installed over the first and removed after it, puts the first one back; a flag
    installed twice (restore() called twice) took itself for what it replaced. The
    signal must go where it would without the flags (here a handler of the script's;
    the default would end the process), and that handler be the process's again."""
    got: list[str] = []
    before = signal.signal(signal.SIGTERM, lambda s, f: got.append("before"))
    try:
        # the script's handler restores the one it replaced and raises again
        flag = TerminationFlag(unheard_after_s=0.3).install()
        old = signal.getsignal(signal.SIGTERM)

        def reraise(s: int, f: object) -> None:
            got.append("reraise")
            signal.signal(s, old)
            os.kill(os.getpid(), s)

        signal.signal(signal.SIGTERM, reraise)
        flag.uninstall()
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(0.1)
        assert got == ["reraise", "before"] and flag.received is None
        assert signal.getsignal(signal.SIGTERM) != flag._handle  # bound: == compares
        # two flags, removed first-installed first
        got.clear()
        signal.signal(signal.SIGTERM, lambda s, f: got.append("before"))
        first, second = TerminationFlag().install(), TerminationFlag().install()
        first.uninstall()
        second.uninstall()
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(0.1)
        assert got == ["before"] and first.received is None and second.received is None
        assert all(signal.getsignal(signal.SIGTERM) != f._handle for f in (first, second))
        # installed twice, then removed
        mine = signal.getsignal(signal.SIGTERM)
        twice = TerminationFlag()
        twice.install()
        twice.install()
        twice.uninstall()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_flag_used_again_passes_the_signal_to_what_it_replaced_the_second_time() -> None:
    """A flag installed and removed cleanly, then installed again over the script's
    handler: a signal that comes to it after the second removal goes to that handler,
    not to what the flag replaced the first time."""
    got: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    try:
        flag = TerminationFlag()
        with flag:
            pass
        signal.signal(signal.SIGTERM, lambda s, f: got.append("mine"))
        flag.install()
        other = TerminationFlag().install()  # over it, removed after it
        flag.uninstall()
        other.uninstall()
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(0.1)
        assert got == ["mine"] and flag.received is None
    finally:
        signal.signal(signal.SIGTERM, before)
