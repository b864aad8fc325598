"""One background save at a time, with its failure kept for the caller.

A non-blocking save must not run collectives on its thread (they would interleave
with the training loop's collectives on the same process group), so the thread only
writes; the store does the collective bookkeeping on the caller's thread in
``save()`` / ``wait()``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

__all__ = ["BackgroundWriter"]

log = logging.getLogger(__name__)


class BackgroundWriter:
    """Runs one function at a time on a daemon thread and keeps its exception.

    Example::

        bw = BackgroundWriter("ckpt")
        bw.start(write, state)        # returns at once
        err = bw.join()               # None, or the exception write() raised
    """

    def __init__(self, name: str = "elastic-kit-save") -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_duration_s: float = 0.0

    @property
    def busy(self) -> bool:
        """True while a write is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start ``fn(*args)`` in the background; the previous one must be joined."""
        if self._thread is not None:
            raise RuntimeError("BackgroundWriter.start() while a write is in flight: join() first")

        def run() -> None:
            t0 = time.perf_counter()
            try:
                fn(*args)
            except BaseException as e:  # kept and re-raised on the caller's thread
                log.debug("background save failed: %r", e)
                self._error = e
            finally:
                self.last_duration_s = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()

    def join(self) -> BaseException | None:
        """Wait for the running write; return (and forget) its exception, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        return err
