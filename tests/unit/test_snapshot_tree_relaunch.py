"""The snapshot tree across launches and stores: a relaunched agent on the same host
restores from its predecessor's node directory and then removes it; a relative store
URL names one store, not one per working directory; a replica stream never follows a
tree planted after the run made its own."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import elastic_kit as ek
from elastic_kit.snapshot import SnapshotTier, snapshot_dir
from elastic_kit.snapshot._leftovers import host_node_name
from elastic_kit.snapshot._private import user_dir_name
from elastic_kit.snapshot._replica import ReplicaReceiver
from tests.replica_wire import read_all, send_header

DEAD_PID = 2**22 + 7  # above Linux's largest pid: never alive
IDENTITY = "b" * 32


def _tier(shm: str) -> SnapshotTier:
    return SnapshotTier("/durable/run", info=ek.DistInfo(run_id="job"), every=1, root=shm,
                        identity=IDENTITY, replicate=False)


def test_a_relaunched_agent_restores_from_the_gone_agents_node_directory(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_NODE", host_node_name(DEAD_PID))
    first = _tier(shm)
    first.save({"w": torch.full((100,), 7.0)}, step=9, metadata={})
    assert first.wait(timeout=60)
    first.close(remove=False)                       # the job is killed, then relaunched
    old = Path(first.node_dir)
    monkeypatch.delenv("ELASTIC_KIT_SNAPSHOT_NODE")
    again = _tier(shm)
    try:
        assert Path(again.node_dir).name == host_node_name(os.getppid())
        loaded = again.load()
        assert loaded is not None and loaded.step == 9
        assert again.loaded_own                      # this host's memory, not a peer's
        assert torch.equal(loaded.state["w"], torch.full((100,), 7.0))
        assert old.exists()                          # until this node has a snapshot
        again.save({"w": torch.full((100,), 8.0)}, step=10, metadata={})
        assert again.wait(timeout=60)
        assert not old.exists() and again.newest_local() == 10
    finally:
        again.close(remove=True)


def test_a_relative_store_url_names_one_store(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    in_a = snapshot_dir("/dev/shm", "none", "ckpt")
    assert in_a == snapshot_dir("/dev/shm", "none", str(tmp_path / "a" / "ckpt"))
    monkeypatch.chdir(tmp_path / "b")
    assert snapshot_dir("/dev/shm", "none", "ckpt") != in_a


def test_a_replica_stream_never_follows_a_tree_planted_after_it_was_made(
        tmp_path: Path) -> None:
    """The tree is removed while the run lives (a cleanup, a logout's IPC removal) and
    planted again with the node directory a symlink to another directory of this
    user's: the next stream is refused, and nothing is made or changed there."""
    root = tmp_path / "shm"
    root.mkdir()
    os.chmod(root, 0o1777)
    parts = [user_dir_name(), "job-1234", "node1"]
    node = root.joinpath(*parts)
    node.mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    os.chmod(victim, 0o755)
    token = "t" * 32
    r = ReplicaReceiver(str(node), run="run-1", token=token, host="127.0.0.1",
                        tree=(str(root), parts))
    try:
        shutil.rmtree(root / parts[0])
        node.parent.mkdir(parents=True)
        node.symlink_to(victim)
        with send_header(r, {"run": "run-1", "source": "node0", "step": 7,
                             "files": [["state.pt", 10], ["manifest.json", 10]]},
                         token) as conn:
            reply = read_all(conn)
        assert reply.startswith(b"error: ") and b"symbolic link" in reply
        assert os.listdir(victim) == [] and (victim.stat().st_mode & 0o777) == 0o755
    finally:
        r.close()


def test_a_gone_agents_node_directory_is_stale_though_its_pid_was_reused(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container restarted in its pod gets the same pids again while its /dev/shm
    lives on: a node directory names its agent by pid and start time, so one whose
    pid a later process holds is still an earlier launch's (a restore source, then
    removed), not a live node's kept forever."""
    from elastic_kit.snapshot._leftovers import host_node_alive, host_node_owner
    from elastic_kit.snapshot._slots import process_start

    pid, start = os.getpid(), process_start(os.getpid())
    assert start is not None
    own = host_node_name(pid)
    assert host_node_owner(own) == (pid, start) and host_node_alive(own)
    earlier = own.rsplit("_", 1)[0] + f"_{start - 1}"  # same pid, an earlier process
    assert host_node_owner(earlier) == (pid, start - 1) and not host_node_alive(earlier)
    assert host_node_owner(own.rsplit("_", 1)[0]) == (pid, None)  # a name without it

    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_NODE", earlier)
    first = _tier(shm)
    first.save({"w": torch.full((100,), 5.0)}, step=3, metadata={})
    assert first.wait(timeout=60)
    first.close(remove=False)
    old = Path(first.node_dir)
    monkeypatch.delenv("ELASTIC_KIT_SNAPSHOT_NODE")
    again = _tier(shm)
    try:
        assert Path(again.node_dir).name != old.name
        loaded = again.load()
        assert loaded is not None and loaded.step == 3 and again.loaded_own
        again.save({"w": torch.full((100,), 6.0)}, step=4, metadata={})
        assert again.wait(timeout=60)
        assert not old.exists()
    finally:
        again.close(remove=True)
