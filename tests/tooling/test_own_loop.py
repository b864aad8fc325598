"""examples/own_loop/train.py run as a plain ``python train.py`` (world size 1, no torchrun).

The script keeps its own loop and is made resumable with ``ek.Checkpointer``: it prints
its own per-batch progress (``[i/len(loader)]`` with a constant ``len(loader)``), writes
a summary JSON, resumes from its checkpoint store when run again, and a SIGTERM in
the middle of an epoch saves, exits with 143, and a rerun ends with the same weights
as a run that was never stopped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic_kit.testing import wait_for

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "own_loop" / "train.py"
SIZE, BATCH, EPOCHS = 96, 16, 2
STEPS_PER_EPOCH = SIZE // BATCH  # 6
#: The script's progress line: ``Epoch: [e] [i/len(loader)] loss ...``.
PROGRESS = re.compile(r"^Epoch: \[(\d+)\] \[(\d+)/(\d+)\] loss ", re.MULTILINE)
RUN_TIMEOUT = 120


def train_cmd(ckpt: Path, summary: Path, *, size: int = SIZE, every: int = 4) -> list[str]:
    return [sys.executable, str(TRAIN), "--synthetic", str(size), "--image-size", "16",
            "--epochs", str(EPOCHS), "-b", str(BATCH), "-j", "0", "-p", "1", "--seed", "1",
            "--lr", "0.05", "--warmup-steps", "3", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", str(every), "--audit", "--summary-json", str(summary)]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_train(ckpt: Path, summary: Path, **kw: Any) -> tuple[str, dict[str, Any]]:
    proc = subprocess.run(train_cmd(ckpt, summary, **kw), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT, env=env())
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout, json.loads(summary.read_text())


def progress(stdout: str) -> dict[int, list[tuple[int, int]]]:
    """``{epoch: [(i, len(loader)), ...]}`` from the per-batch lines, in order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for e, i, n in PROGRESS.findall(stdout):
        out.setdefault(int(e), []).append((int(i), int(n)))
    return out


def full_audit(size: int) -> list[dict[str, Any]]:
    return [{"epoch": e, "count": size, "expected": size, "ok": True} for e in range(EPOCHS)]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    d = tmp_path_factory.mktemp("own_loop")
    stdout, summary = run_train(d / "ckpt", d / "summary.json")
    return d, stdout, summary


def test_prints_every_batch_with_a_constant_loader_length_and_audits_each_epoch(
        first_run: tuple[Path, str, dict[str, Any]]) -> None:
    _, stdout, s = first_run
    assert progress(stdout) == {e: [(i, STEPS_PER_EPOCH) for i in range(STEPS_PER_EPOCH)]
                                for e in range(EPOCHS)}, stdout
    assert s["steps"] == EPOCHS * STEPS_PER_EPOCH and s["epochs"] == EPOCHS
    assert [{k: h[k] for k in ("world_size", "step", "restart", "restored_step")}
            for h in s["world_sizes"]] == [
        {"world_size": 1, "step": 0, "restart": 0, "restored_step": None}]
    assert s["restored_steps"] == []
    assert s["audit"] == full_audit(SIZE)
    assert re.fullmatch(r"[0-9a-f]{64}", s["param_sha256"])
    assert re.fullmatch(r"[0-9a-f]{64}", s["ema_sha256"])
    assert s["ema_sha256"] != s["param_sha256"]
    assert 0.0 <= s["best_acc1"] <= 100.0


def test_second_run_on_the_same_store_restores_and_does_not_retrain(
        first_run: tuple[Path, str, dict[str, Any]]) -> None:
    d, _, first = first_run
    stdout, s = run_train(d / "ckpt", d / "again.json")
    assert progress(stdout) == {}, stdout  # nothing left to train
    assert s["steps"] == first["steps"] and s["epochs"] == EPOCHS
    assert s["restored_steps"] == [EPOCHS * STEPS_PER_EPOCH]
    assert [h["world_size"] for h in s["world_sizes"]] == [1, 1]
    assert s["audit"] == first["audit"]
    assert s["best_acc1"] == first["best_acc1"]
    assert (s["param_sha256"], s["ema_sha256"]) == (first["param_sha256"], first["ema_sha256"])


def test_sigterm_mid_epoch_saves_exits_143_and_the_rerun_ends_with_identical_weights(
        tmp_path: Path) -> None:
    size, every = 480, 2  # 30 steps per epoch: room to stop well inside epoch 0
    steps_per_epoch = size // BATCH
    _, reference = run_train(tmp_path / "ref", tmp_path / "ref.json", size=size, every=every)

    ckpt = tmp_path / "ckpt"
    log_path = tmp_path / "stopped.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(train_cmd(ckpt, tmp_path / "stopped.json", size=size,
                                          every=every),
                                stdout=log, stderr=subprocess.STDOUT, env=env())
    try:
        wait_for(lambda: (ckpt / "step-000000000004" / "manifest.json").exists(), RUN_TIMEOUT,
                 interval=0.02, what="checkpoint step 4", abort_if=lambda: proc.poll() is not None)
        # Held still while the signal is delivered, so it lands inside epoch 0.
        psutil.Process(proc.pid).suspend()
        proc.send_signal(signal.SIGTERM)
        psutil.Process(proc.pid).resume()
        rc = proc.wait(RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 143, log_path.read_text()[-6000:]
    assert not (tmp_path / "stopped.json").exists()

    stdout, s = run_train(ckpt, tmp_path / "resumed.json", size=size, every=every)
    (stopped_at,) = s["restored_steps"]
    assert 4 <= stopped_at < steps_per_epoch  # the SIGTERM save, mid-epoch 0
    resumed = progress(stdout)
    assert resumed[0] == [(i, steps_per_epoch - stopped_at)
                          for i in range(steps_per_epoch - stopped_at)]
    assert s["steps"] == reference["steps"] == EPOCHS * steps_per_epoch
    assert s["audit"] == reference["audit"] == full_audit(size)
    assert s["param_sha256"] == reference["param_sha256"]
    assert s["ema_sha256"] == reference["ema_sha256"]


def test_checkpoint_every_0_saves_at_epoch_ends_only(tmp_path: Path) -> None:
    _, s = run_train(tmp_path / "ckpt", tmp_path / "s.json", every=0)
    assert s["steps"] == EPOCHS * STEPS_PER_EPOCH and s["audit"] == full_audit(SIZE)
    saved = sorted(int(p.name.split("-")[-1]) for p in (tmp_path / "ckpt").iterdir()
                   if p.name.startswith("step-"))
    assert saved == [STEPS_PER_EPOCH * e for e in range(1, EPOCHS + 1)]
