"""Sharded (FSDP2 / DTensor) state on real gloo ranks: each rank writes its own shards,
any world size loads them, and what it loads is the saved state, bit for bit.

Every job builds the same tiny model (three linear blocks, ``fully_shard`` per block
and on the root), trains a few AdamW steps, saves through ``TrainState`` and
``CheckpointStore``; a job at another world size loads into a freshly built model and
returns the full state gathered with ``full_state_dict=True``, compared in the parent
with what the saving job gathered.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from elastic_kit.testing import spawn_multi_process

pytestmark = pytest.mark.timeout(300)


def _model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # odd sizes: shards are uneven at 2 and 3 ranks, one rank's shard may be empty
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 4),
                                torch.nn.Linear(4, 2))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The full (gathered) model and optimizer state, as lists (on rank 0 only: with
    ``cpu_offload`` the other ranks get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False))
    out = {f"model/{k}": v for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():
        for k, v in st.items():
            out[f"opt/{fqn}/{k}"] = v
    return {k: (v.dtype.__repr__(), v.tolist()) if isinstance(v, torch.Tensor) else v
            for k, v in out.items()}


def _save_job(url: str, storage_options: dict | None, step: int, seed: int) -> dict:
    import elastic_kit as ek

    info = ek.init_distributed()
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 3, seed)
    state = ek.TrainState(model, opt)
    state.step = step
    state.extras["note"] = f"saved at {info.world_size}"
    store = ek.CheckpointStore(url, storage_options=storage_options)
    assert state.sharded
    store.save(state.state_dict(), step=step, metadata={"epoch": 0})
    store.close()
    return {"full": _full(model, opt), "rank": info.rank}


def _load_job(url: str, storage_options: dict | None, seed: int, then_save: int | None) -> dict:
    import elastic_kit as ek

    info = ek.init_distributed()
    model = _model(seed + 1000)  # other initial weights: all must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ek.TrainState(model, opt)
    store = ek.CheckpointStore(url, storage_options=storage_options)
    loaded = store.load(into=state.state_dict)
    state.load_state_dict(loaded.state)
    full = _full(model, opt)
    if then_save is not None:
        state.step = then_save
        store.save(state.state_dict(), step=then_save)
    store.close()
    return {"full": full, "step": loaded.step, "note": state.extras["note"],
            "world_size": loaded.world_size, "rank": info.rank}


def test_resharded_restore_2_3_1_2_is_bit_identical(tmp_path) -> None:
    url = str(tmp_path / "ckpt")
    saved = spawn_multi_process(2, _save_job, url, None, 5, 1)
    reference = saved[0]["full"]
    assert len(reference) == 6 + 6 * 3  # weights and biases; exp_avg, exp_avg_sq, step
    step = 5
    for world in (3, 1, 2):
        got = spawn_multi_process(world, _load_job, url, None, 1, step + 1)
        for r in got:
            assert r["step"] == step
            assert r["note"] == "saved at 2"
        assert got[0]["full"].keys() == reference.keys()
        assert got[0]["full"] == reference, f"world {world}"
        step += 1
    manifest = json.loads((tmp_path / "ckpt" / f"step-{step:012d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["format"].endswith("+sharded")
    # each of the two ranks wrote its own shard file, beside the replicated payload
    assert sorted(manifest["files"]) == ["shards-00000.bin", "shards-00001.bin", "state.pt"]
