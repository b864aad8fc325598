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
