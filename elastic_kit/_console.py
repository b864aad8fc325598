"""Rank-0 console output for what a training script would print itself."""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["say"]


def say(logger: logging.Logger, msg: str, *args: Any) -> None:
    """Log ``msg % args`` at INFO, or print it to stderr when logging is unconfigured.

    Called on rank 0 only, for what a training script would print itself.
    """
    if logger.hasHandlers():
        logger.info(msg, *args)
    else:
        print(f"[elastic_kit] {msg % args if args else msg}", file=sys.stderr, flush=True)
