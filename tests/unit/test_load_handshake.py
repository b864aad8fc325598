"""load()'s handshake on a real TCPStore: every rank in the call, or a clear error on
each rank that is, within load_timeout; what an earlier group left under the same
keys (torchrun's shared store) never decides it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from elastic_kit.errors import CheckpointError
from elastic_kit.store._handshake import handshake

PREFIX = "elastic_kit/checkpoint/load/1"


@pytest.fixture()
def server() -> Any:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    yield store


def _client(server: Any) -> Any:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False,
                         timeout=timedelta(seconds=30))


def _group(server: Any, world_size: int, *, absent: tuple[int, ...] = (),
           delay: dict[int, float] | None = None,
           timeout: dict[int, float] | None = None) -> dict[int, tuple[str, float]]:
    """Run the handshake on one thread per present rank, each with a store client of
    its own; per rank: ("ok" or the error's message, seconds since the start when it
    returned)."""
    delay, timeout = delay or {}, timeout or {}
    out: dict[int, tuple[str, float]] = {}
    t0 = time.monotonic()

    def rank(r: int) -> None:
        kv = _client(server)
        time.sleep(delay.get(r, 0.0))
        try:
            handshake(kv, PREFIX, r, world_size, timeout.get(r, 10.0), "load() call #1 on x")
            out[r] = ("ok", time.monotonic() - t0)
        except CheckpointError as e:
            out[r] = (str(e), time.monotonic() - t0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)
               if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_every_rank_returns_once_all_are_in_the_call(server: Any) -> None:
    out = _group(server, 4, delay={0: 0.3, 2: 0.1})
    assert {r: v for r, (v, _) in out.items()} == {0: "ok", 1: "ok", 2: "ok", 3: "ok"}
    assert min(t for _, t in out.values()) >= 0.3  # nobody left before rank 0 came


def test_a_missing_rank_fails_every_rank_that_came_within_the_timeout(server: Any) -> None:
    out = _group(server, 3, absent=(2,), timeout={0: 0.5, 1: 5.0})
    message = "load() is collective: call it on every rank. Rank 0 waited 0.5 s"
    assert out[0][0].startswith(message) and "only 2 of 3 ranks" in out[0][0]
    assert out[1][0] == out[0][0]  # told by rank 0, not left to its own timeout
    assert out[1][1] < 4.0


def test_without_rank_0_the_others_fail_naming_it(server: Any) -> None:
    out = _group(server, 3, absent=(0,), timeout={1: 0.4, 2: 0.4})
    for r in (1, 2):
        assert out[r][0].startswith(f"load() is collective: call it on every rank. Rank {r} "
                                    "waited 0.4 s"), out
        assert "rank 0 did not answer" in out[r][0]


@pytest.mark.parametrize("earlier", ["completed", "gave up", "rank 0 absent"])
def test_what_an_earlier_group_left_under_the_same_keys_decides_nothing(
        server: Any, earlier: str) -> None:
    if earlier == "completed":        # its call #1 went through, then the group died
        first = _group(server, 3)
        assert {v for v, _ in first.values()} == {"ok"}
    elif earlier == "gave up":        # rank 2 never came: every key of an abort is left
        first = _group(server, 3, absent=(2,), timeout={0: 0.3, 1: 0.3})
        assert first[0][0] != "ok"
    else:                             # the others gave up on a rank 0 that never came
        first = _group(server, 3, absent=(0,), timeout={1: 0.3, 2: 0.3})
        assert first[1][0] != "ok"
    # the next group's rank 0 comes late: nobody may pass on the old keys before it
    out = _group(server, 3, delay={0: 0.5})
    assert {r: v for r, (v, _) in out.items()} == {0: "ok", 1: "ok", 2: "ok"}
    assert min(t for _, t in out.values()) >= 0.5
    # and one rank missing still fails them all
    out = _group(server, 3, absent=(1,), delay={0: 0.2}, timeout={0: 0.6, 2: 5.0})
    assert "only 2 of 3 ranks" in out[0][0] and out[2][0] == out[0][0]


def test_a_rank_that_gave_up_before_rank_0_came_fails_the_call_everywhere(
        server: Any) -> None:
    out = _group(server, 3, delay={0: 0.6}, timeout={0: 1.0, 1: 0.2, 2: 10.0})
    assert "Rank 1 waited 0.2 s" in out[1][0] and "rank 0 did not answer" in out[1][0]
    assert "only 2 of 3 ranks" in out[0][0]
    assert out[2][0] == out[0][0]


class _StallBeforeCommit:
    """A store client whose writes of a commit key wait first (rank 0 stalled by a
    GC pause, swapping or a slow store between answering and committing)."""

    def __init__(self, kv: Any, stall_s: float) -> None:
        self._kv, self._stall_s = kv, stall_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def set(self, key: str, value: str) -> None:
        if key.endswith("/commit"):
            time.sleep(self._stall_s)
        self._kv.set(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if key.endswith("/commit"):
            time.sleep(self._stall_s)
        return self._kv.compare_set(key, expected, desired)


def test_rank_0_stalled_past_the_timeout_before_committing_fails_every_rank_alike(
        server: Any) -> None:
    """The others stop waiting for the commit and decide it themselves; rank 0, late,
    reads their verdict instead of entering the collectives alone."""
    out: dict[int, str] = {}

    def rank(r: int) -> None:
        kv = _client(server)
        if r == 0:
            kv = _StallBeforeCommit(kv, 1.5)
        try:
            handshake(kv, PREFIX, r, 3, 0.5, "load() call #1 on x")
            out[r] = "ok"
        except CheckpointError as e:
            out[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out[0] != "ok" and "did not commit it within 0.5 s" in out[0], out
    assert out[1] == out[2] == out[0]


def test_a_store_whose_host_died_is_a_checkpoint_error_naming_the_call() -> None:
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=5))
    kv = dist.TCPStore("127.0.0.1", host.port, is_master=False,
                       timeout=timedelta(seconds=2))
    kv.set("x", "1")
    del host  # the server stops with its last reference
    with pytest.raises(CheckpointError, match=r"key-value store failed in load\(\) call #1 "
                                              r"on x \(rank 1\): Dist\w*Error"):
        handshake(kv, PREFIX, 1, 2, 5.0, "load() call #1 on x")
