"""Argument checks shared by the packages: a wrong type raises ``TypeError``, a wrong
value ``ValueError``, as torch does.

Scripts pass sizes, seeds and steps that came out of numpy or tensors, so wherever an
int is taken, anything ``operator.index`` accepts is one (``bool`` excepted). A base
module: it imports nothing from the package, so every package may use it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

__all__ = ["is_bool", "check_int", "check_bool"]


def is_bool(value: Any) -> bool:
    """True for ``bool`` and for one-element numpy / torch booleans (not ``bool`` subclasses)."""
    if isinstance(value, bool):
        return True
    if str(getattr(value, "dtype", None)) not in ("bool", "torch.bool"):
        return False
    return (value.numel() if isinstance(value, torch.Tensor) else getattr(value, "size", 1)) == 1


def check_int(name: str, value: Any) -> int:
    """``value`` as a Python int; numpy and torch integer scalars are accepted.

    Scripts pass epochs and world sizes that came out of numpy or tensors, so anything
    ``operator.index`` takes is an int here. ``bool`` is an int subclass, but
    ``rank=True`` is always a mistake; a float is refused rather than truncated.
    """
    if is_bool(value):
        raise TypeError(f"{name}={value!r}: expected an int, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        pass
    raise TypeError(
        f"{name}={value!r}: expected an int (numpy and torch integer scalars are "
        f"accepted), got {type(value).__name__}"
    )


def check_bool(name: str, value: Any, hint: str = "") -> bool:
    """``value`` as a Python bool; numpy and torch booleans are accepted."""
    if is_bool(value):
        return bool(value)
    raise TypeError(f"{name}={value!r}: expected a bool, got {type(value).__name__}{hint}")
