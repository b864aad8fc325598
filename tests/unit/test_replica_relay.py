"""A stream's bytes are bound to the receiver it is for and to the sender that signed
it. Another local user who listens on the port of a receiver that died can relay the
sender's stream to a live receiver of the same group (both ends' proofs pass through
it unchanged); and anyone on the path can change the bytes after the handshake. Both
are refused before a replica is committed, and the relay learns no byte of the
snapshot. Real sockets on loopback; the relay is a thread speaking the wire."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from elastic_kit.snapshot._replica import ReplicaReceiver, ReplicaSender
from elastic_kit.store import CheckpointStore
from tests.replica_wire import read_line

TOKEN = "the-group-token-of-the-relay-test"
RUN = "run-1@ident"


def _snapshot(root: Path, step: int, value: float) -> Path:
    with CheckpointStore(str(root), keep_last=None) as store:
        store.save({"w": torch.full((5000,), value)}, step=step)
    return root / f"step-{step:012d}"


class _Relay:
    """Listens where the sender connects; passes the greeting, the header and the
    ``go`` on unchanged between the sender and ``target``, then the rest through
    ``change`` (sender to receiver) and the receiver's last answer back through
    ``answer``. ``seen``: every byte the sender sent after its header; ``answered``:
    the receiver's last answer as it came."""

    def __init__(self, target: tuple[str, int], change: Callable[[bytes], bytes],
                 answer: Callable[[bytes], bytes] = lambda line: line) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.target, self.change, self.answer = target, change, answer
        self.seen = self.answered = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        snd, _ = self.sock.accept()
        with snd, socket.create_connection(self.target, timeout=30) as rcv:
            snd.settimeout(30)
            snd.sendall(read_line(rcv) + b"\n")          # the receiver's greeting
            rcv.sendall(read_line(snd) + b"\n")          # the sender's signed header
            go = read_line(rcv)
            snd.sendall(go + b"\n")
            if not go.startswith(b"go "):
                return
            body = b""
            while not body.endswith(b"\n"):              # files, manifest, trailer line
                chunk = snd.recv(1 << 16)
                if not chunk:
                    break
                body += chunk
            self.seen = body
            rcv.sendall(self.change(body))
            self.answered = read_line(rcv)
            snd.sendall(self.answer(self.answered) + b"\n")

    def close(self) -> None:
        self.thread.join(timeout=60)
        self.sock.close()


def _stream_through(relay_to: ReplicaReceiver, to: str, src: Path, step: int,
                    change: Callable[[bytes], bytes],
                    answer: Callable[[bytes], bytes] = lambda line: line,
                    ) -> tuple[ReplicaSender, _Relay]:
    relay = _Relay((relay_to.host, relay_to.port), change, answer)
    sender = ReplicaSender(relay.sock.getsockname(), to=to, source="nodeC", run=RUN,
                           token=TOKEN)
    try:
        sender.offer(step, str(src))
        assert sender.flush(timeout=60)
    finally:
        sender.close()
        relay.close()
    return sender, relay


