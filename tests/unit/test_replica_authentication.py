"""Both ends of the replica channel prove the group's token without sending it: a
receiver that has no token yet takes nothing, a stranger learns nothing about the run
from a refusal, and a stranger listening where the peer was (a port a dead receiver
freed) gets neither the token nor a byte of the snapshot. A peer that reads slowly
cannot hold the sender past its stream's deadline, and streams still arriving count
against the receiver's free space. Real sockets on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from elastic_kit.snapshot import _replica
from elastic_kit.snapshot._replica import ReplicaReceiver, ReplicaSender, receiver_proof
from elastic_kit.store import CheckpointStore
from tests.replica_wire import greeted, read_all, read_line, send_header

TOKEN = "s3cret-t0ken-of-the-group"


def _snapshot(root: Path, step: int) -> Path:
    with CheckpointStore(str(root), keep_last=None) as store:
        store.save({"w": torch.full((5000,), float(step))}, step=step)
    return root / f"step-{step:012d}"


def test_a_receiver_without_its_token_yet_takes_no_stream(tmp_path: Path) -> None:
    """Between a receiver's start and the group's exchange its token is empty: a stream
    signed with the empty key (anyone can make one) is refused, and nothing lands."""
    r = ReplicaReceiver(str(tmp_path / "peer"), run="run-1@ident", token="", host="127.0.0.1")
    try:
        sender = ReplicaSender((r.host, r.port), to=r.ident, source="evil", run="run-1@ident", token="")
        sender.offer(10**11 - 1, str(_snapshot(tmp_path / "own", 7)))
        assert sender.flush(timeout=60)
        sender.close()
        assert sender.sent == [] and r.received == []
        assert not Path(r.dir).exists()
        with send_header(r, {"run": "x", "source": "evil", "step": 1,
                             "files": [["manifest.json", 2]]}, "") as conn:
            reply = read_all(conn)
        assert reply.startswith(b"error: not ready") and b"run-1" not in reply
    finally:
        r.close()


def test_a_refusal_before_the_token_is_proven_says_nothing_of_the_run(tmp_path: Path) -> None:
    r = ReplicaReceiver(str(tmp_path / "peer"), run="run-1@ident", token=TOKEN,
                        host="127.0.0.1")
    try:
        for token, header in [("guess", {"run": "guess", "source": "x", "step": 1}),
                              (TOKEN[:-1], {"run": "guess", "source": "x", "step": 1})]:
            with send_header(r, header, token) as conn:
                reply = read_all(conn)
            assert reply.startswith(b"error: not authenticated"), reply
            assert b"run-1" not in reply and b"ident" not in reply
        conn, _ = greeted(r)                           # a header without any HMAC
        with conn:
            conn.sendall(json.dumps({"token": TOKEN, "run": "run-1@ident"}).encode() + b"\n")
            assert read_all(conn).startswith(b"error: not authenticated")
        assert r.received == [] and not Path(r.dir).exists()
    finally:
        r.close()


def test_a_stranger_on_the_peers_port_gets_neither_the_token_nor_the_snapshot(
        tmp_path: Path) -> None:
    """The stranger greets as a receiver would and answers "go" (it cannot prove the
    token): the sender stops before a byte of a file."""
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = squatter.accept()
        with conn:
            conn.settimeout(30)
            conn.sendall(b"hello " + b"0" * 32 + b"\n")
            header = read_line(conn)
            conn.sendall(b"go " + b"f" * 64 + b"\n")
            got.append(header + b"\n" + read_all(conn))

    thread = threading.Thread(target=serve)
    thread.start()
    src = _snapshot(tmp_path / "own", 5)
    sender = ReplicaSender(squatter.getsockname(), to="r" * 32, source="nodeA", run="run-1",
                           token=TOKEN)
    try:
        sender.offer(5, str(src))
        assert sender.flush(timeout=60)
    finally:
        sender.close()
        thread.join(timeout=60)
        squatter.close()
    assert sender.sent == []
    (data,) = got
    header = json.loads(data.split(b"\n", 1)[0])
    assert TOKEN.encode() not in data and "token" not in header
    assert data.split(b"\n", 1)[1] == b""              # no byte of any file
    assert (src / "state.pt").read_bytes()[:64] not in data


def test_a_peer_that_reads_slowly_cannot_hold_the_sender(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer (here one that knows the token) takes the files, then trickles its reply a
    byte at a time, each within the socket's timeout: the stream's deadline drops it."""
    monkeypatch.setattr(_replica, "IO_TIMEOUT_S", 0.5)
    peer = socket.socket()
    peer.bind(("127.0.0.1", 0))
    peer.listen(1)
    stop = threading.Event()

    def serve() -> None:
        conn, _ = peer.accept()
        with conn:
            conn.settimeout(30)
            conn.sendall(b"hello " + b"1" * 32 + b"\n")
            header = json.loads(read_line(conn))
            proof = receiver_proof(TOKEN, sender_nonce=header["nonce"], nonce="1" * 32)
            conn.sendall(f"go {proof}\n".encode())
            need = sum(size for _, size in header["files"])
            while need > 0:
                need -= len(conn.recv(min(need, 1 << 16)))
            while not stop.wait(0.3):
                try:
                    conn.sendall(b"o")                 # never the newline
                except OSError:
                    return

    thread = threading.Thread(target=serve)
    thread.start()
    sender = ReplicaSender(peer.getsockname(), to="r" * 32, source="nodeA", run="run-1", token=TOKEN)
    try:
        t0 = time.monotonic()
        sender.offer(5, str(_snapshot(tmp_path / "own", 5)))
        assert sender.flush(timeout=60)
        held = time.monotonic() - t0
    finally:
        stop.set()
        sender.close()
        thread.join(timeout=60)
        peer.close()
    assert sender.sent == [] and held < 30


def test_streams_still_arriving_count_against_the_free_space(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = ReplicaReceiver(str(tmp_path / "peer"), run="run-1", token=TOKEN, host="127.0.0.1")
    real = _replica.shutil.disk_usage
    monkeypatch.setattr(_replica.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=10_000))
    try:
        first = send_header(r, {"run": "run-1", "source": "nodeA.p0", "step": 3,
                                "files": [["state.pt", 6000], ["manifest.json", 10]]}, TOKEN)
        assert read_line(first).startswith(b"go ")
        first.sendall(b"x" * 100)                      # 5910 bytes still to come
        with send_header(r, {"run": "run-1", "source": "nodeA.p1", "step": 3,
                             "files": [["state.pt", 6000], ["manifest.json", 10]]},
                         TOKEN) as second:
            reply = read_all(second)
        assert reply.startswith(b"error: ") and b"beside the replicas arriving" in reply
        first.close()
    finally:
        r.close()
