"""Peer replicas: each node streams its committed snapshot into another node's memory.

Under data parallelism every node's own snapshot already holds the whole state, but a
node's snapshot is the only copy of whatever differs between nodes (a node that
joined late, a node whose snapshot write failed, state that is not replicated), and
it dies with the node. So each node's writer sends every snapshot it commits to the
next writer in ring order (global rank order of the nodes' local rank 0), over a TCP
side channel that carries no collective and never blocks training:

- :class:`ReplicaReceiver` (a daemon thread on each writer) serves every connection
  at once with deadlines (no stranger can hold it, see the class) and commits each
  stream as ``<node dir>/replicas/<source node>/step-<n>/`` in the node's private
  tree (0700 directories, 0600 files): the files go into a ``.tmp-`` directory, the
  manifest last, and the directory is renamed into place, so a stream cut at any
  moment leaves the previous replica valid and no leftover. Once a replica is
  committed every older one (of any source) is removed: a node holds one replica,
  plus the one being received. (Sharded state: each rank streams its part, and the
  newest two steps of each part of the sending node stay, see ``_drop_older``.)
- :class:`ReplicaSender` (a daemon thread on each writer) is offered each committed
  snapshot directory; it streams the newest one offered (an older one still waiting
  is skipped): a header line (run, source node, step, file names and sizes), which
  the receiver accepts (``go``) or refuses with a reason, then the files (read in
  pieces, each fed to the HMAC as it is sent), manifest last, then a trailer line with
  the HMAC of those bytes, and waits for the receiver's ``ok``.

Both ends prove that they hold the group's token, which rank 0 draws when the group
forms, without ever sending it (another local user can listen on a port a dead
receiver freed, or connect to a live one): the receiver greets each connection with
a fresh nonce, the sender's header carries an HMAC of the header and that nonce, and
the receiver's ``go`` carries an HMAC of the sender's own nonce, checked before a
byte of a file is sent. The header names the receiver it is for (an identity each
receiver draws and publishes with its address), so a stranger on a dead receiver's
port cannot pass the stream on to a live one; and a trailer after the last file
carries an HMAC of every byte of the stream (bound to both nonces), checked before
the replica is committed, so bytes changed on the way are refused. A receiver that
has no token yet (between its start and the group's exchange) refuses every stream;
a refusal before the header's HMAC checked says nothing about the run. The header
also names the run with the durable store's run identity, so a stream of another run
of the same store is refused. A replica is then loaded like any snapshot, after its
manifest's checksum verified.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import selectors
import shutil
import socket
import threading
import time
import uuid
from typing import Any, Callable

from elastic_kit.distributed import SIDE_CHANNEL_ADDR_ENV, side_channel_host
from elastic_kit.snapshot._private import is_private_entry, private_dir
from elastic_kit.store import (
    MANIFEST_NAME, TMP_PREFIX, Manifest, check_file_name, parse_step_dir, step_dir_name,
)

__all__ = ["ADDR_ENV", "REPLICAS", "ReplicaReceiver", "ReplicaSender", "advertised_host",
           "content_mac", "receiver_proof", "signed_header", "writer_addresses"]

log = logging.getLogger(__name__)

#: Environment variable: the address a node's receiver listens on and its peers
#: connect to (default: this host's address on the route to ``MASTER_ADDR``).
ADDR_ENV = SIDE_CHANNEL_ADDR_ENV
#: Name of the directory, inside a node's snapshot directory, holding replicas.
REPLICAS = "replicas"
_MAX_HEADER = 64 << 10
_MAX_FILES = 64
_CHUNK = 4 << 20
_BACKLOG = 64
_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}", re.ASCII)
#: Steps of one part of a node's sharded snapshot a receiver keeps at most.
PART_REPLICAS = 2
#: The largest file a stream may carry (a bigger size is refused in the header).
MAX_FILE_BYTES = 1 << 40
#: Seconds a new connection has to deliver its header (receiver).
HEADER_TIMEOUT_S = 3.0
#: Seconds an accepted stream may go without delivering a byte (receiver).
PROGRESS_TIMEOUT_S = 5.0
#: Connections still owing their header that the receiver keeps (the oldest is
#: dropped for a new one).
MAX_PENDING = 32
#: Refused connections the receiver handles per second, and in a burst; beyond that it
#: stops accepting until the budget refills.
REFUSED_RATE = 200.0
REFUSED_BURST = 50
#: Seconds :meth:`ReplicaReceiver.close` waits for its thread.
CLOSE_WAIT_S = 1.0
#: Seconds a connection may stay silent before the sender drops it.
IO_TIMEOUT_S = 30.0
#: Seconds the sender keeps trying to open a stream the receiver answers.
CONNECT_DEADLINE_S = 5.0
#: The slowest a stream may go on average (bytes/s) before the sender drops it: its
#: deadline is :data:`IO_TIMEOUT_S` plus its bytes at this rate.
MIN_RATE = 10 << 20


def advertised_host() -> str:
    """The address this node's receiver listens on: the side channels' address
    (:func:`~elastic_kit.distributed.side_channel_host`, ``$ELASTIC_KIT_SNAPSHOT_ADDR``
    first), which the heartbeats use too."""
    return side_channel_host()


#: Entries the ``received``/``sent`` histories keep (a run may snapshot every step).
_HISTORY = 16


def _note(history: list[Any], item: Any) -> None:
    history.append(item)
    del history[:-_HISTORY]


def _recv_line(conn: socket.socket, limit: int, deadline: float) -> bytes:
    """A line from ``conn`` (without its newline), read by ``deadline``
    (``time.monotonic()``) however slowly the peer trickles it."""
    out = bytearray()
    while not out.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer's line did not arrive in time")
        conn.settimeout(left)
        c = conn.recv(1)
        if not c:
            raise ConnectionError("stream ended inside its header")
        out += c
        if len(out) > limit:
            raise ValueError(f"header longer than {limit} bytes")
    return bytes(out[:-1])


class _Refused(Exception):
    """A stream the receiver refuses; the message is the reply's reason."""


