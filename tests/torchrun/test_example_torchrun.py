"""examples/imagenet/main.py under real torchrun, 2 CPU workers, on generated JPEGs.

One uninterrupted run is shared by the tests (module fixture). The resume test ends
a run part-way with ``--max-steps`` (a clean stop), continues it on the same
checkpoint store, SIGKILLs a worker of the continuation (torchrun restarts the
group), and must end with bitwise the same weights as the uninterrupted run.

The runs that get a worker killed go through ``tests/torchrun/scenarios/_hold.py``: both
ranks wait at the end of step 5 until the test, having seen checkpoint 4 committed,
has killed the worker, so the kill always lands mid-run however loaded the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchvision")

from elastic_kit.testing import make_imagefolder  # noqa: E402
from elastic_kit.testing import LocalCluster, wait_for  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "examples" / "imagenet" / "main.py"
HOLD = ROOT / "tests" / "torchrun" / "scenarios" / "_hold.py"
HOLD_AT_STEP = 5  # after the checkpoint of step 4 (--checkpoint-every 2), before the end
CLASSES, PER_CLASS, VAL_PER_CLASS = 4, 16, 5
DATASET_SIZE = CLASSES * PER_CLASS  # 64
GLOBAL_BATCH, MICRO_BATCH, EPOCHS = 16, 4, 3
STEPS_PER_EPOCH = DATASET_SIZE // GLOBAL_BATCH  # 4


def script_args(data: Path, ckpt: Path, summary: Path, *extra: str) -> list[str]:
    return [
        str(MAIN), "-a", "tinycnn", "--image-size", "16", "-j", "0", "--epochs", str(EPOCHS),
        "-b", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH), "--lr", "0.05",
        "--seed", "3", "--checkpoint-every", "2", "-p", "0",
        "--checkpoint-dir", str(ckpt), "--summary-json", str(summary), *extra, str(data),
    ]


def run_example(data: Path, ckpt: Path, summary: Path, *extra: str,
                timeout: float = 400) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           "--nproc-per-node=2", *script_args(data, ckpt, summary, *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (
        f"torchrun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-6000:]}")
    return json.loads(summary.read_text())


def hold_env(hold_dir: Path) -> dict[str, str]:
    hold_dir.mkdir(parents=True, exist_ok=True)
    return {"EK_TEST_HOLD_DIR": str(hold_dir), "EK_TEST_HOLD_AT_STEP": str(HOLD_AT_STEP),
            "EK_TEST_HOLD_WORLD_SIZE": "2"}


def wait_until_both_ranks_hold(hold_dir: Path, cluster: LocalCluster) -> None:
    wait_for(lambda: all((hold_dir / f"held-rank{r}").exists() for r in (0, 1)), 240,
             what=f"both ranks to hold at step {HOLD_AT_STEP}", abort_if=cluster.all_exited)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("data") / "tiny", classes=CLASSES,
                            per_class=PER_CLASS, val_per_class=VAL_PER_CLASS, size=24, seed=0)


@pytest.fixture(scope="module")
def uninterrupted(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("uninterrupted")
    return run_example(data, d / "ckpt", d / "summary.json")


def test_two_workers_train_every_sample_once_and_write_the_summary(
        uninterrupted: dict[str, Any]) -> None:
    s = uninterrupted
    assert set(s) == {"steps", "epochs", "world_sizes", "restarts", "restored_steps", "audit",
                      "final_top1", "final_top5", "best_acc1", "param_sha256",
                      "images_per_sec", "arch", "global_batch_size", "dataset_size"}
    assert s["steps"] == EPOCHS * STEPS_PER_EPOCH and s["epochs"] == EPOCHS
    assert [{k: w[k] for k in ("world_size", "step", "restart", "restored_step")}
            for w in s["world_sizes"]] == [
        {"world_size": 2, "step": 0, "restart": 0, "restored_step": None}]
    assert s["restarts"] == 0 and s["restored_steps"] == []
    assert s["audit"] == [{"epoch": e, "count": DATASET_SIZE, "expected": DATASET_SIZE, "ok": True}
                          for e in range(EPOCHS)]
    assert len(s["param_sha256"]) == 64 and int(s["param_sha256"], 16) >= 0
    assert 0 <= s["final_top1"] <= s["final_top5"] <= 100
    assert s["best_acc1"] >= s["final_top1"]
    assert s["images_per_sec"] > 0
    assert s["arch"] == "tinycnn"
    assert (s["global_batch_size"], s["dataset_size"]) == (GLOBAL_BATCH, DATASET_SIZE)


def test_stopped_then_sigkilled_and_resumed_at_same_world_size_gives_identical_weights(
        data: Path, tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    ckpt = tmp_path / "ckpt"
    # 1. a clean stop mid-epoch 0: --max-steps checkpoints and exits
    first = run_example(data, ckpt, tmp_path / "first.json", "--max-steps", "3")
    assert first["steps"] == 3 and first["epochs"] == 0 and first["audit"] == []
    assert first["param_sha256"] != uninterrupted["param_sha256"]

    # 2. resume from step 3, then lose a worker to SIGKILL (no chance to save):
    #    torchrun restarts the group, which resumes from the newest checkpoint
    summary, hold = tmp_path / "resumed.json", tmp_path / "hold"
    with LocalCluster([str(HOLD), *script_args(data, ckpt, summary)], nnodes="1",
                      nproc_per_node=2, max_restarts=1,
                      env={"OMP_NUM_THREADS": "1", **hold_env(hold)},
                      log_dir=tmp_path / "logs") as cluster:
        agent = cluster.add_agent()
        wait_until_both_ranks_hold(hold, cluster)
        wait_for(lambda: (ckpt / "step-000000000004" / "manifest.json").exists(), 240,
                 what="checkpoint step 4", abort_if=cluster.all_exited)
        cluster.kill_worker(agent, local_rank=1)
        (hold / "release").touch()
        assert cluster.wait(300) == [0], cluster.logs()[-6000:]
    s = json.loads(summary.read_text())
    assert s["restarts"] == 1
    assert s["restored_steps"][0] == 3 and len(s["restored_steps"]) == 2
    assert 4 <= s["restored_steps"][1] < s["steps"]
    assert [h["world_size"] for h in s["world_sizes"]] == [2, 2, 2]
    assert [h["restart"] for h in s["world_sizes"]] == [0, 0, 1]
    assert s["steps"] == uninterrupted["steps"]
    assert s["audit"] == uninterrupted["audit"]  # epoch 0 spans three worker groups, still exact
    assert s["param_sha256"] == uninterrupted["param_sha256"]
    assert s["final_top1"] == uninterrupted["final_top1"]
    # the best model was committed to its own one-slot store
    assert len([p for p in (ckpt / "best").iterdir() if p.name.startswith("step-")]) == 1


def test_workers_forked_from_the_agent_resume_exactly_after_sigkill(
        data: Path, tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    """The fast-restart setup of the README (``python -m elastic_kit.run --preload
    torchvision ... --start-method=fork --run-path``: workers are forked from the agent,
    which has torch, ``torch._dynamo`` and torchvision imported) trains the same
    trajectory, and the agent reports the SIGKILLed worker without importing anything
    (plain torchrun's log formatter imports ``torch._dynamo`` there)."""
    import psutil

    ckpt, summary, hold = tmp_path / "ckpt", tmp_path / "forked.json", tmp_path / "hold"
    with LocalCluster([str(HOLD), *script_args(data, ckpt, summary)], nnodes="1",
                      nproc_per_node=2, max_restarts=1,
                      env={"OMP_NUM_THREADS": "1", **hold_env(hold)}, log_dir=tmp_path / "logs",
                      torchrun_args=["--start-method=fork", "--run-path"],
                      launcher="elastic_kit.run", launcher_args=["--preload", "torchvision"],
                      ) as cluster:
        agent = cluster.add_agent()
        wait_until_both_ranks_hold(hold, cluster)
        # Forked workers are copies of the agent process: they carry its command line.
        workers = agent.worker_pids()
        assert len(workers) >= 2 and all(
            "elastic_kit.run" in psutil.Process(pid).cmdline() for pid in workers), (
            [psutil.Process(pid).cmdline() for pid in workers])
        wait_for(lambda: (ckpt / "step-000000000004" / "manifest.json").exists(), 240,
                 what="checkpoint step 4", abort_if=cluster.all_exited)
        cluster.kill_worker(agent, local_rank=0)
        (hold / "release").touch()
        assert cluster.wait(300) == [0], cluster.logs()[-6000:]
    s = json.loads(summary.read_text())
    assert s["restarts"] == 1 and len(s["restored_steps"]) == 1
    assert 4 <= s["restored_steps"][0] < s["steps"]
    assert s["steps"] == uninterrupted["steps"]
    assert s["audit"] == uninterrupted["audit"]
    assert s["param_sha256"] == uninterrupted["param_sha256"]
