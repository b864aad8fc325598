"""A snapshot's sample audit: the ranks' shares are summed without holding training up,
and the snapshot still holds the audit of exactly its step."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elastic_kit as ek
from elastic_kit.testing import spawn_multi_process

pytestmark = pytest.mark.timeout(180)

N = 32
BATCH = 4  # per rank: 8 samples a step over two ranks


def _life(url: str, shm: str, flag: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps, snapshot (rank 1 only once rank 0's snapshot call has
    returned), train one more step without snapshotting, and end without closing;
    or, with ``steps == 0``, restore and report."""
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = "node0"
    info = ek.init_distributed()
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(N, 2), torch.randn(N, 1))
    sampler = ek.ElasticDistributedSampler(data, seed=1)
    state = ek.TrainState(model, opt, sampler=sampler)
    ckpt = ek.Checkpointer(state, url, every_steps=1000, snapshot_every=1000, audit=True,
                           handle_signals=False)
    ckpt.restore()
    if steps == 0:
        return {"restored_step": ckpt.restored_step, "from": ckpt.restored_from,
                "audit": state.audit.state_dict()}
    it = iter(DataLoader(data, batch_size=BATCH, sampler=sampler))

    def train_step() -> None:
        x, y = next(it)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(len(x))

    for _ in range(steps):
        train_step()
    if info.rank == 0:
        ckpt.snapshot()
        Path(flag).touch()  # the peer has not taken its snapshot yet
    else:
        deadline = time.monotonic() + 20.0
        while not os.path.exists(flag):
            assert time.monotonic() < deadline, "rank 0's snapshot waited for rank 1"
            time.sleep(0.01)
        ckpt.snapshot()
    train_step()  # a step after the snapshot: not in its audit
    written = ckpt.snapshots.wait(timeout=30.0) if ckpt.snapshots is not None else False
    return {"written": written, "step": state.step}


def test_a_snapshot_does_not_wait_for_the_peers_audit_share_and_holds_all_of_it(
        tmp_path: Path) -> None:
    url, shm, flag = str(tmp_path / "ckpt"), tmp_path / "shm", str(tmp_path / "taken")
    shm.mkdir()
    first = spawn_multi_process(2, _life, url, str(shm), flag, 2)
    assert first[0] == {"written": True, "step": 3}
    again = spawn_multi_process(2, _life, url, str(shm), flag, 0)
    assert again[0]["restored_step"] == 2 and again[0]["from"] == "memory"
    (epoch0,) = again[0]["audit"]
    # two steps of both ranks' samples, summed over the ranks: not the third step
    assert epoch0["epoch"] == 0 and epoch0["count"] == 2 * 2 * BATCH
    assert again[1]["audit"] == again[0]["audit"]
