"""The side channel that streams each node's snapshot into another node's memory:
committed atomically, one replica kept, foreign or malformed streams refused."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from elastic_kit.store import CheckpointStore
from elastic_kit.snapshot._replica import ReplicaReceiver, ReplicaSender
from tests.replica_wire import read_all, read_line, send_header

TOKEN = "t0ken"


def _snapshot(root: Path, step: int, value: float) -> Path:
    with CheckpointStore(str(root), keep_last=None) as store:
        store.save({"w": torch.full((1000,), value)}, step=step, metadata={"epoch": 0})
    return root / f"step-{step:012d}"


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture()
def receiver(tmp_path: Path):  # type: ignore[no-untyped-def]
    r = ReplicaReceiver(str(tmp_path / "peer"), run="run-1", token=TOKEN, host="127.0.0.1")
    yield r
    r.close()


def _send(receiver: ReplicaReceiver, step_dir: Path, step: int, *, source: str = "nodeA",
          run: str = "run-1", token: str = TOKEN) -> ReplicaSender:
    sender = ReplicaSender((receiver.host, receiver.port), to=receiver.ident, source=source, run=run, token=token)
    sender.offer(step, str(step_dir))
    assert sender.flush(timeout=30)
    sender.close()
    return sender


def _listing(receiver: ReplicaReceiver) -> dict[str, list[str]]:
    root = Path(receiver.dir)
    return {p.name: sorted(q.name for q in p.iterdir()) for p in sorted(root.iterdir())}


def test_a_committed_snapshot_arrives_byte_for_byte(tmp_path: Path,
                                                    receiver: ReplicaReceiver) -> None:
    src = _snapshot(tmp_path / "own", 5, 1.5)
    sender = _send(receiver, src, 5)
    assert sender.sent == [5] and receiver.received == [("nodeA", 5)]
    assert _listing(receiver) == {"nodeA": ["step-000000000005"]}
    assert _files(Path(receiver.dir, "nodeA", "step-000000000005")) == _files(src)
    # and it loads as a checkpoint, checksum verified
    loaded = CheckpointStore(str(Path(receiver.dir, "nodeA"))).load()
    assert loaded is not None and loaded.step == 5
    assert torch.equal(loaded.state["w"], torch.full((1000,), 1.5))


def test_one_replica_is_kept_the_newest(tmp_path: Path, receiver: ReplicaReceiver) -> None:
    _send(receiver, _snapshot(tmp_path / "a", 5, 1.0), 5, source="nodeA")
    _send(receiver, _snapshot(tmp_path / "a", 6, 2.0), 6, source="nodeA")
    assert _listing(receiver) == {"nodeA": ["step-000000000006"]}
    # after a restart the ring may put another node before this one
    _send(receiver, _snapshot(tmp_path / "b", 7, 3.0), 7, source="nodeB")
    assert _listing(receiver) == {"nodeB": ["step-000000000007"]}


@pytest.mark.parametrize("what", ["token", "run"])
def test_a_stream_of_another_group_or_run_is_refused(
        tmp_path: Path, receiver: ReplicaReceiver, what: str,
        caplog: pytest.LogCaptureFixture) -> None:
    src = _snapshot(tmp_path / "own", 5, 1.0)
    with caplog.at_level("WARNING"):
        sender = _send(receiver, src, 5, **{what: "other"})  # type: ignore[arg-type]
    assert sender.sent == [] and receiver.received == []
    assert not Path(receiver.dir).exists() or _listing(receiver) == {}
    assert "the peer refused the replica" in caplog.text


def _raw_stream(receiver: ReplicaReceiver, header: dict, body: bytes) -> bytes:
    """Send a header (signed with the group's token), then (when accepted) ``body`` and
    end the stream; the replies after the greeting."""
    with send_header(receiver, header, TOKEN, timeout=10) as conn:
        reply = read_line(conn) + b"\n"
        if reply.startswith(b"go "):
            conn.sendall(body)
            conn.shutdown(socket.SHUT_WR)  # the stream ends here, cut or not
        return reply + read_all(conn)


def test_a_cut_stream_leaves_the_previous_replica_valid(tmp_path: Path,
                                                        receiver: ReplicaReceiver) -> None:
    _send(receiver, _snapshot(tmp_path / "own", 5, 1.0), 5)
    before = _files(Path(receiver.dir, "nodeA", "step-000000000005"))
    src = _snapshot(tmp_path / "own", 6, 2.0)
    payload = (src / "state.pt").read_bytes()
    header = {"run": "run-1", "source": "nodeA", "step": 6,
              "files": [["state.pt", len(payload)], ["manifest.json", 100]]}
    reply = _raw_stream(receiver, header, payload[: len(payload) // 2])
    assert reply.startswith(b"go ") and b"\nerror:" in reply and b"stream ended" in reply
    assert _listing(receiver) == {"nodeA": ["step-000000000005"]}   # no step 6, no leftover
    assert _files(Path(receiver.dir, "nodeA", "step-000000000005")) == before


@pytest.mark.parametrize("files", [
    [["../escape", 3], ["manifest.json", 2]],     # a path out of the step directory
    [["state.pt", 3]],                            # no manifest last
    [["state.pt", -1], ["manifest.json", 2]],     # a negative size
])
def test_a_malformed_header_writes_nothing(tmp_path: Path, receiver: ReplicaReceiver,
                                           files: list) -> None:
    header = {"run": "run-1", "source": "nodeA", "step": 6, "files": files}
    reply = _raw_stream(receiver, header, b"abcde")
    assert reply.startswith(b"error:")
    assert receiver.received == []
    assert not (tmp_path / "escape").exists() and not (tmp_path / "peer" / "escape").exists()
    assert not Path(receiver.dir).exists() or all(v == [] for v in _listing(receiver).values())


def test_a_snapshot_replaced_before_it_was_sent_is_skipped_quietly(
        tmp_path: Path, receiver: ReplicaReceiver, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        sender = _send(receiver, tmp_path / "own" / "step-000000000005", 5)
    assert sender.sent == [] and receiver.received == [] and caplog.text == ""
