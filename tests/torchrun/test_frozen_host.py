"""A frozen host is noticed in seconds (real torchrun agents, gloo, 127.0.0.1).

Two agents train the own-loop example with snapshots every step. The second agent
and its worker are SIGSTOPped, as a frozen VM, a kernel hang or a network partition
look from outside: their sockets stay open, so without heartbeats the survivor waits
in its collective until the process group's timeout (120 s). With them, the
survivor's heartbeat finds the peer silent, the worker exits (status 75) and torchrun
re-forms the group without the frozen node; it resumes from its own memory with at
most one step redone and trains to the end with every sample counted once.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from elastic_kit.health import SILENT_PEER_EXIT_CODE
from elastic_kit.testing import LocalCluster, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "own_loop" / "train.py"
SIZE, BATCH, EPOCHS = 320, 8, 2
FAST_RDZV = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
_LINE = re.compile(r"Epoch: \[0\] \[(\d+)/\d+\] loss")


def test_a_frozen_host_is_left_behind_in_seconds_with_at_most_one_step_redone(
        tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    args = [str(TRAIN), "--synthetic", str(SIZE), "--image-size", "16", "--epochs",
            str(EPOCHS), "-b", str(BATCH), "-j", "0", "-p", "1", "--seed", "3",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1000",
            "--snapshot-every", "1", "--audit", "--summary-json", str(tmp_path / "summary.json")]
    env = {"OMP_NUM_THREADS": "1", "ELASTIC_KIT_SNAPSHOT_DIR": str(shm),
           "ELASTIC_KIT_HEARTBEAT_TIMEOUT": "3"}
    with LocalCluster(args, nnodes="1:2", nproc_per_node=1, max_restarts=3, rdzv_conf=FAST_RDZV,
                      env=env, log_dir=tmp_path / "logs") as cluster:
        first = cluster.add_agent()  # hosts the c10d store: the one that stays
        second = cluster.add_agent()

        def steps_of_two() -> int:
            log = first.read_log()
            start = log.find("world size 2 on")
            return 0 if start < 0 else len(_LINE.findall(log[start:]))

        wait_for(lambda: steps_of_two() >= 5, 120, interval=0.02, what="5 steps at world size 2",
                 abort_if=cluster.all_exited)
        cluster.kill_agent(second, signal.SIGSTOP)
        frozen_at = time.monotonic()
        last = steps_of_two()
        wait_for(lambda: "world size 1 on" in first.read_log(), 90, interval=0.05,
                 what="the survivor's group of one", abort_if=lambda: not first.alive)
        regrouped_s = time.monotonic() - frozen_at
        codes = [first.proc.wait(timeout=180)]
        log = first.read_log()
    assert codes == [0], log[-20000:]
    # the survivor left through its heartbeat, not the process group's 120 s timeout
    assert "no heartbeat from rank 1" in log, log[-20000:]
    assert f"(exitcode: {SILENT_PEER_EXIT_CODE})" in log, log[-20000:]
    assert regrouped_s < 60.0, regrouped_s
    summary = json.loads((tmp_path / "summary.json").read_text())
    resumed = summary["world_sizes"][-1]
    assert resumed["world_size"] == 1 and resumed["restored_from"] == "memory", summary
    assert last - 1 <= resumed["restored_step"] <= last + 1, (last, summary["world_sizes"])
    assert summary["audit"] == [{"epoch": e, "count": SIZE, "expected": SIZE, "ok": True}
                                for e in range(EPOCHS)]
