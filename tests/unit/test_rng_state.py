"""The generators' states a step-end mark keeps: numpy's is read from the MT19937
state's bytes when the generator was not used since the last read, and must always
equal what ``np.random.get_state()`` says."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from elastic_kit.state import raw_rng_state
from elastic_kit.state._train_state import _NumpyState, capture_rng_state, restore_rng_state


def _same(a: Any, b: Any) -> bool:
    return (a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2] == b[2] and a[3] == b[3]
            and (a[4] == b[4] or (np.isnan(a[4]) and np.isnan(b[4]))))


def test_numpy_state_matches_get_state_through_every_kind_of_use() -> None:
    cache = _NumpyState()
    np.random.seed(3)
    steps = [
        lambda: None,                                   # unused: the cached state
        lambda: np.random.rand(3),
        lambda: None,
        lambda: np.random.standard_normal(),            # leaves a cached normal
        lambda: None,                                   # has_gauss: read again
        lambda: np.random.standard_normal(),            # takes the cached normal only
        lambda: None,
        lambda: np.random.randint(0, 10, size=700),     # the key regenerated
        lambda: np.random.seed(11),                     # reseeded in place
        lambda: np.random.set_state(np.random.get_state()),
        lambda: None,
    ]
    for i, use in enumerate(steps):
        use()
        assert _same(cache.get(), np.random.get_state()), i
    assert cache._usable


def test_a_cached_state_is_reused_only_while_the_generator_is_untouched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _NumpyState()
    np.random.seed(5)
    first = cache.get()
    calls = []
    real = np.random.get_state
    monkeypatch.setattr(np.random, "get_state", lambda *a: (calls.append(1), real(*a))[1])
    assert cache.get() is first and not calls           # untouched: no get_state
    np.random.rand()
    assert _same(cache.get(), real()) and len(calls) == 1


def test_another_layout_falls_back_to_get_state(monkeypatch: pytest.MonkeyPatch) -> None:
    import elastic_kit.state._train_state as ts

    monkeypatch.setattr(ts, "_mt_bytes", lambda state: b"not the struct")
    cache = _NumpyState()
    np.random.seed(7)
    assert _same(cache.get(), np.random.get_state()) and not cache._usable
    np.random.standard_normal()
    assert _same(cache.get(), np.random.get_state())


def test_a_captured_state_restores_every_generator_bitwise() -> None:
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal()                         # a cached normal is part of it
    raw_rng_state()
    saved = capture_rng_state()
    want = (torch.rand(4), np.random.standard_normal(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    restore_rng_state(saved)
    got = (torch.rand(4), np.random.standard_normal(3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert got[2] == want[2]
