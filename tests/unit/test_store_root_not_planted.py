"""A local store in a world-writable sticky directory (``/tmp``) is the user's own:
a directory another user made there first (to plant checkpoints a run resumes from,
or to read them) is refused, and one the store makes there is 0700. A directory of
another user elsewhere (a team's share) is used as before."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from elastic_kit.store import CheckpointStore

OTHER_UID = 1001

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture()
def tmp(tmp_path: Path) -> Path:
    """A directory like /tmp: world-writable and sticky."""
    root = tmp_path / "tmp"
    root.mkdir()
    os.chmod(root, 0o1777)
    return root


def _plant(path: Path) -> None:
    """What another user does first: the directory, with a checkpoint of theirs."""
    CheckpointStore(str(path)).save({"w": torch.full((2,), 7.0)}, step=5)
    for p in [path, *path.rglob("*")]:
        os.chown(p, OTHER_UID, OTHER_UID, follow_symlinks=False)
    os.chmod(path, 0o755)


@pytest.mark.parametrize("how", ["root", "parent", "symlink"])
def test_a_directory_another_user_made_first_is_refused(tmp: Path, how: str) -> None:
    if how == "root":
        _plant(tmp / "run")
        url = tmp / "run"
    elif how == "parent":
        (tmp / "team").mkdir()
        _plant(tmp / "team" / "run")
        os.chown(tmp / "team", OTHER_UID, OTHER_UID)
        url = tmp / "team" / "run"
    else:
        theirs = tmp.parent / "theirs"
        _plant(theirs)
        (tmp / "run").symlink_to(theirs)
        os.chown(tmp / "run", OTHER_UID, OTHER_UID, follow_symlinks=False)
        url = tmp / "run"
    store = CheckpointStore(str(url))
    planted = str(url if how != "parent" else tmp / "team")
    with pytest.raises(PermissionError, match=rf"{planted} belongs to uid {OTHER_UID}, not "
                                              rf"to this user \(uid 0\), and sits in the "
                                              rf"world-writable {tmp}"):
        store.load()
    with pytest.raises(PermissionError, match=f"belongs to uid {OTHER_UID}"):
        store.save({"w": torch.zeros(2)}, step=6)
    store.close()


def test_a_store_made_in_a_world_writable_directory_is_private(tmp: Path) -> None:
    store = CheckpointStore(str(tmp / "a" / "b" / "run"))
    store.save({"w": torch.ones(2)}, step=1)
    assert stat.S_IMODE(os.stat(tmp / "a").st_mode) == 0o700
    assert store.load().step == 1
    store.close()


def test_another_users_directory_outside_a_sticky_one_is_used(tmp_path: Path) -> None:
    share = tmp_path / "share"
    share.mkdir(mode=0o777)
    os.chown(share, OTHER_UID, OTHER_UID)
    store = CheckpointStore(str(share / "run"))
    store.save({"w": torch.ones(2)}, step=1)
    assert store.load().step == 1
    store.close()


def test_a_store_directory_every_user_may_write_in_is_refused(tmp: Path,
                                                              tmp_path: Path) -> None:
    """/tmp itself as the store (pytorch/elastic's --checkpoint-file /tmp/x.pth.tar
    would make it that), or a 0777 directory: anyone could add a newer step."""
    for root in (tmp, tmp_path / "open"):
        root.mkdir(exist_ok=True)
        if root != tmp:
            os.chmod(root, 0o777)
        with pytest.raises(PermissionError, match=rf"{root} is writable by every user"):
            CheckpointStore(str(root)).save({"w": torch.ones(2)}, step=1)
        assert not any(p.name.startswith("step-") for p in root.iterdir())
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(PermissionError, match=r"open is writable by every user without the "
                                              r"sticky bit"):
        CheckpointStore(str(tmp_path / "open" / "run")).load()


def test_no_directory_the_store_makes_is_writable_by_every_user(tmp_path: Path) -> None:
    old = os.umask(0)  # a container's umask may be 0
    try:
        store = CheckpointStore(str(tmp_path / "a" / "run"))
        store.save({"w": torch.ones(2)}, step=1)
        store.save({"w": torch.ones(2)}, step=2)
        assert store.load().step == 2
        store.close()
    finally:
        os.umask(old)
    dirs = [tmp_path / "a", *(p for p in (tmp_path / "a").rglob("*") if p.is_dir())]
    assert len(dirs) >= 3
    assert all(not p.stat().st_mode & stat.S_IWOTH for p in dirs), [
        (str(p), oct(p.stat().st_mode)) for p in dirs]


def test_a_step_directory_that_is_a_link_is_skipped_with_a_warning(
        tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging
    import os

    import torch

    from elastic_kit.store import CheckpointStore

    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root), keep_last=None)
    for step in (1, 2):
        store.save({"w": torch.full((2,), float(step))}, step=step)
    store.close()
    moved = tmp_path / "elsewhere"
    os.rename(root / "step-000000000002", moved)
    os.symlink(moved, root / "step-000000000002")
    caplog.set_level(logging.WARNING)
    again = CheckpointStore(str(root))
    loaded = again.load()
    assert loaded is not None and loaded.step == 1
    warned = [r.getMessage() for r in caplog.records if "not a directory" in r.getMessage()]
    assert len(warned) == 1 and "step-000000000002" in warned[0], warned
    assert [i.step for i in again.list()] == [1]
    assert len([r for r in caplog.records if "not a directory" in r.getMessage()]) == 1
    again.close()
