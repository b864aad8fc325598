"""Peer replicas: each node streams its committed snapshot into another node's memory.

Under data parallelism every node's own snapshot already holds the whole state, but a
node's snapshot is the only copy of whatever differs between nodes (a node that
joined late, a node whose snapshot write failed, state that is not replicated), and
it dies with the node. So each node's writer sends every snapshot it commits to the
next writer in ring order (global rank order of the nodes' local rank 0), over a TCP
side channel that carries no collective and never blocks training:

- :class:`ReplicaReceiver` (a daemon thread on each writer) accepts one stream at a
  time and commits it as ``<node dir>/replicas/<source node>/step-<n>/``: the files go
  into a ``.tmp-`` directory, the manifest last, and the directory is renamed into
  place, so a stream cut at any moment leaves the previous replica valid. Once a
  replica is committed every older one (of any source) is removed: a node holds one
  replica, plus the one being received.
- :class:`ReplicaSender` (a daemon thread on each writer) is offered each committed
  snapshot directory; it streams the newest one offered (an older one still waiting
  is skipped): a header line (run, token, source node, step, file names and sizes),
  which the receiver accepts (``go``) or refuses with a reason, then the files with
  ``sendfile``, manifest last, and waits for the receiver's ``ok``.

A stream carries a token rank 0 draws when the group forms and the run's directory
name, so the receiver ignores streams of another run or an older group. The bytes
are not trusted: a replica is loaded like any snapshot, after its manifest's
checksum verified.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import selectors
import shutil
import socket
import threading
import uuid
from typing import Any

from elastic_kit.store import (
    MANIFEST_NAME, TMP_PREFIX, Manifest, check_file_name, parse_step_dir, step_dir_name,
)

__all__ = ["ADDR_ENV", "REPLICAS", "ReplicaReceiver", "ReplicaSender", "advertised_host"]

log = logging.getLogger(__name__)

#: Environment variable: the address a node's receiver listens on and its peers
#: connect to (default: this host's address on the route to ``MASTER_ADDR``).
ADDR_ENV = "ELASTIC_KIT_SNAPSHOT_ADDR"
#: Name of the directory, inside a node's snapshot directory, holding replicas.
REPLICAS = "replicas"
_MAX_HEADER = 64 << 10
_MAX_FILES = 64
_CHUNK = 4 << 20
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}", re.ASCII)
#: Seconds a connection may stay silent before it is dropped (either side).
IO_TIMEOUT_S = 60.0
_CONNECT_TIMEOUT_S = 5.0


def advertised_host() -> str:
    """The address this node's receiver listens on: ``$ELASTIC_KIT_SNAPSHOT_ADDR``, else
    the local address of the route to ``MASTER_ADDR`` (the interface the process
    group already uses), else the host name's address."""
    given = os.environ.get(ADDR_ENV)
    if given:
        return given
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT") or 29500)))  # no packet
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


#: Entries the ``received``/``sent`` histories keep (a run may snapshot every step).
_HISTORY = 16


def _note(history: list[Any], item: Any) -> None:
    history.append(item)
    del history[:-_HISTORY]


def _recv_line(conn: socket.socket, limit: int) -> bytes:
    out = bytearray()
    while not out.endswith(b"\n"):
        c = conn.recv(1)
        if not c:
            raise ConnectionError("stream ended inside its header")
        out += c
        if len(out) > limit:
            raise ValueError(f"header longer than {limit} bytes")
    return bytes(out[:-1])