#: What the two ends' HMACs cover starts with these (so that neither can be replayed
#: as the other, nor a stream's bytes as either).
_SENDER_MAC, _RECEIVER_MAC = b"elastic_kit replica header\n", b"elastic_kit replica go\n"
_CONTENT_MAC = b"elastic_kit replica bytes\n"
_COMMITTED_MAC = b"elastic_kit replica committed\n"
#: The line that ends a stream, after its last file: ``mac <HMAC of its bytes>``.
_TRAILER_MAX = 80


def _mac(token: str, *parts: bytes) -> str:
    return hmac.new(token.encode(), b"\n".join(parts), hashlib.sha256).hexdigest()


def _canonical(header: dict[str, Any]) -> bytes:
    """The bytes a header's HMAC covers: its fields but ``mac``, in one spelling."""
    return json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True,
                      separators=(",", ":")).encode()


def signed_header(header: dict[str, Any], *, token: str, nonce: str) -> bytes:
    """``header`` with the HMAC that proves the token for the receiver's greeting
    ``nonce``, as the line to send."""
    signed = {**header, "mac": _mac(token, _SENDER_MAC, nonce.encode(), _canonical(header))}
    return json.dumps(signed).encode() + b"\n"


def receiver_proof(token: str, *, sender_nonce: str, nonce: str) -> str:
    """The HMAC a receiver's ``go`` carries: it holds the token (for the sender's
    nonce in its header, and the receiver's own greeting ``nonce``)."""
    return _mac(token, _RECEIVER_MAC, sender_nonce.encode(), nonce.encode())


def committed_proof(token: str, *, sender_nonce: str, nonce: str, step: int) -> str:
    """The HMAC a receiver's final ``ok`` carries: it committed this stream's ``step``
    (so that nobody on the path can make a sender count a refused stream as sent)."""
    return _mac(token, _COMMITTED_MAC, sender_nonce.encode(), nonce.encode(),
                str(step).encode())


def content_mac(token: str, *, sender_nonce: str, nonce: str) -> Any:
    """The HMAC (an ``hmac.HMAC`` to feed every byte of a stream's files to, in order)
    that the stream's trailer carries: bound to both ends' nonces, so the bytes of
    one stream cannot be passed off as another's."""
    return hmac.new(token.encode(), b"\n".join(
        (_CONTENT_MAC, sender_nonce.encode(), nonce.encode(), b"")), hashlib.sha256)


