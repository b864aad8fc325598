"""The examples on a GPU under real torchrun: through an epoch end (training, validation,
a save), a worker SIGKILLed in the next epoch, and the resume to the end of the run;
with torchrun's default start and with the README's fast restart (workers forked from
``python -m elastic_kit.run``).

One rank on one GPU (NCCL), so these run on any CUDA machine. Each worker runs through
``_gpu_hold.py``, which stops it after step ``HOLD_AT`` until the test has seen the
checkpoint before that step committed and killed the worker: a GPU trains these small
runs in seconds, and the kill must land inside the run. Skipped without CUDA (an
allowed reason); the fork precondition itself is checked on the CPU in
``tests/torchrun/test_run_fork_cuda.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_kit.testing import LocalCluster, wait_for

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
    pytest.mark.timeout(500),  # under the GPU machine's 600 s per command
]

ROOT = Path(__file__).resolve().parents[2]
IMAGENET = ROOT / "examples" / "imagenet" / "main.py"
OWN_LOOP = ROOT / "examples" / "own_loop" / "train.py"
HOLD = Path(__file__).resolve().parent / "_gpu_hold.py"
BATCH, STEPS_PER_EPOCH, EPOCHS, EVERY = 32, 40, 2, 10
HOLD_AT = STEPS_PER_EPOCH + EVERY + 1  # in epoch 1, after the save of step 50 has started
TOTAL = EPOCHS * STEPS_PER_EPOCH
FORKED = {"torchrun_args": ["--start-method=fork", "--run-path"], "launcher": "elastic_kit.run",
          "launcher_args": ["--preload", "torchvision"]}
_STEP_DIR = re.compile(r"^step-(\d+)$")


def imagenet_args(ckpt: Path, summary: Path) -> list[str]:
    return [str(IMAGENET), "--dummy", "--dummy-size", str(STEPS_PER_EPOCH * BATCH),
            "-a", "resnet18", "--image-size", "64", "-b", str(BATCH),
            "--global-batch-size", str(BATCH), "--epochs", str(EPOCHS), "-j", "2",
            "--checkpoint-every", str(EVERY), "-p", "10", "--lr", "0.01",
            "--checkpoint-dir", str(ckpt), "--summary-json", str(summary)]


def own_loop_args(ckpt: Path, summary: Path) -> list[str]:
    return [str(OWN_LOOP), "--synthetic", str(STEPS_PER_EPOCH * BATCH), "--image-size", "32",
            "-b", str(BATCH), "--epochs", str(EPOCHS), "-j", "2", "-p", "10", "--lr", "0.01",
            "--checkpoint-every", str(EVERY), "--audit", "--checkpoint-dir", str(ckpt),
            "--summary-json", str(summary)]


def committed_steps(ckpt: Path) -> set[int]:
    """Steps with a committed checkpoint (a manifest) in a local store."""
    if not ckpt.is_dir():
        return set()
    return {int(m.group(1)) for d in ckpt.iterdir()
            if (m := _STEP_DIR.match(d.name)) and (d / "manifest.json").exists()}


def kill_mid_run(tmp_path: Path, script_args: list[str], ckpt: Path, summary: Path,
                 launch: dict[str, Any]) -> tuple[dict[str, Any], str, list[list[str]]]:
    """Run, hold after ``HOLD_AT``, SIGKILL the worker, release, wait for the end.

    Returns the run summary, every log line, and the held worker's command lines."""
    import psutil

    hold = tmp_path / "hold"
    hold.mkdir()
    env = {"EK_GPU_HOLD_DIR": str(hold), "EK_GPU_HOLD_AT_STEP": str(HOLD_AT),
           "OMP_NUM_THREADS": "2"}
    with LocalCluster([str(HOLD), *script_args], nnodes="1", nproc_per_node=1, max_restarts=1,
                      env=env, log_dir=tmp_path / "logs", cuda=True, **launch) as cluster:
        agent = cluster.add_agent()
        try:
            wait_for(lambda: (hold / "held").exists(), 600, what=f"the hold at step {HOLD_AT}",
                     abort_if=cluster.all_exited)
            wait_for(lambda: HOLD_AT - 1 in committed_steps(ckpt), 120,
                     what=f"checkpoint {HOLD_AT - 1}", abort_if=cluster.all_exited)
        except (TimeoutError, RuntimeError) as e:
            pytest.fail(f"{e}\n{cluster.logs()[-20000:]}")
        held_step = int((hold / "held").read_text())
        cmdlines = [psutil.Process(pid).cmdline() for pid in agent.worker_pids()]
        cluster.kill_worker(agent, local_rank=0)
        (hold / "release").touch()
        codes = cluster.wait(600)
        logs = cluster.logs()
    assert codes == [0], logs[-20000:]
    assert held_step == HOLD_AT
    assert "Cannot re-initialize CUDA" not in logs
    s = json.loads(summary.read_text())
    # for scripts/gpu-check's log (pytest -rP): what the run went through
    print(f"killed at step {held_step}; summary: steps {s['steps']}, epochs {s['epochs']}, "
          f"restarts {s['restarts']}, restored {s['restored_steps']}")
    print("\n".join(line for line in logs.splitlines()
                    if re.search(r"world size 1|validation at step|Epoch: \[\d\] done|"
                                 r"Worker group FAILED|SIGKILL|restor", line)))
    return s, logs, cmdlines


