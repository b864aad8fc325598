"""A resumed epoch draws the augmentation the uninterrupted run drew.

examples/own_loop/train.py on an image folder: torchvision's ``RandomResizedCrop``
and ``RandomHorizontalFlip`` run in two data-loader worker processes per rank
(``-j 2``), drawing from torch's generator. A worker SIGKILLed mid-epoch makes
torchrun restart the group; the loader's new iterator has other worker seeds and
another sample-to-worker assignment, and still the final weights are bitwise those
of the uninterrupted run, because the script wraps its dataset in
``ek.SeededDataset`` and the sampler deals it ``(epoch, index)`` keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastic_kit.testing import LocalCluster, make_imagefolder, wait_for
from tests.fork_launch import FORK_LAUNCH
from tests.torchrun.scenarios.harness import committed_steps

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "own_loop" / "train.py"
CLASSES, PER_CLASS, BATCH, EPOCHS, WORLD = 4, 24, 4, 2, 2
STEPS_PER_EPOCH = CLASSES * PER_CLASS // (BATCH * WORLD)  # 12
RUN_TIMEOUT = 240.0



def _run(data: Path, tmp: Path, name: str, *, kill: bool) -> dict[str, Any]:
    ckpt, summary = tmp / f"{name}-ckpt", tmp / f"{name}.json"
    args = [str(TRAIN), str(data), "--arch", "tinycnn", "--image-size", "16",
            "--epochs", str(EPOCHS), "-b", str(BATCH), "-j", "2", "-p", "100", "--seed", "3",
            "--lr", "0.05", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3",
            "--snapshot-every", "0", "--summary-json", str(summary)]
    with LocalCluster(args, nnodes="1", nproc_per_node=WORLD, max_restarts=1 if kill else 0,
                      env={"OMP_NUM_THREADS": "1"}, log_dir=tmp / f"{name}-logs",
                      **(FORK_LAUNCH if kill else {})) as cluster:
        agent = cluster.add_agent()
        if kill:
            try:
                wait_for(lambda: 3 in committed_steps(ckpt), 120.0, interval=0.02,
                         what="checkpoint step 3", abort_if=cluster.all_exited)
            except (TimeoutError, RuntimeError) as e:
                pytest.fail(f"{e}\n{cluster.logs()[-8000:]}")
            paused = cluster.pause_workers()  # the kill lands inside epoch 0
            try:
                cluster.kill_worker(agent, local_rank=1)
            finally:
                cluster.resume_workers(paused)
        if cluster.wait(RUN_TIMEOUT) != [0]:
            pytest.fail(f"the {name} run failed\n{cluster.logs()[-8000:]}")
    return json.loads(summary.read_text())


def test_a_worker_killed_mid_epoch_resumes_with_the_same_random_crops_and_flips(
        tmp_path: Path) -> None:
    data = make_imagefolder(tmp_path / "images", classes=CLASSES, per_class=PER_CLASS,
                            val_per_class=4, size=24, seed=1)
    reference = _run(data, tmp_path, "reference", kill=False)
    killed = _run(data, tmp_path, "killed", kill=True)
    assert reference["steps"] == killed["steps"] == EPOCHS * STEPS_PER_EPOCH
    (restored,) = killed["restored_steps"]
    assert 3 <= restored < STEPS_PER_EPOCH  # resumed inside epoch 0
    assert killed["param_sha256"] == reference["param_sha256"]
    assert killed["ema_sha256"] == reference["ema_sha256"]
