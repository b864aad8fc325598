"""A slot file names its process by pid and start time: a live process that reuses a
dead worker's pid (a container restarted in its pod gets the same pids, while its
``/dev/shm`` volume lives on) does not keep the dead worker's file alive."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import elastic_kit as ek
from elastic_kit.snapshot import SnapshotTier, remove_idle_runs, snapshot_runs
from elastic_kit.snapshot._private import user_dir_name
from elastic_kit.snapshot._slots import (
    owner_alive, process_start, remove_dead_slots, slot_owner,
)

OWN_START = process_start(os.getpid())


def _tier(shm: str) -> SnapshotTier:
    return SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)


def test_the_start_time_is_read_and_parsed_back_from_a_slot_name() -> None:
    assert isinstance(OWN_START, int) and OWN_START > 0
    assert process_start(1) is not None and process_start(1) <= OWN_START
    assert process_start(2**22 + 7) is None  # above pid_max: no such process
    assert slot_owner(f".slot-{os.getpid()}.{OWN_START}-abcd1234-2") == (os.getpid(), OWN_START)
    assert slot_owner(".slot-123-abcd1234-2") == (123, None)  # a name without it
    assert slot_owner(".slot-12x-abcd1234-2") is None and slot_owner("step-000000000001") is None
    assert owner_alive(os.getpid(), OWN_START) and owner_alive(os.getpid(), None)
    assert not owner_alive(os.getpid(), OWN_START + 1)  # the pid, reused by a later process


def test_the_slots_a_writer_makes_carry_its_start_time(shm: str) -> None:
    tier = _tier(shm)
    state = {"w": torch.randn(64, 64)}
    assert tier.prepare(state) and tier.wait(timeout=60)
    names = [p.name for p in Path(tier.write_dir).glob(".slot-*")]
    assert names and all(slot_owner(n) == (os.getpid(), OWN_START) for n in names), names
    tier.close(remove=True)


def test_a_dead_workers_slot_under_a_reused_pid_is_removed(tmp_path: Path) -> None:
    pid = os.getpid()  # alive: as if a new process had been given the dead worker's pid
    reused = tmp_path / f".slot-{pid}.{OWN_START - 1}-aaaa0000-1"
    own = tmp_path / f".slot-{pid}.{OWN_START}-bbbb0000-1"
    unknown = tmp_path / f".slot-{pid}-cccc0000-1"  # no start time: only the pid is asked
    for p in (reused, own, unknown):
        p.write_bytes(b"x")
    assert remove_dead_slots(str(tmp_path)) == 1
    assert not reused.exists() and own.exists() and unknown.exists()


def test_a_dead_workers_slot_under_a_reused_pid_is_claimed_by_the_restarted_writer(
        shm: str) -> None:
    tier = _tier(shm)
    node = Path(tier.write_dir)
    tier.close(remove=False)
    dead = node / f".slot-{os.getpid()}.{OWN_START - 1}-aaaa0000-1"
    dead.write_bytes(b"\xab" * (64 * 64 * 4))
    dead.chmod(0o600)
    inode = dead.stat().st_ino
    tier = _tier(shm)  # the restarted worker's (here: with the dead one's pid)
    assert not dead.exists()
    state = {"w": torch.randn(64, 64)}
    assert tier.prepare(state) and tier.wait(timeout=60)
    assert tier._slots is not None and tier._slots._slots[0].inode == inode
    tier.close(remove=True)


def test_a_run_whose_only_writer_pid_was_reused_is_idle_and_removed(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    run = root / user_dir_name() / "job-a-1111"
    (run / "node0").mkdir(parents=True)
    for d in (root, root / user_dir_name(), run, run / "node0"):
        d.chmod(0o700)
    (run / "node0" / f".slot-{os.getpid()}.{OWN_START - 1}-abcd1234-2").write_bytes(b"x")
    then = time.time() - 7200
    for p in [*run.rglob("*"), run]:
        os.utime(p, (then, then), follow_symlinks=False)
    assert [r.writers for r in snapshot_runs(str(root))] == [[]]
    assert [Path(r.path).name for r in remove_idle_runs(str(root), idle_s=3600)] == ["job-a-1111"]
    assert not run.exists()


def test_an_earlier_launchs_free_slot_is_claimed_and_counted_as_free_space(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same job launched again on this host: the earlier launch's node directory
    (named after its dead agent) keeps its dead writer's free slot file until the new
    writer's first snapshot removes that directory. Counted as used, it switched
    snapshots off on a /dev/shm with room for the state about four times."""
    import shutil

    from elastic_kit.snapshot._leftovers import host_node_name

    dead_agent = 2**22 + 7  # above pid_max: never alive
    monkeypatch.delenv("ELASTIC_KIT_SNAPSHOT_NODE")  # nodes named after their agents
    tier = _tier(shm)
    run_dir = Path(tier.run_dir)
    tier.close(remove=False)
    old_node = run_dir / host_node_name(dead_agent)
    old_node.mkdir(mode=0o700)
    size = 64 * 64 * 4
    dead = old_node / f".slot-{dead_agent}-aaaa0000-1"
    dead.write_bytes(b"\xab" * size)
    dead.chmod(0o600)
    inode = dead.stat().st_ino
    real = shutil.disk_usage
    free = real(shm).free
    # the tmpfs has just less free space than two snapshots need, beside the old file
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real(p)._replace(free=2 * size - 1 if p == shm else free))
    tier = _tier(shm)
    assert not dead.exists()
    state = {"w": torch.randn(64, 64)}
    assert tier.prepare(state) and tier.wait(timeout=60)
    assert tier.enabled
    assert tier._slots is not None and tier._slots._slots[0].inode == inode
    tier.close(remove=True)


