"""A stop signal that comes while the script is away from its training steps
(end-of-epoch work, a validation longer than torchrun's 30 s grace) was heard and
never acted on: ``end_epoch()``, which acts on it, came after torchrun's SIGKILL,
and nothing of the epoch's last steps was kept. The signal's watcher now writes the
last step to memory and exits when the stop has not begun 15 s after the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)

_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    import elastic_kit as ek

    out = Path(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ek.ElasticDistributedSampler(list(range(24)))
    state = ek.TrainState(model, opt, sampler=sampler)
    ckpt = ek.Checkpointer(state, sys.argv[1], every_steps=1000, snapshot_every=100)
    start = ckpt.restore()
    print("restored", ckpt.restored_from, ckpt.restored_step, start, flush=True)
    for epoch in range(start, 2):
        sampler.set_epoch(epoch)
        for idx in torch.utils.data.DataLoader(list(range(24)), batch_size=4, sampler=sampler):
            model(torch.randn(4, 4)).square().mean().backward()
            opt.step(); opt.zero_grad()
            ckpt.step(4)
        out.write_text(str(state.step))  # validating: longer than torchrun's grace
        time.sleep(120)
        ckpt.end_epoch()
    ckpt.close()
""")


def test_a_stop_during_a_long_validation_keeps_the_epochs_last_step(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    marker = tmp_path / "validating"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCHELASTIC_RUN_ID": "job", "ELASTIC_KIT_SNAPSHOT_DIR": str(shm)}
    cmd = [sys.executable, str(script), str(tmp_path / "ckpt"), str(marker)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), proc.communicate(timeout=30)
        assert marker.read_text() == "6"
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # what torchrun's agent does
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert took < 29, took  # before torchrun's SIGKILL
    assert "heard but not acted on" in err, err[-3000:]
    # the relaunch resumes at the epoch's last step, from memory, with the epoch closed
    marker.unlink()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert first == ["restored", "memory", "6", "1"], (first, proc.stderr)