def check_header(header: Any, *, run: str, token: str, nonce: str,
                 ident: str) -> tuple[str, int, list[str], list[int]]:
    """``(source, step, names, sizes)`` of a stream's header, its HMAC (for the
    greeting ``nonce``) checked first and every field validated before anything is
    made on disk. ``ident``: the receiver's own identity, which the header must be
    addressed to (a signed header that another local user, listening on the port of
    a receiver that died, passes on to a live one names the dead one).

    Raises:
        _Refused: naming the field, its value and what was expected (only once the
            header proved the token: before that, nothing about the run).
    """
    if not token:
        raise _Refused("not ready: the group's token is not known yet")
    mac = header.get("mac") if isinstance(header, dict) else None
    if not isinstance(mac, str) or not hmac.compare_digest(
            mac.encode(), _mac(token, _SENDER_MAC, nonce.encode(),
                               _canonical(header)).encode()):
        raise _Refused("not authenticated (another group's stream)")
    sender_nonce = header.get("nonce")
    if not isinstance(sender_nonce, str) or not 16 <= len(sender_nonce) <= 128:
        raise _Refused(f"bad nonce {str(sender_nonce)[:40]!r}: expected 16-128 characters")
    if header.get("run") != run:
        raise _Refused(f"run {str(header.get('run'))[:200]!r} is not {run!r}")
    if header.get("to") != ident:
        raise _Refused(f"addressed to receiver {str(header.get('to'))[:40]!r}, not to this "
                       f"one ({ident!r})")
    source, step, files = header.get("source"), header.get("step"), header.get("files")
    if not isinstance(source, str) or not _NAME_RE.fullmatch(source):
        raise _Refused(f"bad source node name {str(source)[:200]!r}: expected 1-128 of "
                       f"[A-Za-z0-9_.-], not starting with a dot")
    if type(step) is not int or not 0 <= step < 10**12:
        raise _Refused(f"bad step {str(step)[:40]!r}: expected an int in [0, 10**12)")
    if not isinstance(files, list) or not 0 < len(files) <= _MAX_FILES or not all(
            isinstance(f, list) and len(f) == 2 for f in files) or files[-1][0] != MANIFEST_NAME:
        raise _Refused(f"bad file list {str(files)[:200]}: expected 1-{_MAX_FILES} "
                       f"[name, size] pairs, {MANIFEST_NAME} last")
    try:
        names = [check_file_name(f[0]) for f in files[:-1]] + [MANIFEST_NAME]
    except (TypeError, ValueError) as e:
        raise _Refused(f"bad file name: {e}") from None
    sizes = [f[1] for f in files]
    if len(set(names)) != len(names):
        raise _Refused(f"bad file list {str(files)[:200]}: a name repeats")
    for name, size in zip(names, sizes):
        if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
            raise _Refused(f"bad size {str(size)[:40]} of {name}: expected an int in "
                           f"[0, {MAX_FILE_BYTES}]")
    return source, step, names, sizes


