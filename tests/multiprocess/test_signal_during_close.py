"""A SIGTERM while ``close()`` writes the final checkpoint (a scheduler's time limit,
a pod deleted, torchrun's restart when a peer fails at the very end): the handlers
were removed before the wait for the last save, so the default action ended the
process with the final checkpoint never committed. It is now noted, the save
finishes, and the process exits with the checkpointer's exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_kit.store import CheckpointStore

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)

_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, fsspec, torch
    import elastic_kit as ek
    from elastic_kit.testing import FaultFileSystem

    closing = False

    sent = []

    def slow_final_write(path):
        if closing and not sent and sys.argv[3] == "during":  # while the final save is written
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)

    got = []
    if sys.argv[2] == "own":  # the script's own handler, installed before the checkpointer
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("write", match="state", times=None, before=slow_final_write)
    store = ek.CheckpointStore(sys.argv[1], filesystem=ffs)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ek.ElasticDistributedSampler(list(range(16)))
    state = ek.TrainState(model, opt, sampler=sampler)
    ckpt = ek.Checkpointer(state, store, snapshot_every=0)
    for epoch in range(ckpt.restore(), 1):
        sampler.set_epoch(epoch)
        for x in torch.utils.data.DataLoader(list(range(16)), batch_size=4, sampler=sampler):
            model(torch.randn(4, 4)).square().mean().backward()
            opt.step(); opt.zero_grad()
            ckpt.step(4)
        closing = True
        ckpt.end_epoch()  # its save, non-blocking, is written while close() waits
    if sys.argv[3] == "before":  # after the last step's work, before close()
        os.kill(os.getpid(), signal.SIGTERM)
    ckpt.close()
    print("after close", got, flush=True)
""")


@pytest.mark.parametrize("when", ["during", "before"])
@pytest.mark.parametrize("handler", ["default", "own"])
def test_a_sigterm_during_close_waits_for_the_final_checkpoint(tmp_path: Path,
                                                               handler: str, when: str) -> None:
    """With the default action the process then exits with the checkpointer's exit code;
    a handler of the script's own installed before the checkpointer gets the signal
    then, and the script goes on. So does a signal noted after the last end_epoch()
    and before close() (nothing acted on it: it was dropped)."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    url = str(tmp_path / "ck")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCHELASTIC_RUN_ID": "job"}
    done = subprocess.run([sys.executable, str(script), url, handler, when], env=env,
                          capture_output=True, text=True, timeout=150)
    if handler == "default":
        assert done.returncode == 143, (done.returncode, done.stderr[-3000:])
        assert "after close" not in done.stdout
        assert "SIGTERM as training ended: the last checkpoint was written first" in done.stderr, (
            done.stderr[-3000:])
    else:
        assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
        assert done.stdout.strip().splitlines()[-1] == f"after close [{int(signal.SIGTERM)}]"
    infos = CheckpointStore(url).list()
    assert [(i.step, i.metadata["epoch"]) for i in infos] == [(4, 1)], done.stderr[-3000:]
