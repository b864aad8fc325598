"""Rank-0 console output for what a training script would print itself, and leaving
the process at once with what was printed flushed."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = ["exit_now", "say"]


def say(logger: logging.Logger, msg: str, *args: Any) -> None:
    """Log ``msg % args`` at INFO, or print it to stderr when logging is unconfigured.

    Called on rank 0 only, for what a training script would print itself.
    """
    if logger.hasHandlers():
        logger.info(msg, *args)
    else:
        print(f"[elastic_kit] {msg % args if args else msg}", file=sys.stderr, flush=True)


def exit_now(code: int) -> None:
    """Flush stdout and stderr, then end the process with ``code`` at once
    (``os._exit``: no exit handlers, no waiting for other threads), for a thread
    that must end a process whose main thread will not return."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # exiting anyway
            pass
    os._exit(code)
