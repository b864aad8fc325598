"""The watcher's polling thread and its close: a malformed reply is one failed read, a
close waits for no metadata service and lets no notice through afterwards, and a close
from another thread than the main one loses no signal handler."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Iterator

import pytest

from elastic_kit.health import PreemptionWatcher

_PREEMPTED = b"HTTP/1.0 200 OK\r\nContent-Length: 4\r\n\r\nTRUE"


class _RawMetadata:
    """A GCE metadata service on 127.0.0.1 that answers its n-th request with
    ``replies[n]`` (the last one from then on), each after ``delay_s``; :attr:`asked`
    is set at the first request."""

    def __init__(self, replies: list[bytes], *, delay_s: float = 0.0) -> None:
        self.replies = replies
        self.delay_s = delay_s
        self.answered = 0
        self.asked = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.recv(4096)
                self.asked.set()
                time.sleep(self.delay_s)
                reply = self.replies[min(self.answered, len(self.replies) - 1)]
                self.answered += 1  # before the client can read it
                try:
                    conn.sendall(reply)
                except OSError:
                    pass  # the client gave up

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def gce() -> Iterator[list[_RawMetadata]]:
    """The servers a test starts, closed after it."""
    servers: list[_RawMetadata] = []
    yield servers
    for s in servers:
        s.close()


@pytest.mark.parametrize("garbage", [
    b"NOT-HTTP garbage\r\n\r\n",                              # http.client.BadStatusLine
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nTR",  # IncompleteRead
])
def test_a_malformed_reply_is_one_failed_read_and_the_notice_still_comes(
        garbage: bytes, gce: list[_RawMetadata], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    server = _RawMetadata([garbage, _PREEMPTED])
    gce.append(server)
    monkeypatch.setenv("ELASTIC_KIT_METADATA_URL", server.url)
    notices: list[str] = []
    got = threading.Event()
    with caplog.at_level(logging.WARNING, logger="elastic_kit.health._preemption"):
        watcher = PreemptionWatcher(lambda what: (notices.append(what), got.set()),
                                    cloud="gce", signals=(), poll_s=0.02).start()
        try:
            assert got.wait(10.0)
        finally:
            watcher.close()
    assert notices == ["GCE: instance/preempted is TRUE"] and server.answered == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "(1 times)" in said[0] and "gce" in said[0]


def test_a_close_waits_for_no_metadata_service_and_no_notice_follows_it(
        gce: list[_RawMetadata], monkeypatch: pytest.MonkeyPatch) -> None:
    """A request in flight when the worker closes its watcher is answered 0.9 s later
    (within the request's 1 s timeout): the close does not wait for it, and its notice
    is never delivered."""
    server = _RawMetadata([_PREEMPTED], delay_s=0.9)
    gce.append(server)
    monkeypatch.setenv("ELASTIC_KIT_METADATA_URL", server.url)
    notices: list[str] = []
    watcher = PreemptionWatcher(notices.append, cloud="gce", signals=(), poll_s=0.02).start()
    assert server.asked.wait(10.0)
    t0 = time.monotonic()
    watcher.close()
    took = time.monotonic() - t0
    assert watcher._thread is not None
    watcher._thread.join(timeout=10.0)              # the reply came, the thread ended
    assert not watcher._thread.is_alive() and server.answered == 1
    assert took < 0.6
    assert notices == [] and watcher.notice is None


def _close_off_the_main_thread(watcher: PreemptionWatcher) -> None:
    closer = threading.Thread(target=watcher.close)
    closer.start()
    closer.join(timeout=10.0)
    assert not closer.is_alive()


def test_a_close_off_the_main_thread_keeps_the_handlers_for_the_main_threads_close() -> None:
    seen: list[int] = []

    def previous(signum: int, frame: object) -> None:
        seen.append(signum)

    before = signal.signal(signal.SIGUSR1, previous)
    try:
        notices: list[str] = []
        watcher = PreemptionWatcher(notices.append, cloud=None,
                                    signals=(signal.SIGUSR1,)).start()
        _close_off_the_main_thread(watcher)
        assert signal.getsignal(signal.SIGUSR1) == watcher._on_signal  # none could be set
        watcher.close()                                  # the main thread's
        assert signal.getsignal(signal.SIGUSR1) is previous
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert seen == [signal.SIGUSR1] and notices == [] and watcher.notice is None
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.parametrize("previous_is_a_handler", [True, False])
def test_a_signal_after_a_close_off_the_main_thread_is_no_notice_and_gets_the_previous_handler(
        previous_is_a_handler: bool) -> None:
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)

    previous = handler if previous_is_a_handler else signal.SIG_IGN
    before = signal.signal(signal.SIGUSR1, previous)
    try:
        notices: list[str] = []
        watcher = PreemptionWatcher(notices.append, cloud=None,
                                    signals=(signal.SIGUSR1,)).start()
        _close_off_the_main_thread(watcher)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert notices == [] and watcher.notice is None
        assert seen == ([signal.SIGUSR1] if previous_is_a_handler else [])
        assert signal.getsignal(signal.SIGUSR1) is previous  # restored by the signal
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert seen == ([signal.SIGUSR1] * 2 if previous_is_a_handler else [])
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_close_keeps_a_handler_the_script_set_since_and_one_that_chains_gets_through(
        ) -> None:
    got: list[str] = []
    notices: list[str] = []
    before = signal.signal(signal.SIGUSR1, lambda s, f: got.append("before"))
    try:
        watcher = PreemptionWatcher(notices.append, cloud=None,
                                    signals=(signal.SIGUSR1,)).start()
        chained = signal.getsignal(signal.SIGUSR1)

        def mine(signum: int, frame: object) -> None:
            got.append("mine")
            chained(signum, frame)  # type: ignore[operator]

        signal.signal(signal.SIGUSR1, mine)
        watcher.close()
        assert signal.getsignal(signal.SIGUSR1) is mine  # not put back to what was before
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
        assert got == ["mine", "before"] * 2 and notices == []
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_chain_to_a_replaced_default_does_nothing_and_leaves_the_scripts_handler() -> None:
    # the watcher replaced SIG_DFL, no function: a chain to it does what a chain to
    # SIG_DFL does without the watcher (nothing), and the script's handler stays
    sig = signal.SIGWINCH
    before = signal.signal(sig, signal.SIG_DFL)
    calls: list[int] = []
    try:
        watcher = PreemptionWatcher(lambda what: None, cloud=None, signals=(sig,)).start()
        chained = signal.getsignal(sig)

        def mine(signum: int, frame: object) -> None:
            calls.append(signum)
            chained(signum, frame)  # type: ignore[operator]

        signal.signal(sig, mine)
        watcher.close()
        for _ in range(3):
            os.kill(os.getpid(), sig)
            time.sleep(0.05)
        assert len(calls) == 3 and signal.getsignal(sig) is mine
    finally:
        signal.signal(sig, before)
