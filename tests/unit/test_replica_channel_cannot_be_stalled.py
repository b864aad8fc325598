"""No stranger can stall the replica channel: an idle connection neither holds a
legitimate stream nor the receiver's close(); header and progress deadlines drop
silent clients; wrong-token floods are refused cheaply; a failed stream leaves
nothing; names and sizes are checked before anything is made. Real sockets on
loopback, bounds generous (no timing thresholds)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_kit.snapshot import _replica
from elastic_kit.snapshot._replica import ReplicaReceiver, ReplicaSender
from elastic_kit.store import CheckpointStore
from tests.replica_wire import greeted, open_stream, read_all, read_line, send_header, trailer

TOKEN = "t0ken"


def _snapshot(root: Path, step: int) -> Path:
    with CheckpointStore(str(root), keep_last=None) as store:
        store.save({"w": torch.full((5000,), float(step))}, step=step)
    return root / f"step-{step:012d}"


@pytest.fixture()
def receiver(tmp_path: Path):  # type: ignore[no-untyped-def]
    r = ReplicaReceiver(str(tmp_path / "peer"), run="run-1", token=TOKEN, host="127.0.0.1")
    yield r
    r.close()


def _connect(r: ReplicaReceiver) -> socket.socket:
    return socket.create_connection((r.host, r.port), timeout=30)


def _leftovers(r: ReplicaReceiver) -> list[str]:
    return sorted(p.name for p in Path(r.dir).rglob(".tmp-*")) if Path(r.dir).exists() else []


def test_a_replica_arrives_while_an_idle_connection_is_held(
        tmp_path: Path, receiver: ReplicaReceiver) -> None:
    idle = _connect(receiver)                          # says nothing, stays open
    half, _ = greeted(receiver)
    half.sendall(b'{"run": "run-1", "mac"')            # half a header, then silence
    try:
        sender = ReplicaSender((receiver.host, receiver.port), to=receiver.ident, source="nodeA", run="run-1",
                               token=TOKEN)
        sender.offer(5, str(_snapshot(tmp_path / "own", 5)))
        assert sender.flush(timeout=60)
        sender.close()
        assert sender.sent == [5] and receiver.received == [("nodeA", 5)]
    finally:
        idle.close()
        half.close()


def test_a_silent_client_is_dropped_at_the_header_deadline(
        receiver: ReplicaReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_replica, "HEADER_TIMEOUT_S", 0.3)
    with _connect(receiver) as idle:
        assert read_line(idle).startswith(b"hello ")
        reply = read_all(idle)                        # the receiver hangs up on it
    assert reply.startswith(b"error: timed out: no header within")
    assert receiver.refused == 1


def test_a_stalled_stream_is_dropped_and_leaves_nothing(
        receiver: ReplicaReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_replica, "PROGRESS_TIMEOUT_S", 0.3)
    header = {"run": "run-1", "source": "nodeA", "step": 6,
              "files": [["state.pt", 1000], ["manifest.json", 10]]}
    with send_header(receiver, header, TOKEN) as conn:
        conn.sendall(b"x" * 100)
        assert read_line(conn).startswith(b"go ")
        out = read_all(conn)
    assert out.startswith(b"error: timed out: no progress")
    assert _leftovers(receiver) == [] and receiver.received == []


def test_close_returns_whatever_clients_do_and_removes_a_stream_in_flight(
        tmp_path: Path) -> None:
    r = ReplicaReceiver(str(tmp_path / "peer"), run="run-1", token=TOKEN, host="127.0.0.1")
    idle = _connect(r)
    header = {"run": "run-1", "source": "nodeA", "step": 6,
              "files": [["state.pt", 10**6], ["manifest.json", 10]]}
    mid = send_header(r, header, TOKEN)
    mid.sendall(b"x" * 1000)
    assert read_line(mid).startswith(b"go ")
    closer = threading.Thread(target=r.close)
    closer.start()
    closer.join(timeout=30)                           # generous: the bound is about 1 s
    try:
        assert not closer.is_alive(), "close() waited for its clients"
        assert _leftovers(r) == []
        try:                                          # the stream in flight was dropped
            rest = mid.recv(100)                      # (reset: bytes of it unread)
        except ConnectionResetError:
            rest = b""
        assert rest == b""
    finally:
        idle.close()
        mid.close()


def test_a_flood_of_wrong_tokens_is_refused_and_a_legit_stream_still_lands(
        tmp_path: Path, receiver: ReplicaReceiver) -> None:
    wrong = json.dumps({"mac": "nope", "run": "run-1"}).encode() + b"\n"
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection((receiver.host, receiver.port),
                                              timeout=2) as c:
                    c.sendall(wrong)
                    sent[0] += 1
            except OSError:
                pass

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        sender = ReplicaSender((receiver.host, receiver.port), to=receiver.ident, source="nodeA", run="run-1",
                               token=TOKEN)
        for step in (1, 2, 3):
            sender.offer(step, str(_snapshot(tmp_path / "own", step)))
            assert sender.flush(timeout=60)
        sender.close()
    finally:
        stop.set()
        flooder.join()
    assert sender.sent == [1, 2, 3]
    assert receiver.received == [("nodeA", 1), ("nodeA", 2), ("nodeA", 3)]
    assert receiver.refused > 0 and sent[0] > 0


def _refusal(r: ReplicaReceiver, header: dict[str, Any]) -> bytes:
    with send_header(r, header, TOKEN) as conn:
        return read_all(conn)


@pytest.mark.parametrize("change, says", [
    ({"source": "..."}, b"bad source node name"),
    ({"source": ".hidden"}, b"bad source node name"),
    ({"files": [["state.pt", 2**70], ["manifest.json", 2]]}, b"bad size"),
    ({"files": [["state.pt", 1.5], ["manifest.json", 2]]}, b"bad size"),
    ({"step": 10**30}, b"bad step"),
])
def test_names_and_sizes_are_refused_before_any_directory_is_made(
        receiver: ReplicaReceiver, change: dict[str, Any], says: bytes) -> None:
    header = {"run": "run-1", "source": "nodeA", "step": 6,
              "files": [["state.pt", 3], ["manifest.json", 2]], **change}
    reply = _refusal(receiver, header)
    assert reply.startswith(b"error: " + says), reply
    assert not Path(receiver.node_dir).exists()


def test_a_stream_whose_manifest_does_not_validate_leaves_nothing(
        receiver: ReplicaReceiver) -> None:
    header = {"run": "run-1", "source": "nodeA", "step": 6,
              "files": [["state.pt", 4], ["manifest.json", 7]]}
    conn, mac = open_stream(receiver, header, TOKEN)
    with conn:
        assert read_line(conn).startswith(b"go ")
        conn.sendall(trailer(mac, b"abcd" + b"garbage"))
        out = read_all(conn)
    assert out.startswith(b"error: the streamed manifest does not validate"), out
    assert receiver.received == [] and _leftovers(receiver) == []
    assert list(Path(receiver.dir, "nodeA").iterdir()) == []


def test_a_connection_from_an_address_outside_the_group_is_closed_unread(
        tmp_path: Path, receiver: ReplicaReceiver) -> None:
    """Once the group's writers are known, a stranger on another address is hung up
    on before it can send a byte, even with the right token; the writers' streams
    (bound to their advertised address) still arrive."""
    from elastic_kit.snapshot._replica import writer_addresses

    receiver.peers = writer_addresses(["127.0.0.1"])
    assert receiver.peers == frozenset({"127.0.0.1"})
    header = {"mac": "0" * 64, "run": "run-1", "source": "nodeX", "step": 9,
              "files": [["state.pt", 10], ["manifest.json", 10]]}
    with socket.create_connection((receiver.host, receiver.port), timeout=30,
                                  source_address=("127.0.0.2", 0)) as stranger:
        try:
            stranger.sendall(json.dumps(header).encode() + b"\n")
            reply = stranger.recv(200)
        except ConnectionError:
            reply = b""
    assert reply == b""                                # closed, no "go", no error text
    assert receiver.refused == 1 and not Path(receiver.dir).exists()
    sender = ReplicaSender((receiver.host, receiver.port), to=receiver.ident, source="nodeA", run="run-1",
                           token=TOKEN, bind="127.0.0.1")
    sender.offer(5, str(_snapshot(tmp_path / "own", 5)))
    assert sender.flush(timeout=60)
    sender.close()
    assert sender.sent == [5] and receiver.received == [("nodeA", 5)]


def test_writer_addresses_normalise_and_give_up_on_wildcards_and_names() -> None:
    from elastic_kit.snapshot._replica import writer_addresses

    assert writer_addresses(["10.0.0.1", "::ffff:10.0.0.2", "fe80::1"]) == frozenset(
        {"10.0.0.1", "10.0.0.2", "fe80::1"})
    assert writer_addresses(["10.0.0.1", "0.0.0.0"]) is None
    assert writer_addresses(["10.0.0.1", "node-3.cluster"]) is None
