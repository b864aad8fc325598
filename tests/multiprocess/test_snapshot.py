"""In-memory snapshots: a restarted group resumes from the newest state in any tier
(this node's memory, a peer node's, the durable store), exactly."""

from __future__ import annotations

import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.snapshot import SnapshotTier, snapshot_dir
from elastic_kit.testing import spawn_multi_process
from tests.snapshot_tree import left_in
from tests.train_script import TrainConfig, train

N = 48
BATCH = 4


def _life(url: str, shm: str, crash_after: int | None, snapshot_every: int | None = 1,
          epochs: int = 2) -> TrainConfig:
    """An own loop with durable checkpoints far apart (every 10 steps) and a snapshot
    every step; 'crashes' (no close) after ``crash_after`` steps of this life."""
    return TrainConfig(url=url, dataset_size=N, target="x0", data_seed=5, sampler_seed=2,
                       epochs=epochs, batch_size=BATCH,
                       checkpoint={"every_steps": 10, "audit": True, "blocking": True,
                                   "snapshot_every": snapshot_every},
                       stop_after=crash_after, stop_how="kill", snapshot_dir=shm)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rank 0's result of an uninterrupted run (no snapshots, no restarts)."""
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "shm").mkdir()
    return spawn_multi_process(2, train, _life(str(tmp / "ref"), str(tmp / "shm"), None,
                                               None))[0]


@pytest.fixture()
def shm(tmp_path: Path) -> str:
    root = tmp_path / "shm"
    root.mkdir()
    return str(root)


def test_restart_resumes_from_memory_at_the_last_step_and_ends_bitwise_equal(
        tmp_path: Path, shm: str, reference: dict[str, Any]) -> None:
    url = str(tmp_path / "run")
    spawn_multi_process(2, train, _life(url, shm, 7, 1))        # durable: none yet (every 10)
    out = spawn_multi_process(2, train, _life(url, shm, None, 1))
    assert out[0]["restored"] == 7 and out[0]["restored_from"] == "memory"
    assert out[0]["step"] == reference["step"] == 12       # 2 epochs of 6 steps
    for a, b in zip(out[0]["params"], reference["params"]):
        np.testing.assert_array_equal(a, b)
    assert out[0]["audit"] == [(0, N, True), (1, N, True)]
    assert out[0]["report"]["world_sizes"][-1]["restored_from"] == "memory"
    # a finished run leaves nothing in shared memory
    assert left_in(shm) == []


def test_a_node_that_lost_its_memory_restores_from_a_peer_and_keeps_a_copy(
        tmp_path: Path, shm: str) -> None:
    url = str(tmp_path / "run")
    spawn_multi_process(2, train, _life(url, shm, 9, 1), local_world_size=1)   # two "nodes"
    run_dir = snapshot_dir(shm, "test", url)
    assert sorted(os.listdir(run_dir)) == ["node0", "node1"]
    shutil.rmtree(os.path.join(run_dir, "node0"))          # rank 0's node was replaced
    out = spawn_multi_process(2, train, _life(url, shm, 2, 1), local_world_size=1)
    assert out[0] == {"crashed_at": 11}
    steps = sorted(os.listdir(os.path.join(run_dir, "node0")))
    assert steps == ["replicas", "step-000000000011"]      # a copy, then its own snapshots
    assert os.listdir(os.path.join(run_dir, "node0", "replicas", "node1")) == [
        "step-000000000011"]                               # and node 1's, streamed here
    final = spawn_multi_process(2, train, _life(url, shm, None, 1), local_world_size=1)
    history = final[0]["report"]["world_sizes"]
    assert [h["restored_from"] for h in history] == [None, "peer", "memory"]
    assert [h["restored_step"] for h in history] == [None, 9, 11]
    assert final[0]["audit"] == [(0, N, True), (1, N, True)]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_each_node_streams_its_snapshot_into_the_next_nodes_memory(
        tmp_path: Path, shm: str) -> None:
    url = str(tmp_path / "run")
    spawn_multi_process(2, train, _life(url, shm, 9, 1), local_world_size=1)   # two "nodes"
    run = Path(snapshot_dir(shm, "test", url))
    step = "step-000000000009"
    for node, peer in (("node0", "node1"), ("node1", "node0")):
        replicas = run / peer / "replicas"
        assert [p.name for p in replicas.iterdir()] == [node]            # one replica each
        assert [p.name for p in (replicas / node).iterdir()] == [step]   # the newest only
        assert _files(replicas / node / step) == _files(run / node / step)


