"""examples/own_loop/train.py under real torchrun agents on 127.0.0.1 (gloo, CPU).

(a) At a fixed world size of 2, a worker SIGKILLed in the middle of an epoch makes
torchrun restart the group, which resumes from a mid-epoch checkpoint and ends with
bitwise the weights (and EMA weights) of an uninterrupted run.
(b) A job resized 2 -> 3 -> 2 (a node joins, later that node is lost) trains every
sample of every epoch exactly once, by the script's own audit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from elastic_kit.testing import LocalCluster, wait_for
from tests.fork_launch import FORK_LAUNCH

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "own_loop" / "train.py"
SIZE, BATCH, EPOCHS = 480, 8, 3
EVENT_TIMEOUT, RUN_TIMEOUT = 90.0, 150.0
_STEP_DIR = re.compile(r"^step-(\d+)$")


def script_args(ckpt: Path, summary: Path, *, every: int = 3) -> list[str]:
    return [str(TRAIN), "--synthetic", str(SIZE), "--image-size", "16", "--epochs", str(EPOCHS),
            "-b", str(BATCH), "-j", "0", "-p", "5", "--seed", "2", "--lr", "0.05",
            "--warmup-steps", "5", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", str(every), "--audit", "--summary-json", str(summary)]


def manifests(ckpt: Path) -> dict[int, dict[str, Any]]:
    """``{step: manifest}`` of every committed checkpoint in the store."""
    out: dict[int, dict[str, Any]] = {}
    if ckpt.is_dir():
        for d in ckpt.iterdir():
            m = _STEP_DIR.match(d.name)
            if m:
                try:
                    out[int(m.group(1))] = json.loads((d / "manifest.json").read_text())
                except (FileNotFoundError, json.JSONDecodeError):
                    continue  # not committed yet (or pruned while reading)
    return out


def full_audit() -> list[dict[str, Any]]:
    return [{"epoch": e, "count": SIZE, "expected": SIZE, "ok": True} for e in range(EPOCHS)]


def fail_with_logs(cluster: LocalCluster, what: str) -> None:
    pytest.fail(f"{what}\n{cluster.logs()[-20000:]}")


def test_worker_sigkilled_mid_epoch_resumes_there_with_identical_weights(tmp_path: Path) -> None:
    world = 2
    steps_per_epoch = SIZE // (BATCH * world)  # 30; checkpoints every 3 steps
    env = {"OMP_NUM_THREADS": "1"}

    ref_summary = tmp_path / "reference.json"
    with LocalCluster(script_args(tmp_path / "ref", ref_summary), nnodes="1",
                      nproc_per_node=world, max_restarts=0, env=env,
                      log_dir=tmp_path / "ref-logs") as cluster:
        cluster.add_agent()
        if cluster.wait(RUN_TIMEOUT) != [0]:
            fail_with_logs(cluster, "the uninterrupted run failed")
    reference = json.loads(ref_summary.read_text())
    assert reference["steps"] == EPOCHS * steps_per_epoch
    assert reference["restored_steps"] == [] and reference["audit"] == full_audit()

    ckpt, summary = tmp_path / "ckpt", tmp_path / "killed.json"
    with LocalCluster(script_args(ckpt, summary), nnodes="1", nproc_per_node=world,
                      max_restarts=1, env=env, log_dir=tmp_path / "logs",
                      **FORK_LAUNCH) as cluster:
        agent = cluster.add_agent()
        try:
            wait_for(lambda: 6 in manifests(ckpt), EVENT_TIMEOUT, interval=0.02,
                     what="checkpoint step 6", abort_if=cluster.all_exited)
        except (TimeoutError, RuntimeError) as e:
            fail_with_logs(cluster, str(e))
        # Hold the group still so the kill lands well inside epoch 0 (steps 1..30).
        paused = cluster.pause_workers()
        try:
            cluster.kill_worker(agent, local_rank=1)
        finally:
            cluster.resume_workers(paused)
        if cluster.wait(RUN_TIMEOUT) != [0]:
            fail_with_logs(cluster, "the killed run did not finish")
        logs = cluster.logs()
    s = json.loads(summary.read_text())
    assert s["restarts"] == 1
    assert [(h["world_size"], h["restart"]) for h in s["world_sizes"]] == [(2, 0), (2, 1)]
    (restored,) = s["restored_steps"]
    assert 6 <= restored < steps_per_epoch  # a checkpoint from inside epoch 0
    # The script's own progress lines: len(loader) is the whole epoch, then what was left.
    lengths = {int(n) for n in re.findall(r"Epoch: \[0\] \[\d+/(\d+)\] loss", logs)}
    assert lengths == {steps_per_epoch, steps_per_epoch - restored}, logs[-6000:]
    assert s["steps"] == reference["steps"]
    assert s["audit"] == reference["audit"]
    assert s["param_sha256"] == reference["param_sha256"]
    assert s["ema_sha256"] == reference["ema_sha256"]
    assert s["best_acc1"] == reference["best_acc1"]


def test_resized_2_to_3_to_2_trains_every_sample_of_every_epoch_once(tmp_path: Path) -> None:
    ckpt, summary = tmp_path / "ckpt", tmp_path / "summary.json"
    with LocalCluster(script_args(ckpt, summary, every=2), nnodes="2:3", nproc_per_node=1,
                      max_restarts=3, env={"OMP_NUM_THREADS": "1"}, log_dir=tmp_path / "logs",
                      rdzv_conf="last_call_timeout=1,join_timeout=60,"
                                "keep_alive_interval=1,keep_alive_max_attempt=3",
                      **FORK_LAUNCH) as cluster:
        cluster.add_agent()  # hosts the c10d store: never killed
        cluster.add_agent()

        def committed_at(world_size: int) -> bool:
            return any(m.get("world_size") == world_size for m in manifests(ckpt).values())

        try:
            wait_for(lambda: committed_at(2), EVENT_TIMEOUT, interval=0.02,
                     what="a checkpoint at world size 2", abort_if=cluster.all_exited)
            # A node joins: torchrun SIGTERMs the group (the script saves and exits 143)
            # and restarts it at world size 3.
            third = cluster.add_agent_while_paused()
            wait_for(lambda: committed_at(3), EVENT_TIMEOUT, interval=0.02,
                     what="a checkpoint at world size 3", abort_if=cluster.all_exited)
        except (TimeoutError, RuntimeError) as e:
            fail_with_logs(cluster, str(e))
        # That node is lost (agent and workers SIGKILLed) while the group is held still,
        # so the loss happens mid-training; the two left go on at world size 2.
        paused = cluster.pause_workers()
        try:
            cluster.kill_agent(third)
        finally:
            cluster.resume_workers(paused)
        codes = cluster.wait(RUN_TIMEOUT)
        if codes[:2] != [0, 0]:
            fail_with_logs(cluster, f"agent exit codes {codes}")
    s = json.loads(summary.read_text())
    sizes = [h["world_size"] for h in s["world_sizes"]]
    segments = [w for i, w in enumerate(sizes) if i == 0 or w != sizes[i - 1]]
    assert segments == [2, 3, 2], s["world_sizes"]
    assert s["epochs"] == EPOCHS
    assert s["audit"] == full_audit()
    assert len(s["restored_steps"]) == len(sizes) - 1
    assert all(a < b for a, b in zip(s["restored_steps"], s["restored_steps"][1:]))


def test_a_validation_set_smaller_than_the_world_size_fails_at_start(tmp_path: Path) -> None:
    """evaluate() shards the validation set: one smaller than the world size must fail
    before the first epoch's training, not after it."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           "--nproc-per-node=2", "--max-restarts=0", str(TRAIN), "--synthetic", "7",
           "--image-size", "16", "--epochs", "1", "-b", "2", "-j", "0",
           "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "ckpt")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "dataset has 1 sample, fewer than num_replicas=2" in done.stderr + done.stdout
    # 7 images, 1 for validation: two steps, the first checkpointed, had it trained
    assert not list((tmp_path / "ckpt").glob("step-*"))
