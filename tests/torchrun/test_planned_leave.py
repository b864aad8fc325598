"""An announced preemption is a planned leave with nothing redone (real torchrun
agents, a fake GCE metadata server on 127.0.0.1, gloo, CPU).

Two agents train the own-loop example; the second one's host is a "GCE Spot VM"
whose metadata server announces a preemption 30 s ahead. At the next exchange every
rank snapshots the same step, the snapshot reaches the other node's memory, the
announced node stops its agent and leaves, and the survivor restarts alone and
resumes from its own memory at exactly the step the group left: no step redone, every
epoch's audit exact. Each agent has a shared-memory root of its own, as two hosts do:
the host that left keeps nothing of the run there (its machine may stay up: a notice
cancelled, a node handed back to a shared pool).
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from elastic_kit.testing import FakeMetadataServer, LocalCluster, wait_for
from tests.snapshot_tree import left_in

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "own_loop" / "train.py"
SIZE, BATCH = 320, 8
FAST_RDZV = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
_STEP = re.compile(r"Epoch: \[\d+\] \[\d+/\d+\] loss")
_RESTORED = re.compile(r"restored checkpoint step (\d+) \(from (this node's memory|[^)]*)\)"
                       r".*world size (\d+ -> \d+)")
_ANY_LEAVE = re.compile(r"node\(s\) \[\d+\] leave at step (\d+)")
_AUDIT = re.compile(r"sample audit: epoch \d+: (\w+)")
_LEAVE = re.compile(r"node\(s\) \[1\] leave at step (\d+) \(GCE: instance/preempted is TRUE\)")


def _steps_alone(log: str) -> int:
    """Steps the survivor logged at world size 1 after the group agreed on the leave."""
    leave = log.find("leave at step")
    start = log.find("world size 1 on", leave) if leave >= 0 else -1
    return 0 if start < 0 else len(_STEP.findall(log[start:]))


@contextlib.contextmanager
def _two_nodes_training(tmp_path: Path, rdzv_conf: str,
                        **cluster: Any) -> Iterator[tuple[Any, Any, Any]]:
    """Two agents training the example, the second on a "GCE Spot VM" whose fake
    metadata server announces nothing yet: ``(gce, first, second)``, once the group of
    two has trained 5 steps. Far more epochs than a test waits for: the leave must come
    while training runs, however slow the machine; the test's end stops the job."""
    shm = tmp_path / "shm"
    shm.mkdir()
    args = [str(TRAIN), "--synthetic", str(SIZE), "--image-size", "32", "--epochs", "1000",
            "-b", str(BATCH), "-j", "0", "-p", "1", "--seed", "3",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1000",
            "--snapshot-every", "1000", "--audit"]
    env = {"OMP_NUM_THREADS": "1"}
    roots = [shm / "host0", shm / "host1"]
    for root in roots:
        root.mkdir()
    with FakeMetadataServer("gce") as gce, LocalCluster(
            args, nnodes="1:2", nproc_per_node=1, max_restarts=3, rdzv_conf=rdzv_conf,
            env=env, log_dir=tmp_path / "logs", **cluster) as c:
        first = c.add_agent(env={"ELASTIC_KIT_CLOUD": "none",
                                 "ELASTIC_KIT_SNAPSHOT_DIR": str(roots[0])})
        second = c.add_agent(env={"ELASTIC_KIT_CLOUD": "gce",
                                  "ELASTIC_KIT_METADATA_URL": gce.url,
                                  "ELASTIC_KIT_SNAPSHOT_DIR": str(roots[1])})

        def steps_at_two() -> int:
            log = first.read_log()
            start = log.find("world size 2 on")
            return 0 if start < 0 else len(_STEP.findall(log[start:]))

        wait_for(lambda: steps_at_two() >= 5, 120, interval=0.02,
                 what="5 steps at world size 2", abort_if=c.all_exited)
        yield gce, first, second


def test_an_announced_preemption_leaves_with_no_step_redone(tmp_path: Path) -> None:
    with _two_nodes_training(tmp_path, FAST_RDZV) as (gce, first, second):
        gce.announce(lead_s=30)
        announced = time.monotonic()
        wait_for(lambda: not second.alive, 30, interval=0.05, what="the announced node leaving")
        left_s = time.monotonic() - announced
        # the survivor alone after the leave (the first agent may also have trained
        # alone before the second joined)
        wait_for(lambda: _steps_alone(first.read_log()) >= 3, 120, interval=0.05,
                 what="3 steps of the survivor alone", abort_if=lambda: not first.alive)
        log, gone = first.read_log(), second.read_log()
        left_behind = left_in(tmp_path / "shm" / "host1")
    assert "this node leaves at step" in gone and "stopping its torchrun agent" in gone, gone[-8000:]
    assert left_s < 30.0, left_s  # within the notice
    # the step is in the survivor's memory: the host that left held a state's size
    # (twice, with the survivor's replica) until the next job there cleaned it up
    assert left_behind == [], left_behind
    (left_at,) = map(int, _LEAVE.findall(log))
    (restored,) = _restores_after_the_leave(log)
    assert restored == (str(left_at), "this node's memory", "2 -> 1"), log[-8000:]  # none redone
    audits = _AUDIT.findall(log)
    assert audits and all(ok == "all" for ok in audits), audits  # every sample once per epoch


def _restores_after_the_leave(log: str) -> list[tuple[str, str, str]]:
    """The restores logged after the leave (the second node's join restored too when
    the first agent had trained alone before it)."""
    leave = _ANY_LEAVE.search(log)
    assert leave is not None, log[-8000:]
    return _RESTORED.findall(log[leave.end():])


SLOW_KEEP_ALIVE_S = 30  # keep_alive_interval=1 x keep_alive_max_attempt=30


def test_under_the_launcher_the_leaving_agent_leaves_the_rendezvous_at_once(
        tmp_path: Path) -> None:
    """Under ``python -m elastic_kit.run`` the leaving node's agent takes itself out of
    the rendezvous before it stops: the survivor restarts without waiting for its
    keep-alives to lapse, which here take 30 s (plain torchrun's agent, SIGTERMed,
    stays a participant until then)."""
    rdzv = (f"join_timeout=60,last_call_timeout=1,keep_alive_interval=1,"
            f"keep_alive_max_attempt={SLOW_KEEP_ALIVE_S}")
    with _two_nodes_training(tmp_path, rdzv, launcher="elastic_kit.run") as (
            gce, first, second):
        gce.announce(lead_s=30)
        wait_for(lambda: not second.alive, 30, interval=0.05, what="the announced node leaving")
        left = time.monotonic()
        wait_for(lambda: _steps_alone(first.read_log()) >= 1, 120, interval=0.05,
                 what="a step of the survivor alone", abort_if=lambda: not first.alive)
        alone_s = time.monotonic() - left
        log, gone = first.read_log(), second.read_log()
        status = second.proc.wait(10)
    assert "the node leaves the rendezvous at once" in gone, gone[-8000:]
    # an orderly end, not a failed task (SLURM's --kill-on-bad-exit would end the rest)
    assert status == 0 and "this node left the job on a notice" in gone, (status, gone[-8000:])
    assert "SignalException" not in gone, gone[-8000:]
    # without leaving the rendezvous, the survivor's next round waits out the keep-alives
    assert alone_s < SLOW_KEEP_ALIVE_S - 10, (alone_s, log[-8000:])
    (left_at,) = map(int, _ANY_LEAVE.findall(log))
    (restored,) = _restores_after_the_leave(log)
    assert restored == (str(left_at), "this node's memory", "2 -> 1"), log[-8000:]
