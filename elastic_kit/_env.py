"""Reading a non-negative number from an environment variable, with errors that name
the variable, its value and what was expected (the knobs a job sets for every worker
without touching the script)."""

from __future__ import annotations

import os
from typing import Callable, TypeVar

__all__ = ["non_negative_from_env"]

N = TypeVar("N", int, float)


def non_negative_from_env(name: str, convert: Callable[[str], N], what: str,
                          zero: str) -> N | None:
    """``$name`` converted with ``convert``; None when unset or empty.

    Raises:
        ValueError: the value does not convert (``what`` says what it must be: "a
            number of seconds") or is negative (``zero`` says what ``0`` means).
    """
    raw = os.environ.get(name, "")
    if raw == "":
        return None
    try:
        value = convert(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} must be {what}") from e
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0 ({zero})")
    return value
