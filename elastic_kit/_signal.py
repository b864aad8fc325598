"""Passing a signal on to the disposition a handler of the library replaced.

A base module (it imports nothing of the package): the stop signals' flag
(:mod:`elastic_kit.state`) and the preemption watcher (:mod:`elastic_kit.health`) both
hand a signal on once they are closed, when the script's own handler, set after theirs
and kept, chains to theirs.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any

__all__ = ["deliver"]


def deliver(signum: int, frame: FrameType | None, handler: Any) -> None:
    """Give signal ``signum`` what ``handler`` (a disposition ``signal.signal``
    returned; None for one not set from Python) does with it: call it, ignore it
    (``SIG_IGN``), or take the default action (``SIG_DFL`` or None: the default is
    restored and the signal raised again, which for the stop and notice signals ends
    the process, as it would have without the library; nothing for a signal whose
    default is to be ignored)."""
    if handler is signal.SIG_IGN:
        return
    if handler is signal.SIG_DFL or handler is None:
        if signum in _IGNORED_BY_DEFAULT:
            return  # nothing to do, and the script's handler must stay
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    handler(signum, frame)


#: Signals whose default action is to do nothing.
_IGNORED_BY_DEFAULT = frozenset(
    getattr(signal, name) for name in ("SIGCHLD", "SIGURG", "SIGWINCH", "SIGCONT")
    if hasattr(signal, name))
