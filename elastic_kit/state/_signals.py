"""SIGTERM handling: note the request, let the loop stop at a safe point.

On a group restart torchrun sends SIGTERM to every worker and SIGKILL 30 seconds
later. The handler only sets a flag; the loop finishes the current optimizer step,
agrees with every other rank that it is time to stop (so no rank is left waiting in
a collective), saves a checkpoint synchronously and exits non-zero.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

__all__ = ["TerminationFlag"]

log = logging.getLogger(__name__)


class TerminationFlag:
    """A flag set by SIGTERM (and optionally SIGINT), usable as a context manager.

    Args:
        signals: the signals to catch (default SIGTERM).

    Example::

        with TerminationFlag() as stop:
            for batch in loader:
                step(batch)
                if stop.is_set():
                    save(); raise SystemExit(143)

    Handlers are only installed in the main thread (Python allows nothing else);
    elsewhere the flag just never sets by itself. Previous handlers are restored on
    exit.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signals)
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.received: int | None = None
        self.received_at: float | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Nothing but bookkeeping here: the loop does the work at a safe point.
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        """Request a stop by hand (tests, or a user's own condition)."""
        if self.received_at is None:
            self.received_at = time.monotonic()
        self._event.set()

    def install(self) -> TerminationFlag:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM handler not installed")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> TerminationFlag:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
