"""Argument checks shared by the packages: a wrong type raises ``TypeError``, a wrong
value ``ValueError``, as torch does.

Scripts pass sizes, seeds and steps that came out of numpy or tensors, so wherever an
int is taken, anything ``operator.index`` accepts is one (``bool`` excepted). A base
module: it imports nothing from the package, so every package may use it.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch

__all__ = ["shown", "type_error", "is_bool", "check_int", "check_bool", "check_number"]


def shown(value: Any) -> str:
    """``value`` as an error message names it: the repr of a string, a number, a
    one-element tensor or None (cut short), only the type of anything else (never a
    whole state dict's repr)."""
    scalar = isinstance(value, torch.Tensor) and value.numel() == 1
    if (value is None or scalar or isinstance(value, (str, bytes, numbers.Number))
            or is_bool(value)):
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."
    return f"<{type(value).__module__}.{type(value).__qualname__} object>".replace(
        "<builtins.", "<")


def type_error(name: str, value: Any, expected: str) -> TypeError:
    """The ``TypeError`` for argument ``name``: its value, what was expected, its type."""
    return TypeError(f"{name}={shown(value)}: expected {expected}, got "
                     f"{type(value).__name__}")


def is_bool(value: Any) -> bool:
    """True for ``bool`` and for one-element numpy / torch booleans (not ``bool`` subclasses)."""
    if isinstance(value, bool):
        return True
    if str(getattr(value, "dtype", None)) not in ("bool", "torch.bool"):
        return False
    return (value.numel() if isinstance(value, torch.Tensor) else getattr(value, "size", 1)) == 1


def check_int(name: str, value: Any, *, minimum: int | None = None,
              allow_none: bool = False) -> Any:
    """``value`` as a Python int (``TypeError`` if it is none), at least ``minimum``
    (``ValueError`` if it is less); ``None`` passes through when ``allow_none``.

    Scripts pass epochs and world sizes that came out of numpy or tensors, so anything
    ``operator.index`` takes is an int here. ``bool`` is an int subclass, but
    ``rank=True`` is always a mistake; a float is refused rather than truncated.
    """
    if value is None and allow_none:
        return None
    expected = "an int" if minimum is None else f"an int >= {minimum}"
    if allow_none:
        expected = f"None or {expected}"
    if is_bool(value):
        raise TypeError(f"{name}={value!r}: expected {expected}, got a bool")
    try:
        number = int(operator.index(value))
    except TypeError:
        raise type_error(name, value, f"{expected} (numpy and torch integer scalars "
                                      f"are accepted)") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name}={number}: expected {expected}")
    return number


def check_bool(name: str, value: Any, hint: str = "") -> bool:
    """``value`` as a Python bool; numpy and torch booleans are accepted."""
    if is_bool(value):
        return bool(value)
    raise TypeError(f"{name}={shown(value)}: expected a bool, got {type(value).__name__}{hint}")


def check_number(name: str, value: Any, *, above: float | None = None,
                 at_least: float | None = None, allow_none: bool = False,
                 expected: str | None = None) -> Any:
    """``value`` as a finite float (``TypeError`` for a non-number or a bool),
    ``> above`` / ``>= at_least`` (``ValueError`` otherwise, and for inf or NaN);
    ``None`` passes through when ``allow_none``. ``expected``: the message's wording."""
    if value is None and allow_none:
        return None
    if expected is None:
        expected = "a finite number" + (f" > {above:g}" if above is not None else "") + (
            f" >= {at_least:g}" if at_least is not None else "")
        if allow_none:
            expected = f"None or {expected}"
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise type_error(name, value, expected)
    number = float(value)
    if (not math.isfinite(number) or (above is not None and not number > above)
            or (at_least is not None and not number >= at_least)):
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return number
