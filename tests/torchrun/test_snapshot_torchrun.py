"""In-memory snapshots under real torchrun agents (gloo, CPU, 127.0.0.1).

Durable checkpoints are far apart (every 1000 steps, and at epoch ends), snapshots are
taken every step (or far apart too, where the survivors' last step is what counts).
A worker SIGKILLed at a random moment (c10d and etcd-v2), and the
whole first node, agent and workers, SIGKILLed (etcd-v2, where any node may die), each
cost at most one step: the restarted group resumes from the newest snapshot that any
surviving node holds. A finished run leaves nothing in the snapshot directory.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from elastic_kit.testing import EtcdServer, LocalCluster, wait_for
from tests.fork_launch import FORK_LAUNCH
from tests.snapshot_tree import left_in, replica_step_dirs

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "own_loop" / "train.py"
SIZE, BATCH, EPOCHS = 320, 8, 2
RUN_TIMEOUT = 180.0
_LINE = re.compile(r"Epoch: \[0\] \[(\d+)/\d+\] loss")


def script_args(tmp: Path, name: str, snapshot_every: int) -> list[str]:
    return [str(TRAIN), "--synthetic", str(SIZE), "--image-size", "16", "--epochs", str(EPOCHS),
            "-b", str(BATCH), "-j", "0", "-p", "1", "--seed", "3", "--lr", "0.05",
            "--warmup-steps", "5", "--checkpoint-dir", str(tmp / name / "ckpt"),
            "--checkpoint-every", "1000", "--snapshot-every", str(snapshot_every), "--audit",
            "--summary-json", str(tmp / name / "summary.json")]


def last_step_of_epoch_0(logs: str) -> int:
    """The last step rank 0 reported (it prints after every step of epoch 0, which is
    the first life's epoch here)."""
    found = _LINE.findall(logs)
    return int(found[-1]) + 1 if found else 0


def full_audit() -> list[dict[str, Any]]:
    return [{"epoch": e, "count": SIZE, "expected": SIZE, "ok": True} for e in range(EPOCHS)]


def run_to_end(cluster: LocalCluster, codes: list[int | None]) -> None:
    got = cluster.wait(RUN_TIMEOUT)
    if [c for c, want in zip(got, codes) if want is not None] != [c for c in codes if c is not None]:
        pytest.fail(f"agent exit codes {got}, expected {codes}\n{cluster.logs()[-20000:]}")


@pytest.mark.parametrize("snapshot_every", [1, 1000])
def test_worker_killed_at_a_random_moment_loses_at_most_one_step(
        tmp_path: Path, snapshot_every: int) -> None:
    """With a snapshot every step, the newest one; with snapshots far apart, the one
    the survivor writes of the last step it finished as it exits."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"OMP_NUM_THREADS": "1", "ELASTIC_KIT_SNAPSHOT_DIR": str(shm)}
    with LocalCluster(script_args(tmp_path, "ref", 0), nnodes="1", nproc_per_node=2,
                      max_restarts=0, env=env, log_dir=tmp_path / "ref-logs") as cluster:
        cluster.add_agent()
        run_to_end(cluster, [0])
    reference = json.loads((tmp_path / "ref" / "summary.json").read_text())

    rng = random.Random(7)
    with LocalCluster(script_args(tmp_path, "run", snapshot_every), nnodes="1",
                      nproc_per_node=2, max_restarts=1, env=env,
                      log_dir=tmp_path / "logs", **FORK_LAUNCH) as cluster:
        agent = cluster.add_agent()
        kill_after = rng.randint(4, 12)
        wait_for(lambda: last_step_of_epoch_0(cluster.logs()) >= kill_after, 120,
                 interval=0.01, what=f"step {kill_after}", abort_if=cluster.all_exited)
        cluster.kill_worker(agent, local_rank=1)
        # The survivor cannot finish another step without its peer: this is the last one.
        last = last_step_of_epoch_0(cluster.logs())
        run_to_end(cluster, [0])
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    resumed = s["world_sizes"][-1]
    assert resumed["restored_from"] == "memory", s["world_sizes"]
    assert last - 1 <= resumed["restored_step"] <= last + 1, (last, s["world_sizes"])
    assert s["steps"] == reference["steps"]
    assert s["audit"] == full_audit()
    assert s["param_sha256"] == reference["param_sha256"]
    assert s["ema_sha256"] == reference["ema_sha256"]
    assert left_in(shm) == []  # a finished run leaves nothing behind


def test_etcd_worker_kill_then_loss_of_rank_0_node_each_cost_at_most_one_step(
        tmp_path: Path) -> None:
    """etcd-v2, where any node may die: a worker SIGKILLed at a random moment resumes
    from memory; then the whole node of global rank 0 (agent and worker) is SIGKILLed
    at a random moment and the survivor resumes from its own copy of the snapshots (it
    also held the lost node's replica, streamed over the side channel)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"OMP_NUM_THREADS": "1", "ELASTIC_KIT_SNAPSHOT_DIR": str(shm),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    rng = random.Random(11)
    with EtcdServer(log_path=tmp_path / "etcd.log") as etcd, LocalCluster(
            script_args(tmp_path, "run", 1), nnodes="1:2", nproc_per_node=1, max_restarts=3,
            rdzv_backend="etcd-v2", rdzv_endpoint=etcd.endpoint, env=env,
            log_dir=tmp_path / "logs") as cluster:
        agents = [cluster.add_agent(), cluster.add_agent()]

        def groups_of_two() -> int:
            # rank 0 prints "world size 2 on" when a group of two starts
            return sum(a.read_log().count("world size 2 on") for a in agents)

        def main_agent() -> Any:
            """The agent whose worker is global rank 0 in the newest group of two."""
            def start(a: Any) -> int:
                return a.read_log().rfind("world size 2 on")
            return max((a for a in agents if start(a) >= 0), key=lambda a: (
                a.read_log().count("world size 2 on"), start(a)))

        def step(agent: Any) -> int:
            log = agent.read_log()
            return last_step_of_epoch_0(log[log.rfind("world size 2 on"):])

        wait_for(lambda: groups_of_two() == 1, 120, interval=0.02, what="a group of two",
                 abort_if=cluster.all_exited)
        main = main_agent()
        kill_after = rng.randint(4, 8)
        wait_for(lambda: step(main) >= kill_after, 120, interval=0.01,
                 what=f"step {kill_after}", abort_if=cluster.all_exited)
        other = agents[1 - agents.index(main)]
        cluster.kill_worker(other, local_rank=0)  # rank 1: the group restarts at W=2
        last_before_worker_kill = step(main)

        wait_for(lambda: groups_of_two() == 2, 120, interval=0.02,
                 what="the restarted group of two", abort_if=cluster.all_exited)
        main = main_agent()
        kill_after = rng.randint(3, 6)
        wait_for(lambda: step(main) >= kill_after, 120, interval=0.01,
                 what=f"{kill_after} steps after the restart", abort_if=cluster.all_exited)
        survivor = agents[1 - agents.index(main)]
        # the survivor's memory holds a replica the main node streamed there
        wait_for(lambda: bool(replica_step_dirs(shm, survivor.pid, main.pid)), 60,
                 interval=0.01,
                 what="a replica of the main node's snapshot on the survivor",
                 abort_if=cluster.all_exited)
        cluster.kill_agent(main)  # the node of global rank 0: agent and worker
        last_before_node_loss = step(main)
        got = cluster.wait(RUN_TIMEOUT)
        if got[agents.index(survivor)] != 0:
            pytest.fail(f"agent exit codes {got}\n{cluster.logs()[-20000:]}")
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    first, after_kill, after_loss = s["world_sizes"]
    assert (first["world_size"], after_kill["world_size"], after_loss["world_size"]) == (2, 2, 1)
    assert after_kill["restored_from"] == "memory", s["world_sizes"]
    lo, hi = last_before_worker_kill - 1, last_before_worker_kill + 1
    assert lo <= after_kill["restored_step"] <= hi, (last_before_worker_kill, s["world_sizes"])
    assert after_loss["restored_from"] in ("memory", "peer"), s["world_sizes"]
    # steps in the log restart at 0 with each group: count from the restored step
    last = after_kill["restored_step"] + last_before_node_loss
    assert last - 1 <= after_loss["restored_step"] <= last + 1, (last, s["world_sizes"])
    assert s["audit"] == full_audit()
    # the survivor removed the run's snapshots on this host when the run finished,
    # the lost node's included
    assert left_in(shm) == []