def assert_resumed_after_the_epoch_end(s: dict[str, Any]) -> None:
    assert s["steps"] == TOTAL and s["epochs"] == EPOCHS
    assert s["restarts"] == 1
    (restored,) = s["restored_steps"]
    # the newest committed checkpoint before the kill: after epoch 0's end
    assert STEPS_PER_EPOCH < restored < HOLD_AT + 1, restored
    assert [(h["world_size"], h["restart"]) for h in s["world_sizes"]] == [(1, 0), (1, 1)]


@pytest.mark.parametrize("launch", [{}, FORKED], ids=["torchrun", "forked"])
def test_imagenet_example_trains_validates_saves_and_resumes_after_sigkill_on_gpu(
        tmp_path: Path, launch: dict[str, Any]) -> None:
    import torchvision  # noqa: F401  (needed: a plain import, so its absence is an error)

    ckpt, summary = tmp_path / "ckpt", tmp_path / "summary.json"
    s, logs, cmdlines = kill_mid_run(tmp_path, imagenet_args(ckpt, summary), ckpt, summary,
                                     launch)
    # both worker groups ran on the GPU with NCCL
    starts = re.findall(r"world size 1 \(restart (\d)[^)]*\) on (\S+), backend (\w+)", logs)
    assert starts == [("0", "cuda:0", "nccl"), ("1", "cuda:0", "nccl")], starts
    # validation at the end of both epochs (the second after the resume), and a save
    for step in (STEPS_PER_EPOCH, TOTAL):
        assert f"validation at step {step}:" in logs, logs[-6000:]
    assert_resumed_after_the_epoch_end(s)
    assert 0.0 <= s["final_top1"] <= 100.0 and 0.0 <= s["final_top5"] <= 100.0
    assert s["dataset_size"] == STEPS_PER_EPOCH * BATCH
    # a best model is saved when the accuracy beats the best so far (0 at the start)
    assert len(committed_steps(ckpt / "best")) == (1 if s["best_acc1"] > 0 else 0)
    if launch:  # forked from the agent: the worker carries the launcher's command line
        assert cmdlines and all("elastic_kit.run" in c for c in cmdlines), cmdlines


@pytest.mark.parametrize("launch", [{}, FORKED], ids=["torchrun", "forked"])
def test_own_loop_example_trains_evaluates_saves_and_resumes_after_sigkill_on_gpu(
        tmp_path: Path, launch: dict[str, Any]) -> None:
    ckpt, summary = tmp_path / "ckpt", tmp_path / "summary.json"
    s, logs, cmdlines = kill_mid_run(tmp_path, own_loop_args(ckpt, summary), ckpt, summary,
                                     launch)
    assert logs.count("world size 1 on cuda:0:") == 2, logs[-6000:]
    for epoch, step in ((0, STEPS_PER_EPOCH), (1, TOTAL)):
        assert f"Epoch: [{epoch}] done: step {step}, Acc@1" in logs, logs[-6000:]
    assert_resumed_after_the_epoch_end(s)
    full = [{"epoch": e, "count": STEPS_PER_EPOCH * BATCH,
             "expected": STEPS_PER_EPOCH * BATCH, "ok": True} for e in range(EPOCHS)]
    assert s["audit"] == full  # every sample of both epochs trained once, across the kill
    if launch:
        assert cmdlines and all("elastic_kit.run" in c for c in cmdlines), cmdlines
