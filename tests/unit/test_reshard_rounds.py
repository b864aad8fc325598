"""A resharding restore moves the ranges ranks ask of other nodes in rounds of bounded
bytes, the same rounds on every rank, each range once and in the order both ends list
their transfers."""

from __future__ import annotations

import pytest

from elastic_kit.snapshot import _shards
from elastic_kit.snapshot._shards import exchange_rounds


def _req(nbytes: int) -> tuple:
    return (0, 0, "model.w", [0], [1], nbytes)  # lister, saver, path, lo, hi, bytes


def test_rounds_hold_at_most_the_cap_and_every_range_once_in_order() -> None:
    asked = [[_req(10), _req(10), _req(10)], [], [_req(30), _req(5)], [_req(1)]]
    rounds = exchange_rounds(asked, 25)
    assert rounds == [[(0, 0), (0, 1)], [(0, 2)], [(2, 0)], [(2, 1), (3, 0)]]
    flat = [m for r in rounds for m in r]
    assert flat == [(q, i) for q, reqs in enumerate(asked) for i in range(len(reqs))]
    for r in rounds:  # a range over the cap goes alone
        total = sum(asked[q][i][-1] for q, i in r)
        assert total <= 25 or len(r) == 1


def test_no_ranges_no_rounds_and_a_large_cap_one_round() -> None:
    assert exchange_rounds([[], []], 10) == []
    assert exchange_rounds([[_req(10)], [_req(10)]], 1 << 30) == [[(0, 0), (1, 0)]]


def test_the_round_size_can_be_set_and_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_shards.ROUND_BYTES_ENV, raising=False)
    assert _shards.round_bytes() == _shards.ROUND_BYTES
    monkeypatch.setenv(_shards.ROUND_BYTES_ENV, "4096")
    assert _shards.round_bytes() == 4096
    for bad in ("0", "-1", "lots"):
        monkeypatch.setenv(_shards.ROUND_BYTES_ENV, bad)
        with pytest.raises(ValueError, match="ELASTIC_KIT_RESHARD_ROUND_BYTES"):
            _shards.round_bytes()
