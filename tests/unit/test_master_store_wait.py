"""A rank other than 0 waits for rank 0's store to listen before joining the group,
polling with connections of its own (torch's store client backs off for up to a
second once refused), through real sockets on loopback."""

from __future__ import annotations

import socket
from typing import Any, Iterator

import pytest

import elastic_kit as ek
from elastic_kit import distributed
from elastic_kit.testing import reserve_port


@pytest.fixture
def master(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, list[Any]]]:
    """A loopback port in MASTER_ADDR/MASTER_PORT, held for the test (nothing else may
    listen there), and the record of the probes' connection attempts (each one's
    outcome)."""
    with reserve_port() as held:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(held.port))
        yield held.port, []


def test_the_wait_ends_at_the_first_connection_the_store_accepts(
        master: tuple[int, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    port, attempts = master
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a store does
    connect = socket.create_connection

    def counted(address: Any, *args: Any, **kwargs: Any) -> Any:
        if len(attempts) == 3:  # the store comes up after three refused probes
            listener.bind(("127.0.0.1", port))
            listener.listen()
        try:
            conn = connect(address, *args, **kwargs)
        except OSError as e:
            attempts.append(type(e).__name__)
            raise
        attempts.append("connected")
        return conn

    monkeypatch.setattr(distributed.socket, "create_connection", counted)
    try:
        assert distributed._wait_for_master_store(60.0)
        assert attempts == ["ConnectionRefusedError"] * 3 + ["connected"]
        peer, _ = listener.accept()
        with peer:
            assert peer.recv(1) == b""  # the probe's connection, closed unused
    finally:
        listener.close()


def test_a_store_that_never_listens_ends_the_wait_at_its_budget(
        master: tuple[int, list[Any]]) -> None:
    assert not distributed._wait_for_master_store(0.05)


@pytest.mark.parametrize("env", [{"MASTER_ADDR": ""}, {"MASTER_PORT": "x29500"}])
def test_without_an_address_and_port_there_is_nothing_to_wait_for(
        master: tuple[int, list[Any]], monkeypatch: pytest.MonkeyPatch,
        env: dict[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(distributed.socket, "create_connection",
                        lambda *a, **k: pytest.fail("probed"))
    assert distributed._wait_for_master_store(60.0)


class _Joined(Exception):
    pass


@pytest.mark.parametrize("rank,waits", [("0", False), ("1", True), ("7", True)])
def test_every_rank_but_0_waits_for_the_store_before_joining(
        master: tuple[int, list[Any]], monkeypatch: pytest.MonkeyPatch, rank: str,
        waits: bool) -> None:
    calls: list[str] = []
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(distributed, "_wait_for_master_store",
                        lambda budget_s: calls.append(f"wait {budget_s:g}") or True)

    def join(**kwargs: Any) -> None:
        calls.append("join")
        raise _Joined

    monkeypatch.setattr(distributed.dist, "init_process_group", join)
    with pytest.raises(_Joined):
        ek.init_distributed(backend="gloo")
    assert calls == (["wait 30", "join"] if waits else ["join"])
