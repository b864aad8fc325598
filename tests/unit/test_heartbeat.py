"""Heartbeats: a silent peer is noticed, a beating or departed one never is, and no
other local user can forge beats or stall their reading (real loopback sockets)."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from typing import Any

import pytest

from elastic_kit.health import MAX_PENDING, Heartbeat, hello_mac
from elastic_kit.health._heartbeat import NONCE_BYTES

TOKEN, LABEL = b"k" * 32, "run|0"


class Silences:
    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []
        self.event = threading.Event()

    def __call__(self, rank: int, seconds: float) -> None:
        self.calls.append((rank, seconds))
        self.event.set()


def _pair(timeout_s: float, interval_s: float) -> tuple[Heartbeat, Heartbeat, Silences]:
    """Rank 1 watches rank 0; rank 0 beats to rank 1."""
    silences = Silences()
    watcher = Heartbeat(rank=1, send_to=None, watch=0, token=TOKEN, label=LABEL,
                        timeout_s=timeout_s, interval_s=interval_s, on_silent=silences,
                        host="127.0.0.1").start()
    beater = Heartbeat(rank=0, send_to=(1, watcher.address), watch=None, token=TOKEN,
                       label=LABEL, timeout_s=timeout_s, interval_s=interval_s,
                       host="127.0.0.1").start()
    return watcher, beater, silences


def _watcher(timeout_s: float, interval_s: float = 0.02) -> tuple[Heartbeat, Silences]:
    """Rank 1 watching rank 0 on loopback, and what it reports silent."""
    silences = Silences()
    watcher = Heartbeat(rank=1, send_to=None, watch=0, token=TOKEN, label=LABEL,
                        timeout_s=timeout_s, interval_s=interval_s, on_silent=silences,
                        host="127.0.0.1").start()
    return watcher, silences


def _hello(src: int, dst: int, nonce: bytes, token: bytes = TOKEN) -> bytes:
    return src.to_bytes(4, "big", signed=True) + hello_mac(token, LABEL, src, dst, nonce)


def _greeting(sock: socket.socket) -> bytes:
    """The nonce a watcher greets a new connection with."""
    out = b""
    while len(out) < NONCE_BYTES:
        chunk = sock.recv(NONCE_BYTES - len(out))
        assert chunk, "the watcher closed the connection before its greeting"
        out += chunk
    return out


def _authenticated(watcher: Heartbeat, then: bytes = b"", src: int = 0) -> socket.socket:
    """A connection to ``watcher`` that said rank ``src``'s hello (for its greeting),
    then ``then``."""
    sock = socket.create_connection(watcher.address)
    sock.settimeout(10.0)
    sock.sendall(_hello(src, 1, _greeting(sock)) + then)
    return sock


def test_a_beating_peer_is_never_silent_and_its_goodbye_ends_the_watch() -> None:
    watcher, beater, silences = _pair(timeout_s=1.0, interval_s=0.02)
    try:
        first = time.monotonic()
        time.sleep(1.2)  # longer than the timeout: beats keep arriving
        assert silences.calls == [] and watcher.silent is None
        assert watcher.last_beat > first
        beater.close()
        time.sleep(1.2)  # a goodbye is not silence
        assert watcher.said_bye and silences.calls == [] and not watcher.lost_connection
    finally:
        beater.close()
        watcher.close()


def test_a_peer_that_authenticates_then_goes_silent_is_reported_once() -> None:
    watcher, silences = _watcher(timeout_s=0.4)
    try:
        with _authenticated(watcher, b"..."):
            assert silences.event.wait(10.0)
            time.sleep(0.3)
        assert [rank for rank, _ in silences.calls] == [0] and watcher.silent == 0
        assert silences.calls[0][1] > 0.4
    finally:
        watcher.close()


def test_a_peer_that_never_connects_is_named_not_taken_for_silent(caplog: Any) -> None:
    """A flood of connections by another local user can keep a live peer's beater
    out from the start: it must not make the watcher's worker exit."""
    silences = Silences()
    with caplog.at_level(logging.WARNING, logger="elastic_kit.health._heartbeat"):
        watcher = Heartbeat(rank=1, send_to=None, watch=0, token=TOKEN, label=LABEL,
                            timeout_s=0.3, on_silent=silences, host="127.0.0.1").start()
        try:
            assert not silences.event.wait(2.0)  # over six timeouts
            assert watcher.silent is None and not watcher.heard
        finally:
            watcher.close()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "rank 0's heartbeat has not connected in" in warned[0]
    assert f"flooding port {watcher.address[1]}" in warned[0]