class ReplicaReceiver:
    """Accepts peers' snapshot streams into ``<node_dir>/replicas/`` (a daemon thread).

    Args:
        node_dir: this node's snapshot directory.
        run: the run's directory name; streams naming another run are refused.
        token: the group's token; streams carrying another token are refused.
        host: the address to listen on (port: any free one, see :attr:`port`).
    """

    def __init__(self, node_dir: str, *, run: str, token: str, host: str) -> None:
        self.dir = os.path.join(node_dir, REPLICAS)
        self.run, self.token = run, token
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(4)
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._warned = False
        #: the last steps committed, as ``(source, step)`` (for logs and tests)
        self.received: list[tuple[str, int]] = []
        self._thread = threading.Thread(target=self._serve, name="ek-replica-recv", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not sel.select(timeout=0.2):
                    continue
                try:
                    conn, _ = self._sock.accept()
                except OSError:
                    continue
                with conn:
                    conn.settimeout(IO_TIMEOUT_S)
                    try:
                        reply = self._receive(conn)
                    except Exception as e:  # a peer's failure never fails training
                        (log.debug if self._warned else log.warning)(
                            "receiving a snapshot replica into %s failed: %r", self.dir, e)
                        self._warned = True
                        reply = f"error: {e!r}"
                    try:
                        conn.sendall(reply.encode()[:1000] + b"\n")
                    except OSError:
                        pass

    def _receive(self, conn: socket.socket) -> str:
        header = json.loads(_recv_line(conn, _MAX_HEADER))
        if not isinstance(header, dict) or not hmac.compare_digest(
                str(header.get("token", "")), self.token):
            return "error: wrong token (another group's stream)"
        if header.get("run") != self.run:
            return f"error: run {header.get('run')!r} is not {self.run!r}"
        source, step, files = header.get("source"), header.get("step"), header.get("files")
        if not isinstance(source, str) or not _NAME_RE.fullmatch(source) or source in (".", ".."):
            raise ValueError(f"bad source node name {source!r}")
        if type(step) is not int or parse_step_dir(step_dir_name(step)) != step:
            raise ValueError(f"bad step {step!r}")
        if not isinstance(files, list) or not 0 < len(files) <= _MAX_FILES:
            raise ValueError(f"bad file list {files!r}")
        if not all(isinstance(f, list) and len(f) == 2 for f in files) \
                or files[-1][0] != MANIFEST_NAME:
            raise ValueError(f"bad file list {files!r}")
        names = [check_file_name(f[0]) for f in files[:-1]] + [MANIFEST_NAME]
        sizes = [f[1] for f in files]
        if len(set(names)) != len(names) or any(type(s) is not int or s < 0 for s in sizes):
            raise ValueError(f"bad file list {files!r}")
        root = os.path.join(self.dir, source)
        os.makedirs(root, exist_ok=True)
        free = shutil.disk_usage(root).free
        if free < sum(sizes):
            return (f"error: {root} has {free / 1e6:.0f} MB free, the replica needs "
                    f"{sum(sizes) / 1e6:.0f} MB")
        tmp = os.path.join(root, f"{TMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}")
        os.mkdir(tmp)
        conn.sendall(b"go\n")  # the header is accepted: the sender streams the files
        try:
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            for name, size in zip(names, sizes):
                with open(os.path.join(tmp, name), "wb") as f:
                    left = size
                    while left:
                        k = conn.recv_into(view[:min(left, _CHUNK)])
                        if k == 0:
                            raise ConnectionError(f"stream ended with {left} bytes of {name} "
                                                  "missing")
                        f.write(view[:k])
                        left -= k
            target = os.path.join(root, step_dir_name(step))
            if os.path.isdir(target):
                shutil.rmtree(target)  # the same step again (a re-sent stream)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._drop_older(source, step)
        _note(self.received, (source, step))
        log.debug("replica of node %s step %d committed in %s", source, step, root)
        return "ok"

    def _drop_older(self, source: str, step: int) -> None:
        """Keep one replica: the one just committed."""
        for src in os.listdir(self.dir):
            root = os.path.join(self.dir, src)
            for name in os.listdir(root) if os.path.isdir(root) else ():
                # one stream at a time: any other directory is older or a cut stream's
                if not (src == source and name == step_dir_name(step)):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            if src != source:
                try:
                    os.rmdir(root)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop accepting streams (a stream being received is finished first)."""
        self._stop.set()
        self._thread.join(timeout=IO_TIMEOUT_S)
        self._sock.close()


class ReplicaSender:
    """Streams this node's newest committed snapshot to its ring successor (a daemon
    thread); :meth:`offer` never blocks."""

    def __init__(self, peer: tuple[str, int], *, source: str, run: str, token: str) -> None:
        self.peer, self.source, self.run, self.token = peer, source, run, token
        self._cond = threading.Condition()
        self._offered: tuple[int, str] | None = None
        self._busy = False
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
                self._offered, self._busy = None, True
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
                    self._busy = False
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
                "token": self.token, "run": self.run, "source": self.source, "step": step,
                "files": [[n, s] for n, s in zip(names, sizes)] + [[MANIFEST_NAME,
                                                                     len(manifest_bytes)]],
            }
            with socket.create_connection(self.peer, timeout=_CONNECT_TIMEOUT_S) as conn:
                conn.settimeout(IO_TIMEOUT_S)
                conn.sendall(json.dumps(header).encode() + b"\n")
                reply = _recv_line(conn, 2000).decode(errors="replace")
                if reply != "go":
                    raise RuntimeError(f"the peer refused the replica: {reply}")
                for f, size in zip(files, sizes):
                    if conn.sendfile(f, 0, size) != size:
                        raise ConnectionError(f"sent less than the {size} bytes of {f.name}")
                conn.sendall(manifest_bytes)
                reply = _recv_line(conn, 2000).decode(errors="replace")
        finally:
            for f in files:
                f.close()
        if reply != "ok":
            raise RuntimeError(f"the peer refused the replica: {reply}")
        _note(self.sent, step)
        log.debug("snapshot step %d replicated to %s:%d", step, *self.peer)

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
