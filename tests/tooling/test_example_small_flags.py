"""Flags of the own-loop and FSDP examples that a user may set to 0: ``--print-freq 0``
prints no progress line (as in the ImageNet example) instead of dividing by zero at
the first batch, a batch size of 0 is refused when the flags are read, naming the
value; and the own-loop README's ``diff -u plain_train.py train.py`` is the files'."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OWN = ROOT / "examples" / "own_loop"
FSDP = ROOT / "examples" / "fsdp" / "train.py"
TIMEOUT = 180


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("script, flag", [
    (OWN / "train.py", "-b"), (OWN / "plain_train.py", "-b"), (FSDP, "--global-batch")])
def test_a_batch_size_of_0_is_refused_naming_the_flag(tmp_path: Path, script: Path,
                                                     flag: str) -> None:
    proc = _run([str(script), flag, "0"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{flag}" in proc.stderr and "'0': expected an integer >= 1" in proc.stderr


@pytest.mark.parametrize("script", ["plain_train.py", "train.py"])
def test_own_loop_with_print_freq_0_trains_silently(tmp_path: Path, script: str) -> None:
    proc = _run([str(OWN / script), "--synthetic", "32", "--image-size", "16",
                 "--epochs", "1", "-b", "8", "-j", "0", "-p", "0",
                 "--checkpoint-dir", str(tmp_path / "ckpt")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not re.search(r"Epoch: \[\d+\] \[", proc.stdout), proc.stdout


def test_fsdp_example_with_print_freq_0_trains_silently(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    proc = _run([str(FSDP), "--samples", "24", "--epochs", "1", "--global-batch", "8",
                 "--print-freq", "0", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--snapshot-every", "0", "--summary-json", str(summary)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary.exists()
    assert not re.search(r"step \d+ .*loss", proc.stdout + proc.stderr), proc.stdout


def test_the_readme_diff_is_the_files_diff() -> None:
    readme = (OWN / "README.md").read_text()
    block = re.search(r"```diff\n--- plain_train.py\n\+\+\+ train.py\n(.*?)```", readme,
                      re.DOTALL)
    assert block is not None
    proc = subprocess.run(["diff", "-u", "plain_train.py", "train.py"], cwd=OWN,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    actual = proc.stdout.split("\n", 2)[2]             # without the two file lines
    assert block.group(1) == actual
    plain, elastic = (len((OWN / n).read_text().splitlines())
                      for n in ("plain_train.py", "train.py"))
    assert f"({plain} lines -> {elastic} lines)" in readme
