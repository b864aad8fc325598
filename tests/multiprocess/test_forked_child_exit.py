"""A child the script forks (``os.fork()``, then ``sys.exit``: a preprocessing helper,
a ``fork`` start method the script manages itself) leaves the parent's checkpointer
alone: the exit handlers it inherited are the parent's. It used to run them: its wait
for the parent's background save hung (that save's threads do not exist in a child),
and its closing of the snapshot tier removed the parent's snapshot files, which turned
the parent's snapshots off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import elastic_kit as ek

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ek.TrainState(model, opt)
    ckpt = ek.Checkpointer(state, sys.argv[1], every_steps=2, snapshot_every=1)
    ckpt.restore()
    out = {}

    def step():
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(3)

    for _ in range(3):  # a non-blocking save at step 2, snapshots every step
        step()
    ckpt.snapshots.wait()  # step 3 written: its slot files exist
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # through the interpreter's exit: its exit handlers run
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            out["child"] = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        out["child"] = "hung"
    for _ in range(3):
        step()
    out["snapshots_on"] = ckpt.snapshots is not None
    ckpt.close()
    print(json.dumps(out), flush=True)
""")


def test_a_forked_child_that_exits_leaves_the_parents_checkpointer_alone(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {**os.environ, "ELASTIC_KIT_SNAPSHOT_DIR": str(shm),
           "ELASTIC_KIT_SNAPSHOT_NODE": "node0", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR"):
        env.pop(k, None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"child": 0, "snapshots_on": True}, done.stderr
    assert "snapshots are off" not in done.stderr, done.stderr
    assert "exited without ckpt.close()" not in done.stderr, done.stderr