def test_a_flood_of_connections_before_the_beater_does_not_make_it_silent() -> None:
    """Connections that never say hello, made before the peer's beater connects and
    kept coming: the live peer is never taken for silent."""
    silences = Silences()
    watcher = Heartbeat(rank=1, send_to=None, watch=0, token=TOKEN, label=LABEL,
                        timeout_s=0.3, on_silent=silences, host="127.0.0.1").start()
    flood: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            try:
                flood.append(socket.create_connection(watcher.address, timeout=0.2))
            except OSError:
                pass
            if len(flood) > 200:
                flood.pop(0).close()
        assert not silences.event.is_set() and watcher.refused > 0
        beater = Heartbeat(rank=0, send_to=(1, watcher.address), watch=None, token=TOKEN,
                           label=LABEL, timeout_s=0.3, host="127.0.0.1").start()
        try:
            for _ in range(100):
                if watcher.heard:
                    break
                time.sleep(0.05)
            assert watcher.heard and not silences.event.wait(1.0)
        finally:
            beater.close()
    finally:
        for s in flood:
            s.close()
        watcher.close()


def test_a_connection_that_ends_without_goodbye_is_silence_from_its_end() -> None:
    """The peer's process died (its kernel closed the connection): the process group
    notices too, at once, unless this process was paused meanwhile and woke in a gloo
    send to the dead peer, which waits out gloo's timeout (minutes). One heartbeat
    timeout after the connection ended, the peer is silent."""
    silences = Silences()
    watcher = Heartbeat(rank=1, send_to=None, watch=0, token=TOKEN, label=LABEL,
                        timeout_s=0.6, interval_s=0.02, on_silent=silences,
                        host="127.0.0.1").start()
    try:
        with _authenticated(watcher, b"."):
            time.sleep(0.1)
        ended = time.monotonic()
        time.sleep(0.2)
        assert watcher.lost_connection and silences.calls == []  # within the timeout
        assert silences.event.wait(10.0)
        assert silences.calls[0][0] == 0 and time.monotonic() - ended >= 0.6
    finally:
        watcher.close()


