"""A snapshot file's pages are reserved when it is made: a tmpfs that another process
fills between the free-space check and the first touch of the mapping killed the
worker with SIGBUS (the docs promise snapshots turned off, with a warning).

A real size-limited tmpfs (mounted here; skipped where this user cannot mount), and a
child process that fills it right after the check passes, as another job would."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent("""
    import errno, os, sys
    import torch
    from elastic_kit.snapshot import _slots
    from elastic_kit.store import plan_flat

    d = sys.argv[1]
    check = _slots._check_room

    def check_then_another_process_fills_it(path, size, need):
        check(path, size, need)
        st = os.statvfs(d)
        with open(os.path.join(d, "other-job"), "wb") as f:
            f.write(b"\\0" * (st.f_bavail * st.f_frsize - (1 << 20)))

    _slots._check_room = check_then_another_process_fills_it
    plan = plan_flat([("w", torch.zeros(6 * (1 << 20) // 4))])  # 6 MiB of 10
    try:
        _slots.Slot(os.path.join(d, ".slot-test"), plan, pin=False)
        print("made")
    except OSError as e:
        print("refused", errno.errorcode[e.errno], e.filename == os.path.join(d, ".slot-test"),
              os.path.exists(os.path.join(d, ".slot-test")))
""")


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m,mode=700", "tmpfs",
                           str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_tmpfs_filled_after_the_check_refuses_the_file_instead_of_a_sigbus(
        small_tmpfs: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", CHILD, str(small_tmpfs)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["refused", errno.errorcode[errno.ENOSPC], "True", "False"]