@pytest.mark.parametrize("damage", ["lost", "corrupt"])
def test_a_lost_node_is_restored_from_its_replica_on_the_survivor(
        tmp_path: Path, shm: str, damage: str, reference: dict[str, Any]) -> None:
    """Node 0 dies with its memory; the survivor's own snapshot is gone (or corrupt),
    so the newest state exists only as node 0's replica in the survivor's memory."""
    url = str(tmp_path / "run")
    spawn_multi_process(2, train, _life(url, shm, 9, 1), local_world_size=1)  # durable: none past 0
    run = Path(snapshot_dir(shm, "test", url))
    shutil.rmtree(run / "node0")                                         # the lost node
    own = run / "node1" / "step-000000000009"
    if damage == "lost":
        shutil.rmtree(own)
    else:
        payload = own / "state.pt"
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))
    out = spawn_multi_process(2, train, _life(url, shm, None, 1), local_world_size=1)
    history = out[0]["report"]["world_sizes"]
    assert [(h["restored_step"], h["restored_from"]) for h in history] == [
        (None, None), (9, "peer")]
    assert out[0]["step"] == reference["step"] == 12
    for a, b in zip(out[0]["params"], reference["params"]):
        np.testing.assert_array_equal(a, b)
    assert out[0]["audit"] == [(0, N, True), (1, N, True)]
    assert left_in(shm) == []                    # the finished run removed every replica


def test_a_corrupt_snapshot_is_skipped_for_the_durable_store(tmp_path: Path, shm: str) -> None:
    url = str(tmp_path / "run")
    spawn_multi_process(2, train, _life(url, shm, 11, 1))          # durable step 10, snapshot 11
    run_dir = snapshot_dir(shm, "test", url)
    payload = Path(run_dir, "node0", "step-000000000011", "state.pt")
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    out = spawn_multi_process(2, train, _life(url, shm, None, 1))
    assert out[0]["restored"] == 10 and out[0]["restored_from"] == "store"
    assert out[0]["audit"] == [(0, N, True), (1, N, True)]


def test_a_node_without_shared_memory_turns_snapshots_off_for_every_rank(
        tmp_path: Path) -> None:
    """Node 1 has no snapshot directory: the restore's collectives must still match,
    so every rank resumes from the durable store."""
    (tmp_path / "shm0").mkdir()
    shm = str(tmp_path / "shm{node}")                     # shm1 does not exist
    url = str(tmp_path / "run")
    spawn_multi_process(2, train, _life(url, shm, 9, 1), local_world_size=1, timeout=60)
    out = spawn_multi_process(2, train, _life(url, shm, None, 1), local_world_size=1,
                              timeout=60)
    history = out[0]["report"]["world_sizes"]
    assert [(h["restored_step"], h["restored_from"]) for h in history] == [
        (None, None), (6, "store")]                       # the epoch-end save
    assert out[0]["audit"] == [(0, N, True), (1, N, True)]


def test_too_little_shared_memory_falls_back_with_a_warning(
        tmp_path: Path, shm: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from elastic_kit.snapshot import _tier

    monkeypatch.setattr(_tier.shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10, 10, 0))  # type: ignore[attr-defined]
    tier = SnapshotTier(str(tmp_path / "run"), info=ek.DistInfo(run_id="t"), every=1, root=shm)
    with caplog.at_level("WARNING"):
        tier.save({"w": torch.zeros(1000)}, step=1, metadata={})
    assert not tier.enabled
    assert "in-memory snapshots are off" in caplog.text and "MB free" in caplog.text
    assert tier.newest_local() is None