@pytest.mark.parametrize("ended", [True, False], ids=["connection-ended", "silent"])
def test_the_default_exit_says_whether_the_peer_ended_or_went_silent(
        ended: bool, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """A peer that exited (for a frozen host of its own, say) ends its connection
    without a goodbye: the exit names that, not a frozen host (one frozen node of a
    ring was blamed as two)."""
    import elastic_kit.health._heartbeat as heartbeat

    exits: list[int] = []
    exited = threading.Event()
    monkeypatch.setattr(heartbeat, "exit_now", lambda code: (exits.append(code),
                                                             exited.set()))
    watcher = Heartbeat(rank=1, send_to=None, watch=0, token=TOKEN, label=LABEL,
                        timeout_s=0.4, interval_s=0.02, host="127.0.0.1")
    with caplog.at_level(logging.ERROR, logger="elastic_kit.health._heartbeat"):
        watcher.start()
        try:
            with _authenticated(watcher, b"."):
                if not ended:
                    assert exited.wait(10.0)
            assert exited.wait(10.0)
        finally:
            watcher.close()
    assert exits == [heartbeat.SILENT_PEER_EXIT_CODE]
    (said,) = [r.getMessage() for r in caplog.records]
    if ended:
        assert said.startswith("rank 0's heartbeat connection ended without a goodbye")
        assert "frozen" not in said
    else:
        assert said.startswith("no heartbeat from rank 0 for") and "frozen" in said


@pytest.mark.parametrize("hello", [
    lambda nonce: _hello(0, 1, nonce, token=b"w" * 32),   # another group's token
    lambda nonce: _hello(2, 1, nonce),                    # not the watched rank
    lambda nonce: _hello(0, 1, b"\0" * NONCE_BYTES),      # another connection's greeting
    lambda nonce: b"x" * 36,                              # noise
], ids=["wrong-token", "wrong-rank", "replayed", "noise"])
def test_a_forged_hello_is_refused_and_its_beats_do_not_count(hello: Any) -> None:
    silences = Silences()
    watcher = Heartbeat(rank=1, send_to=None, watch=0, token=TOKEN, label=LABEL,
                        timeout_s=0.5, interval_s=0.02, on_silent=silences,
                        host="127.0.0.1").start()
    try:
        with socket.create_connection(watcher.address) as forger:
            forger.sendall(hello(_greeting(forger)))
            deadline = time.monotonic() + 5.0
            while watcher.refused == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert watcher.refused == 1
            with pytest.raises(OSError):
                for _ in range(50):  # the watcher closed it: writes fail soon
                    forger.sendall(b"." * 1024)
                    time.sleep(0.01)
        # its hello and bytes were no beats: the peer was never heard
        assert not watcher.heard and watcher.silent is None and silences.calls == []
    finally:
        watcher.close()


def test_idle_connections_from_another_user_neither_stall_nor_hide_the_real_beats() -> None:
    watcher, beater, silences = _pair(timeout_s=1.5, interval_s=0.02)
    idle = []
    try:
        for _ in range(4 * MAX_PENDING):  # connect, send nothing, keep the socket open
            idle.append(socket.create_connection(watcher.address))
        mark = time.monotonic()
        time.sleep(1.7)
        assert silences.calls == [] and watcher.last_beat > mark + 1.0
        assert watcher.refused >= 3 * MAX_PENDING  # the flood was dropped, oldest first
    finally:
        for s in idle:
            s.close()
        beater.close()
        watcher.close()


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s=0"):
        Heartbeat(rank=0, send_to=None, watch=None, token=TOKEN, label=LABEL, timeout_s=0)


def test_a_watcher_that_was_paused_itself_does_not_blame_its_peer() -> None:
    # Holding the GIL pauses every thread of this process, the beater's and the
    # watcher's alike, as a stopped and resumed process (or a frozen and thawed host)
    # is paused: the watcher must not take its own pause for its peer's silence.
    watcher, beater, silences = _pair(timeout_s=0.6, interval_s=0.02)
    switch = sys.getswitchinterval()
    try:
        time.sleep(0.2)
        paused = time.monotonic()
        sys.setswitchinterval(10.0)  # no other thread gets the GIL before 10 s
        try:
            while time.monotonic() - paused < 1.0:  # 1 s of work that never lets it go
                sum(range(100_000))
        finally:
            sys.setswitchinterval(switch)
        assert time.monotonic() - paused > 0.6  # longer than the timeout
        time.sleep(0.4)
        assert silences.calls == [] and watcher.silent is None
    finally:
        beater.close()
        watcher.close()


def test_a_cut_connection_is_made_again_by_the_beater_and_watched_again() -> None:
    # The beater's side: a watcher that drops the connection (as it drops the oldest
    # of a flood) gets a new one with a new hello.
    with socket.create_server(("127.0.0.1", 0)) as server:
        beater = Heartbeat(rank=0, send_to=(1, server.getsockname()[:2]), watch=None,
                           token=TOKEN, label=LABEL, timeout_s=1.0, interval_s=0.02,
                           host="127.0.0.1").start()
        try:
            server.settimeout(10.0)
            hellos, wanted = [], []
            for i in range(2):
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(10.0)
                    nonce = bytes([i]) * NONCE_BYTES
                    conn.sendall(nonce)
                    got = b""
                    while len(got) < 36:
                        got += conn.recv(36 - len(got))
                    hellos.append(got)
                    wanted.append(_hello(0, 1, nonce))
            assert hellos == wanted
        finally:
            beater.close()
    # The watcher's side: a peer that came back is watched again (and its later
    # silence noticed), not forgotten as gone.
    watcher, silences = _watcher(timeout_s=0.4)
    try:
        with _authenticated(watcher, b".."):
            time.sleep(0.1)
        time.sleep(0.2)
        assert watcher.lost_connection
        with _authenticated(watcher, b".."):
            assert silences.event.wait(10.0)
        assert silences.calls[0][0] == 0 and not watcher.lost_connection
    finally:
        watcher.close()


def test_closing_wakes_the_watcher_instead_of_waiting_for_its_next_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker exiting for a restart closes its heartbeat, and the restart waits for
    # the exit: the watcher must leave its wait when told, not at its next tick.
    import elastic_kit.health._heartbeat as heartbeat

    monkeypatch.setattr(heartbeat, "_WATCH_TICK_S", 3600.0)
    watcher, beater, silences = _pair(timeout_s=3600.0, interval_s=3600.0)
    threads = watcher._threads + beater._threads
    try:
        time.sleep(0.2)  # both watchers are in their wait
        watcher.close()
        beater.close()
        assert [t.name for t in threads if t.is_alive()] == []
        assert silences.calls == []
    finally:
        watcher.close()
        beater.close()


def test_a_peer_that_said_goodbye_and_comes_back_is_watched_again() -> None:
    """A goodbye ends the watch of that connection only: the peer's next authenticated
    connection is watched, and its silence noticed."""
    watcher, silences = _watcher(timeout_s=0.4)
    try:
        with _authenticated(watcher, b"..x"):
            time.sleep(0.2)
        time.sleep(0.2)
        assert watcher.said_bye
        with _authenticated(watcher, b".."):
            assert silences.event.wait(10.0)          # back, then silent: noticed
        assert silences.calls[0][0] == 0 and not watcher.said_bye
    finally:
        watcher.close()


def test_addresses_other_nodes_cannot_reach_are_named() -> None:
    from elastic_kit.distributed import unreachable

    assert unreachable(["127.0.0.1", "127.0.0.1"]) is None          # one host: fine
    assert unreachable(["10.0.0.1", "10.0.0.2", "node-3"]) is None
    why = unreachable(["127.0.1.1", "10.0.0.2"])
    assert why is not None and "127.0.1.1" in why and "ELASTIC_KIT_SNAPSHOT_ADDR" in why
    assert "wildcard" in (unreachable(["0.0.0.0", "10.0.0.2"]) or "")
    assert "wildcard" in (unreachable(["::", "::"]) or "")
