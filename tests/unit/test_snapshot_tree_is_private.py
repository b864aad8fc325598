"""The snapshot tree is the user's alone: a tree planted by another uid, a symlinked
node or replica directory and a group-writable directory are never read from or
written into; the user's own files are 0600 in 0700 directories."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

import elastic_kit as ek
from elastic_kit.snapshot import SnapshotTier, snapshot_dir
from elastic_kit.store import CheckpointStore

OTHER_UID = 1001
KEY = "/durable/run"
IDENTITY = "a" * 32


@pytest.fixture()
def shm(tmp_path: Path) -> str:
    """A root like /dev/shm: root-owned, world-writable and sticky."""
    root = tmp_path / "shm"
    root.mkdir()
    os.chmod(root, 0o1777)
    return str(root)


@pytest.fixture(autouse=True)
def _node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_NODE", "node0")


def _tier(shm: str) -> SnapshotTier:
    return SnapshotTier(KEY, info=ek.DistInfo(run_id="job"), every=1, root=shm,
                        identity=IDENTITY)


def _plant(node_dir: Path, step: int, value: float) -> Path:
    """A valid snapshot (of the right identity) at ``node_dir``, as another user would."""
    with CheckpointStore(str(node_dir), keep_last=None) as store:
        store.save({"w": torch.full((100,), value)}, step=step,
                   metadata={"elastic_kit_run_identity": IDENTITY})
    return node_dir / f"step-{step:012d}"


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every entry below ``path``: (owner, mode)."""
    return {str(p.relative_to(path)): (p.lstat().st_uid, stat.S_IMODE(p.lstat().st_mode))
            for p in sorted(path.rglob("*"))}


def test_a_tree_planted_by_another_user_is_neither_read_nor_written(
        shm: str, caplog: pytest.LogCaptureFixture) -> None:
    run = Path(snapshot_dir(shm, "job", KEY))
    _plant(run / "node0", 999, 7.0)
    user_dir = run.parent
    for p in [user_dir, *user_dir.rglob("*")]:
        os.chown(p, OTHER_UID, OTHER_UID)
        os.chmod(p, 0o777 if p.is_dir() else 0o644)
    before = _tree(user_dir)
    with caplog.at_level("WARNING"):
        tier = _tier(shm)
    assert not tier.enabled and tier.newest_local() is None
    assert f"{user_dir} is owned by uid {OTHER_UID}" in caplog.text
    tier.save({"w": torch.zeros(10)}, step=1, metadata={})
    tier.close(remove=True)
    assert _tree(user_dir) == before                    # nothing written, nothing removed


def test_a_symlinked_node_directory_turns_snapshots_off_and_nothing_is_written_through_it(
        shm: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = Path(snapshot_dir(shm, "job", KEY))
    run.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    _plant(elsewhere, 999, 7.0)
    (run / "node0").symlink_to(elsewhere)
    with caplog.at_level("WARNING"):
        tier = _tier(shm)
    assert not tier.enabled and tier.newest_local() is None
    assert f"{run / 'node0'} is a symbolic link" in caplog.text
    tier.save({"w": torch.zeros(10)}, step=1, metadata={})
    assert sorted(p.name for p in elsewhere.iterdir()) == ["step-000000000999"]


def test_a_group_writable_directory_turns_snapshots_off(
        shm: str, caplog: pytest.LogCaptureFixture) -> None:
    run = Path(snapshot_dir(shm, "job", KEY))
    _plant(run / "node0", 999, 7.0)
    os.chmod(run, 0o770)
    with caplog.at_level("WARNING"):
        tier = _tier(shm)
    assert not tier.enabled and tier.newest_local() is None
    assert f"{run} is writable by group or others" in caplog.text


def test_a_root_anyone_can_write_without_the_sticky_bit_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with caplog.at_level("WARNING"):
        tier = _tier(str(root))
    assert not tier.enabled and "without the sticky bit" in caplog.text
    assert list(root.iterdir()) == []


def test_a_symlinked_replica_directory_is_never_restored(shm: str, tmp_path: Path) -> None:
    tier = _tier(shm)
    assert tier.enabled
    _plant(tmp_path / "evil", 999, 7.0)
    replicas = Path(tier.node_dir, "replicas")
    replicas.mkdir(mode=0o700)
    (replicas / "evil").symlink_to(tmp_path / "evil")
    assert tier.newest_local() is None
    assert tier.load() is None
    tier.close(remove=True)


def test_own_snapshots_are_0600_files_in_0700_directories_of_this_user(shm: str) -> None:
    tier = _tier(shm)
    tier.save({"w": torch.arange(100.0)}, step=3, metadata={})
    tier.close(remove=False)
    user_dir = Path(snapshot_dir(shm, "job", KEY)).parent
    tree = _tree(user_dir)
    assert tree and all(owner == os.geteuid() for owner, _ in tree.values())
    modes = {name: mode for name, (_, mode) in tree.items()}
    assert {m for n, m in modes.items() if (user_dir / n).is_dir()} == {0o700}
    assert {m for n, m in modes.items() if not (user_dir / n).is_dir()} == {0o600}
    assert stat.S_IMODE(user_dir.stat().st_mode) == 0o700
    assert tier.newest_local() == 3
    tier.close(remove=True)
    # a finished run leaves nothing but this user's (empty) directory: were it
    # removed, another user could make one of its name and switch snapshots off
    assert os.listdir(shm) == [user_dir.name] and os.listdir(user_dir) == []
    assert stat.S_IMODE(user_dir.stat().st_mode) == 0o700
