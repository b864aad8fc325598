"""The minimal example as a real process: plain ``python``, SIGTERM, SIGKILL, resume."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_kit.store import CheckpointStore

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "minimal" / "train.py"
EPOCHS = 2  # 96 samples / global batch 12: 8 steps per epoch, 16 in all


def _cmd(url: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--ckpt", str(url), "--epochs", str(EPOCHS), *extra]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _final_model(url: Path) -> tuple[int, dict[str, Any]]:
    loaded = CheckpointStore(str(url)).load()
    assert loaded is not None
    return loaded.step, loaded.state


def _wait_for(pred: Any, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"script exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for the script"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess,
                                                                  Path]:
    url = tmp_path_factory.mktemp("ref") / "ckpt"
    proc = subprocess.run(_cmd(url), capture_output=True, text=True, timeout=120, env=_env(),
                          cwd=ROOT)
    return proc, url


def test_minimal_example_runs_without_torchrun(reference: Any) -> None:
    proc, url = reference
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: step 16, epoch 2" in proc.stdout
    assert "epoch 1: loss" in proc.stdout and "audit ok=True" in proc.stdout
    step, state = _final_model(url)
    assert step == 16 and state["epoch"] == EPOCHS
    assert [a["ok"] for a in state["audit"]] == [True, True]
    assert [a["count"] for a in state["audit"]] == [96, 96]
    assert state["history"] == [
        {"world_size": 1, "step": 0, "restart": 0, "restored_step": None,
        "restored_from": None}]


def _assert_same_model(url: Path, ref_url: Path) -> None:
    step, state = _final_model(url)
    ref_step, ref = _final_model(ref_url)
    assert step == ref_step
    for name, tensor in ref["model"].items():
        assert torch.equal(state["model"][name], tensor), name
    assert [a["ok"] for a in state["audit"]] == [True, True]


def test_sigterm_saves_current_step_and_exits_nonzero(reference: Any, tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        # No periodic checkpoints: the only mid-run checkpoint is the SIGTERM one.
        proc = subprocess.Popen(_cmd(url, "--step-sleep", "0.05", "--checkpoint-every", "1000"),
                                stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        try:
            _wait_for(lambda: re.search(r"step 4 epoch 0", log.read_text()), 90, proc)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=30)  # torchrun would SIGKILL after 30 s
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert rc == 143, text[-3000:]
    saved = int(re.search(r"SIGTERM: checkpoint step (\d+) saved", text).group(1))
    assert 4 <= saved < 16
    step, state = _final_model(url)
    assert step == saved == state["step"]
    # resume and finish: the same weights as the uninterrupted run
    done = subprocess.run(_cmd(url), capture_output=True, text=True, timeout=120, env=_env(),
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"restored checkpoint step {saved}" in done.stderr
    _assert_same_model(url, reference[1])


def test_sigkill_then_resume_gives_identical_weights(reference: Any, tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    proc = subprocess.Popen(_cmd(url, "--step-sleep", "0.05", "--checkpoint-every", "3"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
                            cwd=ROOT)
    try:
        store = CheckpointStore(str(url))
        _wait_for(lambda: (store.latest_step() or 0) >= 6, 90, proc)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = CheckpointStore(str(url)).latest_step()
    assert killed_at is not None and killed_at < 16
    done = subprocess.run(_cmd(url, "--checkpoint-every", "3"), capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restored checkpoint step" in done.stderr
    _assert_same_model(url, reference[1])