def test_the_space_check_counts_the_files_aligned_size(
        shm: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Each tensor of a snapshot file starts aligned: 200 tensors of 12 bytes (2.4 KB of
    state) make a file of ~800 KB. Checked against the unaligned 2.4 KB, a tmpfs with
    room for that but not for the files passed the check, and the writer then found no
    room for a file and switched snapshots off later."""
    import logging
    import shutil

    from elastic_kit.store import plan_flat, split_state

    state = {f"t{i}": torch.zeros(3) for i in range(200)}
    file_size = plan_flat(split_state(state)[1]).size
    assert file_size >= 199 * 4096
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(
        free=file_size if p == shm else real(p).free))  # room for one file, not two
    tier = _tier(shm)
    try:
        with caplog.at_level(logging.WARNING, logger="elastic_kit.snapshot"):
            assert not tier.prepare(state)
        assert not tier.enabled
        need = 2.2 * file_size / 1e6
        assert f"two snapshots need {need:.1f} MB" in caplog.text
    finally:
        tier.close(remove=True)


def test_a_run_named_after_a_live_parent_that_is_no_agent_is_idle_and_removed(
        tmp_path: Path) -> None:
    """A run outside torchrun names its node after its parent (the shell that started
    ``python train.py``): once the run ended without close(), the live shell kept it
    "in use (agent pid ...)", and the command the warning gives to remove it
    (``snapshots --remove --idle-minutes 0``) removed nothing while that shell lived.
    For such a run only a live torchrun agent (or its fork server) counts."""
    from elastic_kit.snapshot._leftovers import host_node_name

    root = tmp_path / "shm"
    run = root / user_dir_name() / "local-2222"
    node = run / host_node_name(os.getpid())  # a live process, and no torchrun agent
    (node / "step-000000000010").mkdir(parents=True)
    (node / "step-000000000010" / "manifest.json").write_bytes(b"{}")
    for d in (root, root / user_dir_name(), run, node, node / "step-000000000010"):
        d.chmod(0o700)
    # under torchrun (another run id) a live parent counts, whatever its command
    # line (a launcher running torchrun's agent in its own process)
    job = root / user_dir_name() / "job-3333"
    (job / host_node_name(os.getpid())).mkdir(parents=True)
    for d in (job, job / host_node_name(os.getpid())):
        d.chmod(0o700)
    assert sorted((Path(r.path).name, r.agents) for r in snapshot_runs(str(root))) == [
        ("job-3333", [os.getpid()]), ("local-2222", [])]
    assert [Path(r.path).name for r in remove_idle_runs(str(root), idle_s=0)] == ["local-2222"]
    assert not run.exists() and job.exists()