def test_missing_root_switches_snapshots_off(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        tier = SnapshotTier("s3://b/run", info=ek.DistInfo(run_id="t"), every=1,
                            root=str(tmp_path / "nope"))
    assert not tier.enabled and "does not exist" in caplog.text


def test_snapshot_dirs_separate_runs_and_stores(tmp_path: Path) -> None:
    a = snapshot_dir("/dev/shm", "job-1", "s3://b/run")
    assert a == snapshot_dir("/dev/shm", "job-1", "s3://b/run")
    assert a != snapshot_dir("/dev/shm", "job-2", "s3://b/run")
    assert a != snapshot_dir("/dev/shm", "job-1", "s3://b/other")
    assert os.path.dirname(a) == f"/dev/shm/elastic_kit-{os.geteuid()}"  # per user


def test_automatic_interval_keeps_the_write_within_the_budget(tmp_path: Path, shm: str) -> None:
    tier = SnapshotTier(str(tmp_path / "run"), info=ek.DistInfo(run_id="t"), every=None,
                        budget=0.02, root=shm)
    assert tier.proposal(0.01) == 1   # no snapshot taken yet: every step
    tier._costs.extend([0.05])        # a 50 ms snapshot, 10 ms steps: 0.05 / (0.02 * 0.01)
    assert tier.proposal(0.01) == 250
    assert tier.proposal(None) == 250  # no step time: the last proposal
    tier._costs.extend([0.0001] * 5)  # a tiny state: every step
    assert tier.proposal(0.01) == 1
    tier._costs.append(0.5)           # one snapshot delayed by a busy core: the median
    assert tier.proposal(0.01) == 1
    tier._costs.extend([0.03 + 0.02] * 3)  # 30 ms on the training thread + a 20 ms write
    assert tier.proposal(0.01) == 250
    assert tier.proposal(0.02) == 125  # slower steps: the same budget in fewer steps


def test_closing_the_tier_stops_its_store_thread(tmp_path: Path, shm: str) -> None:
    """A closed tier leaves no thread behind: a process that makes many checkpointers
    (a notebook, a sweep, a test suite) would otherwise keep one idle thread per tier."""
    before = set(threading.enumerate())
    tier = SnapshotTier(str(tmp_path / "run"), info=ek.DistInfo(run_id="t"), every=1, root=shm)
    tier.save({"w": torch.arange(1000.0)}, step=1, metadata={})
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith("ek-ckpt")]
    assert started, "the snapshot was not written on the store's worker thread"
    tier.close(remove=False)
    assert [t for t in started if t.is_alive()] == []
    assert tier.newest_local() is not None  # closing without remove keeps the snapshot
    tier.close(remove=True)
    assert tier.newest_local() is None


def test_a_failing_worker_does_not_wait_for_its_stream_to_a_silent_peer(
        tmp_path: Path, shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost node's host may stop answering without closing its sockets: a stream to
    it then blocks until the socket times out. A worker whose group is failing (the
    checkpointer's close on an exception) closes its snapshots without waiting for
    that stream, whose exit would otherwise hold up the restart."""
    from elastic_kit.snapshot import _replica, _tier

    # as on a real network, where no reset comes back: a wait would hang the test
    monkeypatch.setattr(_tier, "FLUSH_TIMEOUT_S", 3600.0)
    monkeypatch.setattr(_replica, "IO_TIMEOUT_S", 3600.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    accepted: list[socket.socket] = []
    tier = SnapshotTier(str(tmp_path / "run"), info=ek.DistInfo(run_id="t"), every=1, root=shm)
    model = nn.Linear(2, 2)
    ckpt = ek.Checkpointer(ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                           str(tmp_path / "durable"), handle_signals=False, snapshot_every=0)
    ckpt.snapshots = tier
    try:
        tier.save({"w": torch.arange(1000.0)}, step=1, metadata={})
        tier.store.wait()
        sender = _replica.ReplicaSender(silent.getsockname(), to="r" * 32, source="node-a", run="t",
                                        token="x")
        tier._sender = sender
        sender.offer(1, tier.store.list()[-1].path)
        conn, _ = silent.accept()   # the stream is open; the peer never answers
        accepted.append(conn)
        assert not sender.flush(timeout=0.2)  # the sender is blocked on the silent peer
        closer = threading.Thread(target=ckpt.abandon)  # what an exception runs
        closer.start()
        closer.join(timeout=60)
        assert not closer.is_alive(), "the failing worker waited for the silent peer"
        assert tier.newest_local() == 1  # its snapshot stays for the restart
    finally:
        for c in accepted:
            c.close()   # the blocked stream fails now and its thread ends
        silent.close()
        tier.close(remove=True)
    assert tier.newest_local() is None