def test_a_stream_for_a_dead_receiver_relayed_to_a_live_one_is_refused_unread(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = ReplicaReceiver(str(tmp_path / "nodeB"), run=RUN, token=TOKEN, host="127.0.0.1")
    dead.close()                                         # its port is anyone's now
    live = ReplicaReceiver(str(tmp_path / "nodeA"), run=RUN, token=TOKEN, host="127.0.0.1")
    try:
        src = _snapshot(tmp_path / "own", 9, 9.0)
        with caplog.at_level(logging.DEBUG, logger="elastic_kit.snapshot._replica"):
            sender, relay = _stream_through(live, dead.ident, src, 9, lambda b: b)
        assert sender.sent == [] and live.received == []
        assert relay.seen == b""                         # not a byte of a file
        assert "addressed to receiver" in caplog.text
        assert not Path(live.dir, "nodeC").exists() or list(Path(live.dir, "nodeC").iterdir()) == []
    finally:
        live.close()


def test_bytes_changed_on_the_way_are_refused_and_the_older_replica_stays(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    r = ReplicaReceiver(str(tmp_path / "nodeA"), run=RUN, token=TOKEN, host="127.0.0.1")
    try:
        first, relay = _stream_through(r, r.ident, _snapshot(tmp_path / "own", 4, 4.0), 4,
                                       lambda b: b)
        assert first.sent == [4] and r.received == [("nodeC", 4)]

        with caplog.at_level(logging.DEBUG, logger="elastic_kit.snapshot._replica"):
            second, relay = _stream_through(r, r.ident, _snapshot(tmp_path / "own", 7, 7.0),
                                            7, _flip_a_bit(7.0))
        assert relay.seen                                # the stream did go through it
        assert second.sent == [] and r.received == [("nodeC", 4)]
        assert "changed on the way" in caplog.text
        assert sorted(p.name for p in Path(r.dir, "nodeC").iterdir()) == ["step-000000000004"]
        loaded = CheckpointStore(str(Path(r.dir, "nodeC"))).load()
        assert loaded is not None and loaded.step == 4
        assert torch.equal(loaded.state["w"], torch.full((5000,), 4.0))
    finally:
        r.close()


def _flip_a_bit(value: float) -> Callable[[bytes], bytes]:
    def flip(body: bytes) -> bytes:                      # one bit of the tensor's bytes
        i = body.index(torch.full((1,), value).numpy().tobytes() * 4)
        return body[:i] + bytes([body[i] ^ 1]) + body[i + 1:]
    return flip


def test_a_refused_stream_is_not_counted_as_sent_whatever_the_path_answers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The receiver's final ``ok`` proves the token for this stream: someone on the
    path who changed the bytes cannot then tell the sender it was committed, neither
    with a bare ``ok`` nor with the receiver's ``ok`` of an earlier stream."""
    r = ReplicaReceiver(str(tmp_path / "nodeA"), run=RUN, token=TOKEN, host="127.0.0.1")
    try:
        first, relay = _stream_through(r, r.ident, _snapshot(tmp_path / "own", 4, 4.0), 4,
                                       lambda b: b)
        assert first.sent == [4] and relay.answered.startswith(b"ok ")
        earlier_ok = relay.answered
        for step, forged in ((7, b"ok"), (8, earlier_ok)):
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="elastic_kit.snapshot._replica"):
                sender, relay = _stream_through(
                    r, r.ident, _snapshot(tmp_path / "own", step, float(step)), step,
                    _flip_a_bit(float(step)), lambda line, forged=forged: forged)
            assert relay.answered.startswith(b"error: "), relay.answered
            assert sender.sent == [] and r.received == [("nodeC", 4)]
            assert "does not prove the group's token: not counted as sent" in caplog.text
    finally:
        r.close()


def test_a_file_cut_short_while_it_streams_fails_the_stream_not_the_process(
        tmp_path: Path) -> None:
    """The sender reads each piece (a mapped file cut short would kill the training
    process with SIGBUS when the HMAC read the missing pages)."""
    from elastic_kit.snapshot._replica import _send_file, content_mac

    path = tmp_path / "tensors"
    path.write_bytes(bytes(range(256)) * 256)  # 64 KiB
    near, far = socket.socketpair()
    got = bytearray()
    drain = threading.Thread(target=lambda: [got.extend(c) for c in iter(
        lambda: far.recv(1 << 16), b"")], daemon=True)
    drain.start()

    class CutAfterFirstPiece:
        def __init__(self) -> None:
            self.pieces = 0

        def settimeout(self, t: float) -> None:
            near.settimeout(t)

        def sendall(self, data: memoryview) -> None:
            near.sendall(data)
            self.pieces += 1
            if self.pieces == 1:
                os.truncate(path, 0)                     # cut short mid-stream

    mac = content_mac(TOKEN, sender_nonce="s" * 32, nonce="r" * 32)
    with open(path, "rb") as f, pytest.raises(ConnectionError,
                                              match=r"ended after 4096 of its 65536 bytes"):
        _send_file(CutAfterFirstPiece(), f, 65536, time.monotonic() + 30, mac,
                   memoryview(bytearray(4096)))
    near.close()
    drain.join(timeout=30)
    far.close()
    assert bytes(got) == bytes(range(256)) * 16          # the piece sent before the cut