class _Stream:
    """One connection: its header being read, then its files being received."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.buf = bytearray()
        self.receiving = False  # the header was accepted
        self.nonce = secrets.token_hex(16)  # the greeting's: the header's HMAC covers it
        self.source, self.step = "", -1
        self.names: list[str] = []
        self.sizes: list[int] = []
        self.index = 0
        self.left = 0
        self.fd: int | None = None
        self.tmp: str | None = None
        self.mac: Any = None  # the HMAC of the files' bytes, fed as they arrive
        self.sender_nonce = ""  # the accepted header's
        self.trailer = bytearray()  # the line after the last file


class ReplicaReceiver:
    """Accepts peers' snapshot streams into ``<node_dir>/replicas/`` (a daemon thread).

    One thread serves every connection at once (non-blocking sockets, a selector), so
    an idle or slow client never holds up another: a connection must deliver its
    header within :data:`HEADER_TIMEOUT_S` and, once accepted, make progress every
    :data:`PROGRESS_TIMEOUT_S`, or it is dropped; at most :data:`MAX_PENDING`
    connections may be waiting for their header (the oldest is dropped for a new
    one). A refused connection (wrong token, malformed header, a stream cut short)
    costs a bounded amount of work and draws from a budget of :data:`REFUSED_RATE` per
    second: when it is spent the receiver stops accepting until it refills, so a
    flood of them costs the training process a bounded share of its time (the
    kernel's listen queue holds the rest). Nothing is made on disk before the header
    validated; a failed stream's temporary directory is removed. Once the group's
    writers are known (:attr:`peers`), a connection from any other address is closed
    before it can send a byte, counted as refused.

    Args:
        node_dir: this node's snapshot directory.
        run: the run's name (with the durable store's run identity); streams naming
            another run are refused.
        token: the group's token; streams carrying another token are refused.
        host: the address to listen on (port: any free one, see :attr:`port`).
        keep_parts: the steps of a node's parts to keep besides the newest
            :data:`PART_REPLICAS` (the newest step every rank holds its part of, and
            those that may become it: see ``SnapshotTier.parts_kept``).
        tree: ``(root, parts)`` with ``root/parts...`` = ``node_dir``: every stream
            walks down to its directory from the trusted root, each level opened
            without following symlinks and checked to be this user's alone (the
            tree may have been removed and planted again by another user since it
            was made). Default: ``node_dir``'s parent is the trusted root.
    """

    def __init__(self, node_dir: str, *, run: str, token: str, host: str,
                 keep_parts: Callable[[], set[int]] = set,
                 tree: tuple[str, list[str]] | None = None) -> None:
        self.node_dir = node_dir
        self._tree = tree or (os.path.dirname(node_dir), [os.path.basename(node_dir)])
        self._keep_parts = keep_parts
        self.dir = os.path.join(node_dir, REPLICAS)
        self.run, self.token = run, token
        #: this receiver's identity, which every stream's signed header names (see
        #: :func:`check_header`); published with its address
        self.ident = secrets.token_hex(16)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(_BACKLOG)
        self._sock.setblocking(False)
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = threading.Event()
        self._warned = False
        self._budget = float(REFUSED_BURST)
        self._budget_t = time.monotonic()
        self._streams: list[_Stream] = []
        #: the last steps committed, as ``(source, step)`` (for logs and tests)
        self.received: list[tuple[str, int]] = []
        #: connections refused or dropped so far (for logs and tests)
        self.refused = 0
        #: the addresses streams may come from (the group's writers'); None: any
        self.peers: frozenset[str] | None = None
        self._thread = threading.Thread(target=self._serve, name="ek-replica-recv", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        listening = False
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._budget = min(float(REFUSED_BURST),
                                   self._budget + (now - self._budget_t) * REFUSED_RATE)
                self._budget_t = now
                if (self._budget >= 1.0) != listening:
                    listening = not listening
                    if listening:
                        sel.register(self._sock, selectors.EVENT_READ, "listen")
                    else:
                        sel.unregister(self._sock)
                wait = min([s.deadline for s in self._streams], default=now + 0.5) - now
                if not listening:
                    wait = min(wait, (1.0 - self._budget) / REFUSED_RATE)
                for key, _ in sel.select(timeout=max(0.0, min(wait, 0.5))):
                    if key.data == "wake":
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    elif key.data == "listen":
                        self._accept(sel)
                    elif key.data in self._streams:
                        self._readable(sel, key.data)
                now = time.monotonic()
                for st in [s for s in self._streams if s.deadline <= now]:
                    self._fail(sel, st, "timed out: " + (
                        f"no progress for {PROGRESS_TIMEOUT_S:g} s" if st.receiving else
                        f"no header within {HEADER_TIMEOUT_S:g} s"))
        finally:
            for st in list(self._streams):
                self._fail(sel, st, "the receiver is closing", reply=False)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            conn, addr = self._sock.accept()
        except OSError:
            return
        peers = self.peers
        if peers is not None and _plain_address(addr[0]) not in peers:
            self.refused += 1
            self._budget -= 1.0
            conn.close()  # not one of the group's writers: not a byte read
            (log.debug if self._warned else log.warning)(
                "refused a replica connection from %s, which is not one of the group's "
                "snapshot writers %s", addr[0], sorted(peers))
            self._warned = True
            return
        conn.setblocking(False)
        waiting = [s for s in self._streams if not s.receiving]
        if len(waiting) >= MAX_PENDING:
            self._fail(sel, waiting[0], "dropped for a newer connection")
        st = _Stream(conn, time.monotonic() + HEADER_TIMEOUT_S)
        try:
            conn.send(f"hello {st.nonce}\n".encode())  # a few bytes: a fresh socket takes them
        except OSError:
            conn.close()
            return
        self._streams.append(st)
        sel.register(conn, selectors.EVENT_READ, st)

    def _readable(self, sel: selectors.BaseSelector, st: _Stream) -> None:
        try:
            if st.receiving:
                self._receive_some(sel, st)
                return
            chunk = st.sock.recv(_MAX_HEADER + 1 - len(st.buf))
            if not chunk:
                raise _Refused("stream ended inside its header")
            st.buf += chunk
            end = st.buf.find(b"\n")
            if end < 0:
                if len(st.buf) > _MAX_HEADER:
                    raise _Refused(f"header longer than {_MAX_HEADER} bytes")
                return
            try:
                header = json.loads(bytes(st.buf[:end]))
            except ValueError:
                raise _Refused("the header is not JSON") from None
            rest = bytes(st.buf[end + 1:])
            st.buf = bytearray()
            self._start(st, header)
            if rest:
                self._consume(sel, st, rest)
        except BlockingIOError:
            return
        except _Refused as e:
            self._fail(sel, st, str(e))
        except Exception as e:  # a peer's failure never fails training
            self._fail(sel, st, repr(e))

    def _start(self, st: _Stream, header: Any) -> None:
        """Validate the header; then (only then) make the temporary directory."""
        st.source, st.step, st.names, st.sizes = check_header(
            header, run=self.run, token=self.token, nonce=st.nonce, ident=self.ident)
        where = self.node_dir if os.path.isdir(self.node_dir) else os.path.dirname(
            self.node_dir)
        # the streams still arriving will take their remaining bytes too
        owed = sum(o.left + sum(o.sizes[o.index + 1:]) for o in self._streams
                   if o.receiving and o is not st)
        free = shutil.disk_usage(where).free - owed
        if free < sum(st.sizes):
            raise _Refused(f"{where} has {max(free, 0) / 1e6:.0f} MB free beside the "
                           f"replicas arriving, this one needs {sum(st.sizes) / 1e6:.0f} MB")
        base, parts = self._tree
        root = private_dir(base, [*parts, REPLICAS, st.source])
        st.tmp = os.path.join(root, f"{TMP_PREFIX}{step_dir_name(st.step)}-"
                                    f"{uuid.uuid4().hex[:8]}")
        os.mkdir(st.tmp, 0o700)
        st.receiving = True
        st.deadline = time.monotonic() + PROGRESS_TIMEOUT_S
        proof = receiver_proof(self.token, sender_nonce=header["nonce"], nonce=st.nonce)
        st.mac = content_mac(self.token, sender_nonce=header["nonce"], nonce=st.nonce)
        st.sender_nonce = header["nonce"]
        # the header is accepted: the sender checks the proof, then streams the files
        st.sock.sendall(f"go {proof}\n".encode())
        st.index, st.left = -1, 0
        self._next_file(st)

    def _next_file(self, st: _Stream) -> None:
        """Close the finished file and open the next non-empty one (empty ones are
        created as they are)."""
        while st.left == 0:
            if st.fd is not None:
                os.close(st.fd)
                st.fd = None
            st.index += 1
            if st.index >= len(st.names):
                return
            assert st.tmp is not None
            st.fd = os.open(os.path.join(st.tmp, st.names[st.index]),
                            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            st.left = st.sizes[st.index]

    def _receive_some(self, sel: selectors.BaseSelector, st: _Stream) -> None:
        if st.index < len(st.names):
            data = st.sock.recv(min(st.left, _CHUNK)) if st.left else st.sock.recv(1)
        else:  # the trailer: no byte past its line is read
            data = st.sock.recv(_TRAILER_MAX + 1 - len(st.trailer))
        if not data:
            if st.index >= len(st.names):
                raise _Refused("stream ended before its trailer")
            raise _Refused(f"stream ended with {st.left} bytes of {st.names[st.index]} "
                           "missing")
        self._consume(sel, st, data)

    def _consume(self, sel: selectors.BaseSelector, st: _Stream, data: bytes) -> None:
        view = memoryview(data)
        while view and st.index < len(st.names):
            take = view[:st.left]
            st.mac.update(take)
            assert st.fd is not None
            while take:
                k = os.write(st.fd, take)
                take = take[k:]
            n = min(len(view), st.left)
            view = view[n:]
            st.left -= n
            self._next_file(st)
        st.trailer += view
        st.deadline = time.monotonic() + PROGRESS_TIMEOUT_S
        if st.index < len(st.names):
            return
        end = st.trailer.find(b"\n")
        if end < 0 and len(st.trailer) <= _TRAILER_MAX:
            return
        if end < 0:
            raise _Refused(f"the stream's trailer is longer than {_TRAILER_MAX} bytes")
        if end != len(st.trailer) - 1:
            raise _Refused("the stream is longer than its header says")
        if not hmac.compare_digest(bytes(st.trailer[:end]),
                                   b"mac " + st.mac.hexdigest().encode()):
            raise _Refused("the stream's bytes are not the ones its sender signed "
                           "(changed on the way)")
        self._commit(sel, st)

    def _commit(self, sel: selectors.BaseSelector, st: _Stream) -> None:
        assert st.tmp is not None
        with open(os.path.join(st.tmp, MANIFEST_NAME), "rb") as f:
            raw = f.read()
        try:
            m = Manifest.from_json(raw.decode("utf-8"), where="the streamed manifest")
        except Exception as e:
            raise _Refused(f"the streamed manifest does not validate: {e}") from None
        got = dict(zip(st.names[:-1], st.sizes[:-1]))
        if m.step != st.step or {n: e.size for n, e in m.files.items()} != got:
            raise _Refused(f"the streamed manifest (step {m.step}, files "
                           f"{sorted(m.files)}) does not describe the stream (step "
                           f"{st.step}, files {sorted(got)})")
        target = os.path.join(os.path.dirname(st.tmp), step_dir_name(st.step))
        old = None
        if os.path.lexists(target):  # the same step again (a re-sent stream): the old
            old = f"{st.tmp}-old"    # copy stays whole until the new one is in place
            os.rename(target, old)
        os.rename(st.tmp, target)
        st.tmp = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._drop_older(st.source, st.step)
        _note(self.received, (st.source, st.step))
        log.debug("replica of node %s step %d committed in %s", st.source, st.step, target)
        done = committed_proof(self.token, sender_nonce=st.sender_nonce, nonce=st.nonce,
                               step=st.step)
        self._close(sel, st, f"ok {done}\n".encode())

    def _close(self, sel: selectors.BaseSelector, st: _Stream, reply: bytes | None) -> None:
        if st in self._streams:
            self._streams.remove(st)
        try:
            sel.unregister(st.sock)
        except (KeyError, ValueError):
            pass
        # what a failed stream left is gone before the sender hears of it
        if st.fd is not None:
            os.close(st.fd)
            st.fd = None
        if st.tmp is not None:
            shutil.rmtree(st.tmp, ignore_errors=True)
            st.tmp = None
        if reply is not None:
            try:
                st.sock.send(reply)
            except OSError:
                pass
        st.sock.close()

    def _fail(self, sel: selectors.BaseSelector, st: _Stream, why: str, *,
              reply: bool = True) -> None:
        self.refused += 1
        self._budget -= 1.0
        if st.receiving:  # a stream of this group that failed: worth a line in the log
            (log.debug if self._warned else log.warning)(
                "receiving a snapshot replica into %s failed: %s", self.dir, why)
            self._warned = True
        else:
            log.debug("refused a replica connection: %s", why)
        self._close(sel, st, f"error: {why}".encode()[:1000] + b"\n" if reply else None)

    def _drop_older(self, source: str, step: int) -> None:
        """Keep one replica: the one just committed (and streams still arriving).

        A node's *parts* (sharded state: one stream per rank, sources
        ``<node>.p<k>``) land one by one, and a restore needs every rank's part of one
        step, so the newest :data:`PART_REPLICAS` steps of each of that node's parts
        stay (as the writers keep their previous step); replicas of other nodes go."""
        live = {os.path.basename(s.tmp) for s in self._streams if s.tmp is not None}
        node, dot, _ = source.partition(".")
        steps: dict[str, list[int]] = {}
        for src in os.listdir(self.dir):
            root = os.path.join(self.dir, src)
            names = os.listdir(root) if is_private_entry(root) else []
            steps[src] = sorted(n for n in map(parse_step_dir, names) if n is not None)
        own_parts = [s for s in steps if dot and s.partition(".")[0] == node]
        also = self._keep_parts() if own_parts else set()
        for src in os.listdir(self.dir):
            root = os.path.join(self.dir, src)
            keep: set[str] = set()
            if src in own_parts:
                keep = {step_dir_name(n) for n in steps[src]
                        if n in steps[src][-PART_REPLICAS:] or n in also}
            elif src == source:
                keep = {step_dir_name(step)}
            for name in os.listdir(root) if is_private_entry(root) else ():
                if name not in keep and name not in live:
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            if src != source:
                try:
                    os.rmdir(root)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop receiving, within about :data:`CLOSE_WAIT_S` whatever the clients do (a
        stream being received is dropped; its temporary directory is removed)."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=CLOSE_WAIT_S)
        self._sock.close()
        self._wake_w.close()
        if not self._thread.is_alive():
            self._wake_r.close()


def _plain_address(host: str) -> str:
    """``host`` without an IPv4-mapped IPv6 prefix (``::ffff:10.0.0.1`` -> ``10.0.0.1``)."""
    return host[7:] if host.lower().startswith("::ffff:") and "." in host else host


def writer_addresses(hosts: list[str]) -> frozenset[str] | None:
    """The addresses the group's writers' streams come from, for
    :attr:`ReplicaReceiver.peers`: their advertised hosts (each sender binds its
    connection to its own, see :class:`ReplicaSender`). None (any address) when one
    of them is a wildcard address or a name, which says nothing about the source."""
    out = set()
    for h in hosts:
        try:
            ip = ipaddress.ip_address(_plain_address(h))
        except ValueError:
            return None
        if ip.is_unspecified:
            return None
        out.add(str(ip))
    return frozenset(out)


def _send_file(conn: socket.socket, f: Any, size: int, deadline: float, mac: Any,
               buf: memoryview) -> None:
    """Send ``size`` bytes of the open file ``f`` by ``deadline``, in pieces read into
    ``buf``, each fed to ``mac`` as it goes (read, not mapped: a file cut short while
    it streams is an error here, never a SIGBUS in the training process)."""
    offset = 0
    while offset < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the peer took {size} bytes of {f.name} too slowly")
        n = os.preadv(f.fileno(), [buf[:min(len(buf), size - offset)]], offset)
        if n <= 0:
            raise ConnectionError(f"{f.name} ended after {offset} of its {size} bytes")
        piece = buf[:n]
        mac.update(piece)
        conn.settimeout(min(left, IO_TIMEOUT_S))
        conn.sendall(piece)
        offset += n


class ReplicaSender:
    """Streams this node's newest committed snapshot to its ring successor (a daemon
    thread); :meth:`offer` never blocks.

    ``to``: the receiver's :attr:`~ReplicaReceiver.ident`, which the signed header
    names (a receiver refuses a stream addressed to another).
    ``bind``: the local address its connections come from (this node's advertised
    host, which the receiver checks), or None for the kernel's choice."""

    def __init__(self, peer: tuple[str, int], *, to: str, source: str, run: str,
                 token: str, bind: str | None = None) -> None:
        self.peer, self.source, self.run, self.token = peer, source, run, token
        self.to = to
        self.bind = bind
        self._cond = threading.Condition()
        self._offered: tuple[int, str] | None = None
        self._busy = False
        self._sending: int | None = None  # the step being streamed now
        self._greeting = ""  # the receiver's nonce on the connection being opened
        self._closed = False
        self._warned = False
        #: the last steps the peer committed (for logs and tests)
        self.sent: list[int] = []
        self._thread = threading.Thread(target=self._run, name="ek-replica-send", daemon=True)
        self._thread.start()

    def offer(self, step: int, path: str) -> None:
        """Stream the committed snapshot ``path`` (of ``step``) soon, unless a newer
        one is offered before it starts."""
        with self._cond:
            self._offered = (step, path)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._offered is None and not self._closed:
                    self._cond.wait()
                if self._offered is None:
                    return
                step, path = self._offered
                self._offered, self._busy, self._sending = None, True, step
            try:
                self._send(step, path)
            except Exception as e:
                # The next snapshot tries again; the peer's older replica stays valid.
                (log.debug if self._warned else log.warning)(
                    "streaming snapshot step %d to the peer at %s:%d failed: %r",
                    step, *self.peer, e)
                self._warned = True
            finally:
                with self._cond:
                    self._busy, self._sending = False, None
                    self._cond.notify_all()

    def _send(self, step: int, path: str) -> None:
        try:
            with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
                manifest_bytes = f.read()
            names = list(Manifest.from_json(manifest_bytes.decode("utf-8")).files)
            files = [open(os.path.join(path, n), "rb") for n in names]  # noqa: SIM115
        except FileNotFoundError:
            return  # replaced by a newer snapshot meanwhile, which will be offered
        try:
            sizes = [os.fstat(f.fileno()).st_size for f in files]
            header: dict[str, Any] = {
                "run": self.run, "to": self.to, "source": self.source, "step": step,
                "nonce": secrets.token_hex(16),
                "files": [[n, s] for n, s in zip(names, sizes)] + [[MANIFEST_NAME,
                                                                     len(manifest_bytes)]],
            }
            conn, reply = self._open(header)
            with conn:
                go, _, proof = reply.partition(" ")
                if go != "go":
                    raise RuntimeError(f"the peer refused the replica: {reply}")
                if not hmac.compare_digest(proof.encode(), receiver_proof(
                        self.token, sender_nonce=header["nonce"],
                        nonce=self._greeting).encode()):
                    raise RuntimeError("the peer did not prove the group's token: nothing "
                                       "was sent to it")
                # one deadline for the whole stream, at a floor of MIN_RATE bytes/s: a
                # peer that reads a byte now and then cannot hold the thread
                deadline = time.monotonic() + IO_TIMEOUT_S + (
                    sum(sizes) + len(manifest_bytes)) / MIN_RATE
                mac = content_mac(self.token, sender_nonce=header["nonce"],
                                  nonce=self._greeting)
                buf = memoryview(bytearray(_CHUNK))
                for f, size in zip(files, sizes):
                    _send_file(conn, f, size, deadline, mac, buf)
                mac.update(manifest_bytes)
                conn.settimeout(max(0.05, deadline - time.monotonic()))
                conn.sendall(manifest_bytes + b"mac " + mac.hexdigest().encode() + b"\n")
                reply = _recv_line(conn, 2000, deadline).decode(errors="replace")
        finally:
            for f in files:
                f.close()
        ok, _, done = reply.partition(" ")
        if ok != "ok":
            raise RuntimeError(f"the peer refused the replica: {reply}")
        if not hmac.compare_digest(done.encode(), committed_proof(
                self.token, sender_nonce=header["nonce"], nonce=self._greeting,
                step=step).encode()):
            raise RuntimeError("the peer's answer that it committed the replica does not "
                               "prove the group's token: not counted as sent")
        _note(self.sent, step)
        log.debug("snapshot step %d replicated to %s:%d", step, *self.peer)

    def _open(self, header: dict[str, Any]) -> tuple[socket.socket, str]:
        """A connection whose header (signed for the receiver's greeting) the receiver
        answered, and the answer; the greeting's nonce is in ``_greeting``.

        Tried again, on a fresh connection, until :data:`CONNECT_DEADLINE_S` (each try
        bounded by it too): a receiver busy with a flood of strangers stops accepting
        for a moment, and a connection that waits in its full listen queue (or whose
        handshake the kernel dropped) would otherwise wait out TCP's one-second
        retransmission."""
        deadline = time.monotonic() + CONNECT_DEADLINE_S
        wait = 0.25  # for the answer: grows per try, for a receiver that is just slow
        while True:
            left = deadline - time.monotonic()
            conn = None
            try:
                conn = socket.create_connection(
                    self.peer, timeout=max(0.05, min(left, wait)),
                    source_address=None if self.bind is None else (self.bind, 0))
                this_try = min(deadline, time.monotonic() + wait)
                hello, _, nonce = _recv_line(conn, 200, this_try).decode(
                    errors="replace").partition(" ")
                if hello != "hello" or not nonce:
                    raise ValueError(f"the peer's greeting is not one: {hello[:40]!r}")
                self._greeting = nonce
                conn.settimeout(max(0.05, this_try - time.monotonic()))
                conn.sendall(signed_header(header, token=self.token, nonce=nonce))
                return conn, _recv_line(conn, 2000, this_try).decode(errors="replace")
            except (OSError, ValueError) as e:
                if conn is not None:
                    conn.close()
                if time.monotonic() + 0.02 >= deadline:
                    raise ConnectionError(f"no answer from the peer at {self.peer[0]}:"
                                          f"{self.peer[1]} within {CONNECT_DEADLINE_S:g} s: "
                                          f"{e!r}") from e
                wait = min(2 * wait, 2.0)
                time.sleep(0.02)

    def wait_not_sending(self, step: int, timeout: float) -> bool:
        """Wait until snapshot ``step`` is not being streamed (and no longer offered);
        whether that happened within ``timeout`` seconds. Its file may then be reused:
        a stream reads the files it opened, whatever their names are by then."""
        with self._cond:
            if self._offered is not None and self._offered[0] == step:
                self._offered = None  # superseded by the newer one about to be offered
            return self._cond.wait_for(lambda: self._sending != step, timeout=timeout)

    def flush(self, timeout: float = IO_TIMEOUT_S) -> bool:
        """Wait until the snapshot offered last is sent (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._offered is None and not self._busy,
                                       timeout=timeout)

    def close(self, timeout: float = IO_TIMEOUT_S) -> None:
        """Send what was offered last (waiting at most ``timeout`` s), then stop.

        ``timeout=0`` stops at once: a stream in flight is left to the daemon thread,
        which ends with the process (its peer keeps its previous replica)."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=min(timeout, 1.0))
