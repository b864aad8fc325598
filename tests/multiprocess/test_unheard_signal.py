"""The watcher of unheard SIGTERMs hears this process's signals only: a signal to a
forked child (a DataLoader worker inherits the interpreter's wakeup fd) never passes
for the parent's; and it keeps reading the wakeup fd after the first signal, so later
ones are not written into a pipe nobody reads. (A SIGTERM unheard in a hung
collective: see ``test_snapshot_of_the_survivor.py``.)"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from elastic_kit.state import TerminationFlag
from elastic_kit.testing import spawn_multi_process


def _signals() -> dict[str, Any]:
    unheard: list[Any] = []
    flag = TerminationFlag(on_unheard=lambda s: unheard.append(s), unheard_after_s=0.3)
    flag.install()
    pid = os.fork()
    if pid == 0:  # a forked worker: a SIGTERM of its own, then gone
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(1.0)
    flag.uninstall()
    return {"unheard": unheard, "set": flag.is_set()}


def test_a_forked_childs_signal_is_not_taken_for_the_parents() -> None:
    (out,) = spawn_multi_process(1, _signals)
    assert out == {"unheard": [], "set": False}


def _signals_after_the_first() -> dict[str, Any]:
    lost: list[str] = []
    sys.unraisablehook = lambda u: lost.append(repr(u.exc_value))
    unheard: list[Any] = []
    flag = TerminationFlag(on_unheard=lambda s: unheard.append(s), unheard_after_s=0.3)
    flag.install()
    for _ in range(3):  # heard each time: the main thread runs Python
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
    flag.uninstall()
    return {"unheard": unheard, "set": flag.is_set(), "lost": lost}


def test_signals_after_the_first_still_reach_a_reader() -> None:
    (out,) = spawn_multi_process(1, _signals_after_the_first)
    assert out == {"unheard": [], "set": True, "lost": []}
