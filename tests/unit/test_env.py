"""Numbers from environment variables: unset means the default, a bad or negative
value is refused naming the variable and what it must be."""

from __future__ import annotations

import pytest

from elastic_kit._env import non_negative_from_env
from elastic_kit.health import TIMEOUT_ENV, timeout_from_env

NAME = "ELASTIC_KIT_TEST_NUMBER"


def test_unset_or_empty_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert non_negative_from_env(NAME, int, "bytes", "0: off") is None
    monkeypatch.setenv(NAME, "")
    assert non_negative_from_env(NAME, int, "bytes", "0: off") is None


def test_values_convert_and_bad_ones_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "12")
    assert non_negative_from_env(NAME, int, "bytes", "0: off") == 12
    monkeypatch.setenv(NAME, "1.5")
    with pytest.raises(ValueError, match=rf"{NAME}='1.5' must be a whole number"):
        non_negative_from_env(NAME, int, "a whole number", "0: off")
    monkeypatch.setenv(NAME, "-2")
    with pytest.raises(ValueError, match=rf"{NAME}='-2' must be >= 0 \(0: off\)"):
        non_negative_from_env(NAME, int, "a whole number", "0: off")


def test_the_heartbeat_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert timeout_from_env(5.0) == 5.0
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert timeout_from_env(5.0) == 2.5
    monkeypatch.setenv(TIMEOUT_ENV, "0")
    assert timeout_from_env(5.0) is None
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="must be a number of seconds"):
        timeout_from_env(5.0)
