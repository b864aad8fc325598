"""A save of many writers' parts that fails in its exchange (a peer died) gives its
staging directory back at once, and a directory fsync that fails (NFS's EIO) fails a
save before its commit, never after."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_kit.store import CheckpointStore
from elastic_kit.store import _backend_local
from elastic_kit.store._sharded import save_sharded


def _dead_peer(_: Any) -> Any:
    raise RuntimeError("the exchange's peer died")


@pytest.mark.parametrize("where", ["broadcast", "gather"])
def test_a_sharded_save_whose_exchange_fails_leaves_no_staging_directory(
        tmp_path: Path, where: str) -> None:
    store = CheckpointStore(str(tmp_path / "ck"))
    gather = _dead_peer if where == "gather" else (lambda mine: [mine])
    broadcast = _dead_peer if where == "broadcast" else (lambda header: header)
    with pytest.raises(RuntimeError, match="peer died"):
        save_sharded(store._layout, {"w": torch.ones(4), "step": 3}, step=3,
                     checksum="xxh3_128", metadata={}, rank=0, world_size=1,
                     gather=gather, broadcast=broadcast)
    assert sorted(os.listdir(tmp_path / "ck")) in ([], ["run-identity"])
    store.close()


def _fail_dir_fsync(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(err, os.strerror(err))
        real(fd)

    monkeypatch.setattr(_backend_local.os, "fsync", fsync)


def test_a_directory_fsync_error_fails_before_a_commit_and_is_logged_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _fail_dir_fsync(monkeypatch, errno.EIO)
    with pytest.raises(OSError):
        _backend_local.fsync_dir(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        _backend_local.fsync_dir(str(tmp_path), committed=True)
    assert "may not survive a crash" in caplog.text
    store = CheckpointStore(str(tmp_path / "ck"))
    with pytest.raises(OSError):
        store.save({"w": torch.ones(4)}, step=1)   # the payload's directory: before the commit
    assert store.list() == []
    store.close()


def test_a_file_system_without_directory_fsync_still_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_dir_fsync(monkeypatch, errno.EINVAL)
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"w": torch.ones(4)}, step=1)
    assert [i.step for i in store.list()] == [1]
    store.close()
