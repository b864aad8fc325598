"""The shared argument checks (``elastic_kit._checks``): int-likes are ints, a bool
is not, a wrong type is a ``TypeError`` and a wrong value a ``ValueError``, and a
message names the value without printing a whole object."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from elastic_kit._checks import check_bool, check_int, check_number, shown


class Index:
    def __index__(self) -> int:
        return 7


@pytest.mark.parametrize("value, expected", [
    (3, 3), (np.int64(3), 3), (np.uint8(3), 3), (torch.tensor(3), 3), (Index(), 7),
])
def test_int_likes_are_ints(value: Any, expected: int) -> None:
    got = check_int("n", value)
    assert got == expected and type(got) is int


@pytest.mark.parametrize("value, error, fragment", [
    (True, TypeError, "n=True: expected an int >= 1, got a bool"),
    (np.bool_(True), TypeError, "got a bool"),
    ("3", TypeError, "n='3': expected an int >= 1 (numpy and torch integer scalars are "
                     "accepted), got str"),
    (3.0, TypeError, "n=3.0"),
    (None, TypeError, "n=None"),
    (0, ValueError, "n=0: expected an int >= 1"),
])
def test_what_is_not_an_int_or_too_small(value: Any, error: type[Exception],
                                         fragment: str) -> None:
    with pytest.raises(error) as caught:
        check_int("n", value, minimum=1)
    assert fragment in str(caught.value)


def test_none_passes_when_allowed_and_is_named_as_allowed() -> None:
    assert check_int("keep", None, allow_none=True) is None
    with pytest.raises(TypeError, match=r"keep='2': expected None or an int >= 1"):
        check_int("keep", "2", minimum=1, allow_none=True)


@pytest.mark.parametrize("value, error", [
    ("1", TypeError), (True, TypeError), ([1], TypeError),
    (0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
])
def test_numbers(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="^t="):
        check_number("t", value, above=0)


def test_a_number_comes_back_as_a_float() -> None:
    assert check_number("t", np.float64(2.5), above=0) == 2.5
    assert check_number("t", 3, at_least=3) == 3.0
    assert check_number("t", None, allow_none=True) is None


def test_bools() -> None:
    assert check_bool("b", np.bool_(False)) is False
    with pytest.raises(TypeError, match="b='no': expected a bool, got str"):
        check_bool("b", "no")


def test_an_object_is_named_by_its_type_not_its_repr() -> None:
    state = {"model": {"weight": torch.zeros(1000)}}
    assert shown(state) == "<dict object>"
    assert shown(torch.zeros(3)) == "<torch.Tensor object>"
    assert shown(torch.tensor(2.0)) == "tensor(2.)"  # a scalar is named by its value
    assert shown("x" * 200).endswith("...") and len(shown("x" * 200)) == 80
    assert shown(np.int64(4)) == repr(np.int64(4))
    with pytest.raises(TypeError) as caught:
        check_int("step", state)
    assert "step=<dict object>" in str(caught.value) and "weight" not in str(caught.value)
