"""A script that ends with an uncaught exception (a peer died, a collective failed)
without ``with Checkpointer(...)`` still writes the snapshot it took last: the writer
thread is a daemon, and the checkpointer's exit handler writes what was queued before
the interpreter stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_kit.snapshot import snapshot_dir

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)

_TRAIN = textwrap.dedent("""
    import sys, time
    import torch
    import elastic_kit as ek
    from elastic_kit.snapshot import SnapshotTier

    write = SnapshotTier._write
    def slow_write(self, job):  # a writer that falls behind training
        if PRINT_WRITES:
            print("writing", job.step, flush=True)
        time.sleep(WRITE_S)
        write(self, job)
    SnapshotTier._write = slow_write

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ek.TrainState(model, opt)
    ckpt = ek.Checkpointer(state, sys.argv[1], every_steps=1000, snapshot_every=EVERY,
                           handle_signals=HANDLE_SIGNALS)
    ckpt.restore()
    for _ in range(STEPS):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(3)
""")


def _script(*, every: int, steps: int, write_s: float, print_writes: bool,
            handle_signals: bool, end: str) -> str:
    """A script that trains ``steps`` steps with a slow snapshot writer, then ``end``."""
    head = (f"PRINT_WRITES, WRITE_S, EVERY, STEPS, HANDLE_SIGNALS = "
            f"{print_writes}, {write_s}, {every}, {steps}, {handle_signals}\n")
    return head + _TRAIN + textwrap.dedent(end)


def _env(shm: Path) -> dict[str, str]:
    """A process outside torchrun whose node snapshots into ``shm``."""
    env = {**os.environ, "ELASTIC_KIT_SNAPSHOT_DIR": str(shm),
           "ELASTIC_KIT_SNAPSHOT_NODE": "node0", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR"):
        env.pop(k, None)
    return env


def _steps(shm: Path, url: str) -> list[str]:
    node = Path(snapshot_dir(str(shm), "local", url)) / "node0"
    return sorted(p.name for p in node.iterdir() if p.name.startswith("step-"))


SCRIPT = _script(every=1, steps=6, write_s=0.3, print_writes=False, handle_signals=False,
                 end="""
    print("taken", state.step, "written", ckpt.snapshots.written, flush=True)
    raise RuntimeError("a collective failed")  # no close, no with-block
""")


def test_the_last_snapshot_taken_is_written_when_the_script_dies_of_an_exception(
        tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    url = str(tmp_path / "ckpt")
    env = _env(shm)
    done = subprocess.run([sys.executable, "-c", SCRIPT, url], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "a collective failed" in done.stderr, done.stderr
    # when the exception was raised, the writer was behind: step 6 was still queued
    taken, written = done.stdout.split("written")
    assert taken.split() == ["taken", "6"]
    assert 6 not in json.loads(written.strip())
    steps = _steps(shm, url)
    assert steps == ["step-000000000006"], steps


SIGTERM_SCRIPT = _script(every=3, steps=4, write_s=1.5, print_writes=True,
                         handle_signals=True, end="""
    raise RuntimeError("a collective failed")
""")


def test_a_sigterm_while_the_last_state_is_written_at_exit_does_not_cut_it_short(
        tmp_path: Path) -> None:
    """The failing rank's group is being stopped: torchrun's SIGTERM comes while the
    exiting rank writes its last step (step 4, after the periodic one at step 3); the
    rank finishes the write and exits with its own error, not killed by the signal."""
    shm = tmp_path / "shm"
    shm.mkdir()
    url = str(tmp_path / "ckpt")
    env = _env(shm)
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, url], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        # the periodic one at step 3 (unless step 4's replaced it before it started)
        line = proc.stdout.readline().split()
        if line == ["writing", "3"]:
            line = proc.stdout.readline().split()
        assert line == ["writing", "4"]  # the one at exit
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and "a collective failed" in err, (proc.returncode, err)
    steps = _steps(shm, url)
    assert steps == ["step-000000000004"], steps


NO_CLOSE_SCRIPT = _script(every=2, steps=4, write_s=0.0, print_writes=False,
                          handle_signals=False, end="""
    print("trained", state.step, flush=True)  # and ends: no close(), no with-block
""")


def test_a_script_that_ends_without_close_is_told_its_snapshot_stays(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    url = str(tmp_path / "ckpt")
    done = subprocess.run([sys.executable, "-c", NO_CLOSE_SCRIPT, url], env=_env(shm),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["trained", "4"], done.stderr
    assert "exited without ckpt.close(): this rank's snapshot in" in done.stderr
    assert "snapshots --remove" in done.stderr
    assert _steps(shm, url) == ["step-000000000004"]
    # one that died of an exception is not told so: its snapshot is for the restart
    died = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ck2")],
                          env=_env(shm), capture_output=True, text=True, timeout=120)
    assert died.returncode == 1 and "exited without ckpt.close()" not in died.stderr
