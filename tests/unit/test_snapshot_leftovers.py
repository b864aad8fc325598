"""Snapshot runs left behind in shared memory: listed with their signs of life and
removed only when no live writer uses them and nothing was written for a while."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from elastic_kit import cli
from elastic_kit.snapshot import remove_idle_runs, snapshot_runs
from elastic_kit.snapshot._private import UnsafeTreeError, user_dir_name

DEAD_PID = 2**22 + 7  # above Linux's largest pid (pid_max <= 2**22): never alive


def _run(root: Path, name: str, *, age_s: float, writer: int | None, size: int) -> Path:
    run = root / user_dir_name() / name
    (run / "node0" / "step-000000000004").mkdir(parents=True, mode=0o700)
    for d in (root / user_dir_name(), run, run / "node0", run / "node0" / "step-000000000004"):
        d.chmod(0o700)
    (run / "node0" / "step-000000000004" / "tensors.bin").write_bytes(b"x" * size)
    if writer is not None:
        (run / "node0" / f".slot-{writer}-abcd1234-2").write_bytes(b"")
    then = time.time() - age_s
    for p in [*run.rglob("*"), run]:
        os.utime(p, (then, then), follow_symlinks=False)
    return run


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    r = tmp_path / "shm"
    r.mkdir(mode=0o700)
    return r


def test_runs_are_listed_with_their_size_last_write_and_live_writers(root: Path) -> None:
    old = _run(root, "job-a-1111", age_s=7200, writer=DEAD_PID, size=1000)
    live = _run(root, "job-b-2222", age_s=7200, writer=os.getpid(), size=10)
    runs = {Path(r.path).name: r for r in snapshot_runs(str(root))}
    assert set(runs) == {"job-a-1111", "job-b-2222"}
    assert runs["job-a-1111"].size_bytes == 1000 and runs["job-a-1111"].writers == []
    assert runs["job-b-2222"].writers == [os.getpid()]
    assert 7100 < runs["job-a-1111"].idle_s() < 7300
    assert old.exists() and live.exists()


def test_only_runs_without_a_live_writer_idle_long_enough_are_removed(root: Path) -> None:
    idle = _run(root, "job-a-1111", age_s=7200, writer=DEAD_PID, size=100)
    live = _run(root, "job-b-2222", age_s=7200, writer=os.getpid(), size=100)
    recent = _run(root, "job-c-3333", age_s=60, writer=None, size=100)
    would = remove_idle_runs(str(root), idle_s=3600, dry_run=True)
    assert [Path(r.path).name for r in would] == ["job-a-1111"] and idle.exists()
    gone = remove_idle_runs(str(root), idle_s=3600)
    assert [Path(r.path).name for r in gone] == ["job-a-1111"]
    assert not idle.exists() and live.exists() and recent.exists()
    with pytest.raises(ValueError, match="idle_s=-1"):
        remove_idle_runs(str(root), idle_s=-1)


def test_a_symlink_or_another_users_tree_is_not_looked_into(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_bytes(b"keep")
    _run(root, "job-a-1111", age_s=7200, writer=None, size=1)
    (root / user_dir_name() / "job-link-9999").symlink_to(elsewhere)
    assert [Path(r.path).name for r in remove_idle_runs(str(root), idle_s=0)] == ["job-a-1111"]
    assert (elsewhere / "precious").read_bytes() == b"keep"
    (root / user_dir_name()).chmod(0o777)                 # now others could plant in it
    with pytest.raises(UnsafeTreeError):
        snapshot_runs(str(root))


def test_the_cli_lists_and_removes(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(root, "job-a-1111", age_s=7200, writer=DEAD_PID, size=2_000_000)
    _run(root, "job-b-2222", age_s=7200, writer=os.getpid(), size=10)
    assert cli.main(["snapshots", "--root", str(root), "--json"]) == 0
    rows = {Path(r["path"]).name: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["job-a-1111"]["status"] == "idle" and rows["job-a-1111"]["size_bytes"] == 2_000_000
    assert rows["job-b-2222"]["status"] == f"in use (writer pid {os.getpid()})"
    assert cli.main(["snapshots", "--root", str(root), "--remove"]) == 0
    out = capsys.readouterr().out
    assert "removed" in out and "2.0 MB" in out
    assert [Path(r.path).name for r in snapshot_runs(str(root))] == ["job-b-2222"]
    assert cli.main(["snapshots", "--root", str(root), "--idle-minutes", "-1"]) == 2
    assert cli.main(["snapshots", "--root", str(root / "missing")]) == 2


def test_a_run_whose_agent_waits_for_its_next_round_is_not_idle(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Between two rounds a node has no worker (no live writer), but its agent, whose
    pid names the node directory, lives: the restart needs those snapshots."""
    from elastic_kit.snapshot._leftovers import host_node_name

    run = _run(root, "job-a-1111", age_s=7200, writer=DEAD_PID, size=100)
    (run / "node0").rename(run / host_node_name(os.getpid()))
    gone = _run(root, "job-b-2222", age_s=7200, writer=DEAD_PID, size=100)
    (gone / "node0").rename(gone / host_node_name(DEAD_PID))
    then = time.time() - 7200
    for p in [*run.rglob("*"), run, *gone.rglob("*"), gone]:
        os.utime(p, (then, then), follow_symlinks=False)
    runs = {Path(r.path).name: r for r in snapshot_runs(str(root))}
    assert runs["job-a-1111"].agents == [os.getpid()] and runs["job-b-2222"].agents == []
    assert cli.main(["snapshots", "--root", str(root), "--json"]) == 0
    rows = {Path(r["path"]).name: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["job-a-1111"]["status"] == f"in use (agent pid {os.getpid()})"
    assert rows["job-b-2222"]["status"] == "idle"
    removed = remove_idle_runs(str(root), idle_s=3600)
    assert [Path(r.path).name for r in removed] == ["job-b-2222"] and run.exists()


def test_the_cli_says_why_a_run_abandoned_a_moment_ago_stays_and_how_to_remove_it(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The exit warning of a script that ended without close() names this command:
    right after the run, the run is "recent" and --remove alone left it, silently."""
    run = _run(root, "job-a-1111", age_s=60, writer=DEAD_PID, size=100)
    assert cli.main(["snapshots", "--root", str(root), "--remove"]) == 0
    out = capsys.readouterr().out
    assert "recent" in out and run.exists()
    assert ("recent runs (written within --idle-minutes 60) are kept; one abandoned for good "
            "is removed with --remove --idle-minutes 0") in out
    assert cli.main(["snapshots", "--root", str(root), "--remove", "--idle-minutes", "0"]) == 0
    assert "removed" in capsys.readouterr().out and not run.exists()
