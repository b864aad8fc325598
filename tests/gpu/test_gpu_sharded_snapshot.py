"""Sharded (FSDP2) state on CUDA in the in-memory snapshots: each rank's local shards
(CUDA tensors) are copied into its part's file, and a restore rebuilds CUDA DTensors
from it, equal to what was saved.

One rank, one GPU (NCCL; FSDP2 needs a process group even of one). Skipped without
CUDA; run by ``scripts/gpu-check``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from elastic_kit.testing import spawn_multi_process

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


def _job(shm: str) -> dict:
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = "node0"
    import elastic_kit as ek
    from elastic_kit.snapshot import SnapshotTier
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    info = ek.init_distributed()

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)).cuda()
        for block in model:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(4, 64, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optimizer": osd}

    def full(model: torch.nn.Module) -> dict:
        return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}

    model, opt = build(1)
    tier = SnapshotTier("/durable", info=info, every=1, identity="gpu", sharded=True)
    tier.connect()
    tier.save(state(model, opt), step=3, metadata={"epoch": 0})
    assert tier.wait(timeout=60)
    tier.close(remove=False)
    saved = full(model)

    other, other_opt = build(2)  # other weights: all must come from the snapshot
    again = SnapshotTier("/durable", info=info, every=1, identity="gpu", sharded=True)
    again.connect()
    loaded = again.load(into=lambda: state(other, other_opt), map_location="cuda")
    assert loaded is not None and loaded.step == 3
    weight = loaded.state["model"]["0.weight"]
    assert weight.to_local().device.type == "cuda"
    set_state_dict(other, other_opt, model_state_dict=loaded.state["model"],
                   optim_state_dict=loaded.state["optimizer"])
    got = full(other)
    again.close(remove=True)
    return {"equal": all(torch.equal(saved[k], got[k]) for k in saved),
            "keys": sorted(saved) == sorted(got), "own": again.loaded_own}


def test_cuda_shards_are_snapshotted_and_restored_to_the_device(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    (out,) = spawn_multi_process(1, _job, str(shm), cuda=True, timeout=300)
    assert out == {"equal": True, "keys": True, "own": True}
