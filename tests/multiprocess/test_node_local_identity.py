"""A node-local durable store (every node writes its own disk) holds the run's identity
in every node's directory: rank 0 landing on another node after a restart does not
make a new one, which would have taken every snapshot of the run for another run's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.testing import spawn_multi_process

N = 40


def _life(base: str, hosts: list[str], steps: int | None) -> dict[str, Any]:
    """One life of a 2-rank job, each rank on its own "host" (its own disk and shared
    memory): ``steps`` steps then a crash (None: restore only)."""
    rank = int(os.environ["RANK"])
    host = hosts[rank]
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = f"{base}/{host}/shm"
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = host
    torch.manual_seed(0)
    ek.init_distributed()
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=g),
                                          torch.randint(0, 2, (N,), generator=g))
    sampler = ek.ElasticDistributedSampler(data, seed=3)
    state = ek.TrainState(model, opt, sampler=sampler)
    store = ek.CheckpointStore(f"{base}/{host}/disk", node_local=True)
    ckpt = ek.Checkpointer(state, store, every_steps=4, snapshot_every=3,
                           save_at_epoch_end=False, handle_signals=False,
                           heartbeat_timeout=0, handle_preemption=False)
    ckpt.restore()
    out = {"host": host, "restored": ckpt.restored_step, "from": ckpt.restored_from,
           "identity": store.run_identity(create=False)}
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    sampler.set_epoch(state.epoch)
    for i, (x, y) in enumerate(loader):
        if steps is None or i >= steps:
            break
        w = ckpt.sample_weights(len(x))
        loss = (nn.functional.cross_entropy(model(x), y, reduction="none") * w).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(len(x))
    if ckpt.snapshots is not None:
        ckpt.snapshots.wait(timeout=60)
    ckpt.abandon()                       # a crash: the snapshots stay
    return out


def test_rank_0_on_another_node_keeps_the_runs_snapshots(tmp_path: Path) -> None:
    base = str(tmp_path)
    for host in ("hostA", "hostB"):
        os.makedirs(f"{base}/{host}/shm")
    first = spawn_multi_process(2, _life, base, ["hostA", "hostB"], 6, local_world_size=1)
    assert [o["restored"] for o in first] == [None, None]
    # durable step 4 on both disks, snapshot step 6 in both memories
    again = spawn_multi_process(2, _life, base, ["hostB", "hostA"], None, local_world_size=1)
    assert [(o["host"], o["restored"], o["from"]) for o in again] == [
        ("hostB", 6, "memory"), ("hostA", 6, "memory")]
    assert again[0]["identity"] == again[1]["identity"] is not None


def test_a_node_whose_disk_held_another_runs_identity_takes_the_runs_on(
        tmp_path: Path) -> None:
    """Reused disks: hostA's directory holds the identity of an old run X (no step),
    hostB's that of an old run Y with step 4. The run resumes from Y's newest state;
    hostA's directory, kept as X, made Y's snapshots "another run's" once hostB was gone
    (removed, and the restart went back to the durable step)."""
    base = str(tmp_path)
    for host in ("hostA", "hostB"):
        os.makedirs(f"{base}/{host}/shm")
    spawn_multi_process(1, _life, base, ["hostA"], 2)   # old run X: an identity, no save
    spawn_multi_process(1, _life, base, ["hostB"], 5)   # old run Y: step 4, snapshot 5
    first = spawn_multi_process(2, _life, base, ["hostA", "hostB"], 6, local_world_size=1)
    assert [(o["restored"], o["from"]) for o in first] == [(5, "peer")] * 2  # hostB's
    # durable step 8 on both disks, snapshots up to step 11 in both memories; hostB
    # is gone
    alone = spawn_multi_process(1, _life, base, ["hostA"], None)
    assert [(o["restored"], o["from"]) for o in alone] == [(11, "memory")]
    assert alone[0]["identity"] == first[1]["identity"]  # hostA's is Y's now
