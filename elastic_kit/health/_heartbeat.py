"""Heartbeats between nodes: a frozen or unreachable host noticed in seconds.

A host that stops answering without resetting its sockets (a frozen VM, a kernel
hang, a network partition, a SIGSTOPped process tree) leaves its peers waiting in
their collective until the process group's timeout, minutes; a killed process costs
seconds only because its kernel resets its connections. So in a group of two nodes
or more every worker keeps one TCP connection to the worker of the same local rank
on the next node (ring order of the node ranks) and writes one byte to it every
``interval_s`` seconds, and reads the beats of the same local rank on the previous
node. A peer silent for ``timeout_s`` seconds is taken for a lost host: the worker
logs it and exits (:data:`SILENT_PEER_EXIT_CODE`, :func:`exit_for_silence`), which
ends its part in the hung collective (a checkpointer first writes the state of the
last step to this node's memory); torchrun restarts the group and the rendezvous's keep-alive
drops the silent node.

Why a slow step is not a silent host: the beats come from a thread of their own,
not from the training loop, so a long optimizer step, a slow collective, a
checkpoint write or a validation pass do not delay them. The thread needs the CPU
and the GIL for microseconds per beat: a machine at 100% load wakes a sleeping
thread within milliseconds, and the interpreter hands the GIL over every 5 ms. What
it cannot tell from a frozen host is a process that gets no CPU at all, or a C call
that holds the GIL, for longer than the timeout (a long swap storm): raise the
timeout where that happens. A watcher that was itself paused (its process stopped and
resumed, its host frozen for a while) gives its peer one more timeout instead of
judging it by a silence it could not have heard.

Trust: the watcher greets each connection with a fresh nonce, and the connection
first proves that it knows the group's token (an HMAC of its source and destination
ranks, the group's label and that nonce; rank 0 draws the token when the group forms
and the process group hands it out), within :data:`HELLO_TIMEOUT_S`; anything else is
closed. A hello seen on the wire is therefore worth nothing on another connection.
Unauthenticated connections are bounded in number (:data:`MAX_PENDING`, the oldest is
dropped) and served by one thread with non-blocking sockets, so another local user can
neither forge a beat nor stall the reading of the real ones. A flood of connections
(any local user can read the port from ``/proc/net/tcp``) can keep the peer's beater
from connecting at all: a peer that never connected is therefore never taken for
silent (a warning names it after one timeout, and the process group's own timeout
stays), so a flood at a group's start cannot make a live worker exit. A clean close sends a
goodbye byte first, so a peer that finished is never mistaken for a silent one; a
peer that authenticates again is watched again, whatever its earlier connection said.
A connection that ends without a goodbye (the peer's process died and its kernel
closed it) is silence from then on: the peer's death normally fails this worker's
collective at once, and the worker is gone before a timeout passes, but a worker
that was itself paused while its peer died (a frozen host that wakes up after its
survivors restarted without it) can wake in a gloo send that waits out the process
group's timeout; the heartbeat ends that wait after one timeout.

The side channels' addresses must be reachable from the other nodes: where one node
advertises a loopback address and another does not (a host name that ``/etc/hosts``
maps to 127.0.1.1, as Debian does), or a node advertises a wildcard address, the
heartbeats are off with a warning instead of taking the unreachable peer for silent.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Callable

from elastic_kit._console import exit_now
from elastic_kit._env import non_negative_from_env
from elastic_kit.distributed import (
    DistInfo, all_gather_object, broadcast_object, is_dist_ready, side_channel_host,
    unreachable,
)

__all__ = [
    "DEFAULT_INTERVAL_S", "DEFAULT_TIMEOUT_S", "HELLO_TIMEOUT_S", "Heartbeat",
    "MAX_PENDING", "NONCE_BYTES", "SILENT_PEER_EXIT_CODE", "TIMEOUT_ENV", "start_heartbeat",
]

log = logging.getLogger(__name__)

#: Seconds of silence after which a peer is taken for a lost host.
DEFAULT_TIMEOUT_S = 5.0
#: Seconds between two beats (a tenth of the timeout by default: ten beats are missed
#: before a peer counts as silent).
DEFAULT_INTERVAL_S = 0.5
#: Environment variable overriding the timeout (seconds; ``0`` turns heartbeats off).
TIMEOUT_ENV = "ELASTIC_KIT_HEARTBEAT_TIMEOUT"
#: The exit status of a worker that found its peer silent (``EX_TEMPFAIL``).
SILENT_PEER_EXIT_CODE = 75
#: Seconds a new connection has to authenticate.
HELLO_TIMEOUT_S = 3.0
#: Unauthenticated connections served at once; beyond it the oldest is dropped.
MAX_PENDING = 16

#: The longest the watcher waits before it checks the time (its peer's silence).
_WATCH_TICK_S = 0.25

_BEAT, _BYE = b".", b"x"
_HELLO = struct.Struct("!i32s")  # source rank, HMAC-SHA256
#: Bytes of the nonce the watcher greets a connection with.
NONCE_BYTES = 16
#: Connections the listener's queue holds before the watcher accepts them.
_BACKLOG = 128


def hello_mac(token: bytes, label: str, src: int, dst: int, nonce: bytes) -> bytes:
    """What a connection from rank ``src`` to rank ``dst``, greeted with ``nonce``,
    proves it knows."""
    return hmac.new(token, f"{label}|{src}->{dst}|".encode() + nonce,
                    hashlib.sha256).digest()


class Heartbeat:
    """Beats to one peer, watches another; see the module's docstring.

    Args:
        rank: this worker's global rank.
        send_to: ``(rank, (host, port))`` of the peer this worker beats to, or None.
        watch: the rank whose beats this worker watches, or None.
        token, label: the group's secret and name (both ends must agree).
        timeout_s: silence, in seconds, after which ``watch`` counts as lost.
        interval_s: seconds between two beats (default: a tenth of the timeout, at
            most :data:`DEFAULT_INTERVAL_S`).
        on_silent: called once, on the watching thread, with the silent rank and the
            seconds of silence (default: log and exit with
            :data:`SILENT_PEER_EXIT_CODE`).
        host: the address to listen on (default :func:`side_channel_host`).
    """

    def __init__(self, *, rank: int, send_to: tuple[int, tuple[str, int]] | None,
                 watch: int | None, token: bytes, label: str, timeout_s: float,
                 interval_s: float | None = None,
                 on_silent: Callable[[int, float], None] | None = None,
                 host: str | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"heartbeat timeout_s={timeout_s!r} must be > 0 seconds")
        self.rank, self.watch, self.token, self.label = rank, watch, token, label
        self.timeout_s = float(timeout_s)
        self.interval_s = float(interval_s or min(DEFAULT_INTERVAL_S, self.timeout_s / 10))
        self.on_silent = on_silent or self._exit_for_silence
        self.listener = socket.create_server((host or side_channel_host(), 0),
                                             backlog=_BACKLOG)
        self.listener.setblocking(False)
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self._send_to = send_to
        self._closed = threading.Event()
        # close() writes to it: the watcher leaves its wait at once (a process exiting
        # for a restart closes the heartbeat on its way out, and the restart waits)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        #: the watched peer: when its last beat arrived (monotonic; the start at first,
        #: plus one timeout of grace to connect), whether it said goodbye, whether its
        #: connection ended without one
        self.last_beat = time.monotonic() + self.timeout_s
        #: whether the watched peer ever authenticated (a peer never heard is not
        #: judged: a flood of connections may be what keeps it out)
        self.heard = False
        self._warned_unheard = False
        self.said_bye = False
        self.lost_connection = False
        #: the rank found silent, once (None while every watched peer beats)
        self.silent: int | None = None
        self.refused = 0  # connections closed for a wrong or missing hello
        self._threads: list[threading.Thread] = []

    def start(self, send_to: tuple[int, tuple[str, int]] | None = None) -> Heartbeat:
        """Start beating to ``send_to`` (or the constructor's) and watching."""
        if send_to is not None:
            self._send_to = send_to
        self._threads = [threading.Thread(target=self._watch_loop, daemon=True,
                                          name="ek-heartbeat-watch")]
        if self._send_to is not None:
            self._threads.append(threading.Thread(target=self._beat_loop, daemon=True,
                                                  name="ek-heartbeat-beat"))
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        """Say goodbye to the peer, stop both threads. Safe to call twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2.0)
        for sock in (self.listener, self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass

    # ------------------------------------------------------------------ beating
    def _beat_loop(self) -> None:
        assert self._send_to is not None
        dst, addr = self._send_to
        sock: socket.socket | None = None
        while not self._closed.is_set():
            if sock is None:
                try:
                    sock = socket.create_connection(addr, timeout=1.0)
                    nonce = _recv_exactly(sock, NONCE_BYTES)
                    sock.sendall(_HELLO.pack(self.rank, hello_mac(
                        self.token, self.label, self.rank, dst, nonce)))
                except OSError:
                    if sock is not None:
                        sock.close()
                    sock = None  # not listening yet, or gone: try again next beat
            else:
                try:
                    sock.sendall(_BEAT)
                except OSError:
                    # the connection was cut: the peer's process ended (then connecting
                    # again fails, harmlessly, until this closes), or the watcher dropped
                    # it in a flood of other connections: connect again next beat
                    sock.close()
                    sock = None
            self._closed.wait(self.interval_s)
        if sock is not None:
            try:
                sock.sendall(_BYE)
                sock.close()
            except OSError:
                pass

    # ------------------------------------------------------------------ watching
    def _watch_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        # deadline, bytes so far, the nonce it was greeted with
        pending: dict[socket.socket, tuple[float, bytearray, bytes]] = {}
        watched: socket.socket | None = None
        tick = min(self.interval_s, _WATCH_TICK_S)
        last_tick = time.monotonic()
        try:
            while not self._closed.is_set():
                for key, _ in sel.select(timeout=tick):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._wake_r:  # close(): the loop's test ends it
                        continue
                    if sock is self.listener:
                        self._accept(sel, pending)
                    elif sock in pending:
                        if self._read_hello(sel, pending, sock):
                            if watched is not None:  # a reconnect replaces the old one
                                _drop(sel, watched)
                            watched = sock
                            self.last_beat = time.monotonic()
                            self.heard = True
                            # it is back: watched again, whatever the last one said
                            self.lost_connection = self.said_bye = False
                    elif sock is watched:
                        if not self._read_beats(sel, sock):
                            watched = None
                now = time.monotonic()
                if now - last_tick > self.timeout_s / 2:
                    # This thread itself did not run for a while (its process or host
                    # was paused, or starved of CPU or the GIL): it cannot tell a silent
                    # peer from its own pause, so the peer gets one more timeout.
                    self.last_beat = max(self.last_beat, now)
                last_tick = now
                for sock, (deadline, _, _) in list(pending.items()):
                    if now > deadline:
                        self.refused += 1
                        del pending[sock]
                        _drop(sel, sock)
                if (not self.heard and not self._warned_unheard and self.watch is not None
                        and now > self.last_beat + self.timeout_s):
                    self._warned_unheard = True
                    log.warning(
                        "rank %d's heartbeat has not connected in %.0f s (a firewall, or "
                        "another local user flooding port %d with connections): its "
                        "silence is left to the process group's timeout", self.watch,
                        now - self.last_beat + self.timeout_s, self.address[1])
                if self._is_silent(now):
                    self.silent = self.watch
                    self.on_silent(int(self.watch), now - self.last_beat)
                    return
        finally:
            for key in list(sel.get_map().values()):
                if key.fileobj not in (self.listener, self._wake_r):
                    _drop(sel, key.fileobj)  # type: ignore[arg-type]
            sel.close()

    def _is_silent(self, now: float) -> bool:
        # a connection lost without a goodbye (the peer's process died: its kernel
        # closed it) counts from its end: its death fails this worker's collective at
        # once, unless this process was paused meanwhile and woke in a send to it
        # (gloo then waits out its own timeout, minutes); a peer that reconnects
        # within the timeout is watched again
        return (self.watch is not None and self.heard and self.silent is None
                and not self.said_bye and now - self.last_beat > self.timeout_s)

    def _accept(self, sel: selectors.BaseSelector,
                pending: dict[socket.socket, tuple[float, bytearray, bytes]]) -> None:
        """Accept every connection waiting (a queue kept full by a flood would turn the
        real peer's connection away), each greeted with its nonce."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.setblocking(False)
            nonce = secrets.token_bytes(NONCE_BYTES)
            try:
                conn.send(nonce)  # a few bytes: a fresh socket's buffer takes them
            except OSError:
                conn.close()
                continue
            if len(pending) >= MAX_PENDING:  # a flood: the oldest waits no longer
                oldest = min(pending, key=lambda s: pending[s][0])
                del pending[oldest]
                self.refused += 1
                _drop(sel, oldest)
            pending[conn] = (time.monotonic() + HELLO_TIMEOUT_S, bytearray(), nonce)
            sel.register(conn, selectors.EVENT_READ, None)

    def _read_hello(self, sel: selectors.BaseSelector,
                    pending: dict[socket.socket, tuple[float, bytearray, bytes]],
                    sock: socket.socket) -> bool:
        deadline, buf, nonce = pending[sock]
        try:
            chunk = sock.recv(_HELLO.size - len(buf))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            chunk = b""
        if not chunk:
            del pending[sock]
            _drop(sel, sock)
            return False
        buf += chunk
        if len(buf) < _HELLO.size:
            return False
        del pending[sock]
        src, mac = _HELLO.unpack(bytes(buf))
        ok = (src == self.watch and hmac.compare_digest(
            mac, hello_mac(self.token, self.label, src, self.rank, nonce)))
        if not ok:
            self.refused += 1
            _drop(sel, sock)
        return ok

    def _exit_for_silence(self, rank: int, seconds: float) -> None:
        exit_for_silence(rank, seconds, connection_lost=self.lost_connection)

    def _read_beats(self, sel: selectors.BaseSelector, sock: socket.socket) -> bool:
        """Read what the watched peer sent; False once its connection is over."""
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            data = b""
        if data:
            self.last_beat = time.monotonic()
            if _BYE in data:
                self.said_bye = True
            else:
                return True
        elif not self.said_bye:
            # ended without a goodbye: its process died (the kernel closed the
            # connection, which the process group notices too) or it reconnects;
            # the silence is counted from here
            self.lost_connection = True
            self.last_beat = time.monotonic()
        _drop(sel, sock)
        return False


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (its timeout applies to each read)."""
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the watcher closed the connection before its greeting")
        out += chunk
    return out


def _drop(sel: selectors.BaseSelector, sock: socket.socket) -> None:
    try:
        sel.unregister(sock)
    except (KeyError, ValueError):
        pass
    try:
        sock.close()
    except OSError:
        pass


def exit_for_silence(rank: int, seconds: float, *, connection_lost: bool = False) -> None:
    """Log that rank ``rank`` was silent for ``seconds`` and end this process with
    :data:`SILENT_PEER_EXIT_CODE` at once (``os._exit``: no exit handlers, no
    waiting for other threads). The heartbeat's default action on a silent peer.

    ``connection_lost``: the silence began when the peer's connection ended without
    a goodbye, which says its process ended (a crash, or its own exit for a silent
    peer of its own), not that its host froze: the message says so, so that one
    frozen host is not blamed as two."""
    if connection_lost:
        log.error("rank %d's heartbeat connection ended without a goodbye %.1f s ago "
                  "(its process ended) and it did not come back; exiting (status %d) so "
                  "torchrun re-forms the group without it",
                  rank, seconds, SILENT_PEER_EXIT_CODE)
    else:
        log.error("no heartbeat from rank %d for %.1f s: its host is frozen or "
                  "unreachable; exiting (status %d) so torchrun re-forms the group "
                  "without it", rank, seconds, SILENT_PEER_EXIT_CODE)
    # The main thread sits in a collective the silent host never joins: only leaving
    # the process ends it (torchrun's SIGTERM would not run Python's handler there).
    exit_now(SILENT_PEER_EXIT_CODE)


def timeout_from_env(default: float | None) -> float | None:
    """``$ELASTIC_KIT_HEARTBEAT_TIMEOUT`` when set (``0``: off), else ``default``."""
    value = non_negative_from_env(TIMEOUT_ENV, float, "a number of seconds", "0: off")
    if value is None:
        return default
    return value or None


def start_heartbeat(info: DistInfo, *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                    on_silent: Callable[[int, float], None] | None = None) -> Heartbeat | None:
    """Start this worker's heartbeat. Collective: call on every rank.

    None (nothing started, no collective) outside a process group, with one node, or
    with ``timeout_s`` None or 0 (``$ELASTIC_KIT_HEARTBEAT_TIMEOUT`` overrides it).
    Every rank gets the same answer, as the inputs are the same everywhere.
    """
    timeout_s = timeout_from_env(timeout_s)
    if not timeout_s or not is_dist_ready() or info.num_nodes < 2:
        return None
    hb: Heartbeat | None = None
    try:
        hb = Heartbeat(rank=info.rank, send_to=None, watch=None, token=b"", label="",
                       timeout_s=timeout_s, on_silent=on_silent)
    except OSError as e:  # no address to listen on: every rank learns it below
        log.warning("rank %d cannot listen for heartbeats on %s: %r", info.rank,
                    side_channel_host(), e)
    token = secrets.token_bytes(32) if info.rank == 0 else None
    token = broadcast_object(token, src=0)
    everyone = all_gather_object((info.node_rank, info.local_rank,
                                  None if hb is None else hb.address))
    if hb is None or any(addr is None for _, _, addr in everyone):
        if hb is not None:
            hb.close()
        if info.is_main:
            log.warning("heartbeats are off: a rank could not listen for them (see its log); "
                        "a frozen host is noticed at the process group's timeout")
        return None
    why = unreachable([addr[0] for _, _, addr in everyone])
    if why is not None:  # every rank sees the same list: all turn them off
        hb.close()
        if info.is_main:
            log.warning("heartbeats are off: %s; a frozen host is noticed at the process "
                        "group's timeout", why)
        return None
    where = {(node, local): (rank, addr) for rank, (node, local, addr) in enumerate(everyone)}
    nodes = sorted({node for node, _, _ in everyone})
    at = nodes.index(info.node_rank)
    nxt = where.get((nodes[(at + 1) % len(nodes)], info.local_rank))
    prev = where.get((nodes[at - 1], info.local_rank))
    hb.token = token
    # What every rank of the group agrees on: not the restart count, which torchrun
    # keeps per agent (a node that joined later counts from 0). The token is new for
    # every group, so beats of an earlier group cannot pass for this one's.
    hb.label = f"{info.run_id}|{info.world_size}"
    hb.watch = None if prev is None else prev[0]
    return hb.start(send_to=nxt)
