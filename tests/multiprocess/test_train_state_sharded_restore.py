"""TrainState of an FSDP2 model (``fully_shard``, DTensor parameters) in a gloo group
(of one rank: the parameters are DTensors all the same): a model whose blocks are
compiled one by one restores, and a state taken before the optimizer's first step
changes nothing of the run, nor of a run resumed from it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import elastic_kit as ek
from elastic_kit.errors import CheckpointMismatchError
from elastic_kit.store import is_dtensor
from elastic_kit.testing import spawn_multi_process

pytestmark = pytest.mark.timeout(120)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _model(seed: int, *, compiled: bool = False) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _Blocks()
    for i, block in enumerate(model.layers):
        fully_shard(block)
        if compiled:  # each block compiled on its own, inside the model (torchtitan)
            model.layers[i] = torch.compile(block, backend="eager")
    fully_shard(model)
    return model


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _params(model: nn.Module) -> list[list[float]]:
    return [p.full_tensor().flatten().tolist() for p in model.parameters()]


def _copy(sd: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint keeps: the state's tensors as they are now."""
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, sd)


def _compiled_blocks_round_trip() -> dict[str, Any]:
    ek.init_distributed()
    model = _model(0, compiled=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, 2, seed=5)
    saved = _copy(ek.TrainState(model, opt).state_dict())
    keys = sorted(saved["model"])
    _train(model, opt, 2, seed=6)  # the run going on from the save
    other = _model(1, compiled=True)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    ek.TrainState(other, other_opt).load_state_dict(saved)
    _train(other, other_opt, 2, seed=6)  # the run resumed from the save
    return {"keys": keys, "keys_after_load": sorted(saved["model"]),
            "going_on": _params(model), "resumed": _params(other)}


def test_fsdp_model_with_compiled_blocks_restores_and_resumes_bit_for_bit() -> None:
    out = spawn_multi_process(1, _compiled_blocks_round_trip)
    for rank in out:
        assert rank["keys"] == ["layers.0.bias", "layers.0.weight", "layers.1.bias",
                                "layers.1.weight"]
        assert rank["keys_after_load"] == rank["keys"]  # the loaded dict is left as given
        assert rank["resumed"] == rank["going_on"]


def _fresh_optimizer_runs() -> dict[str, Any]:
    ek.init_distributed()
    out: dict[str, Any] = {}
    for kind in ("sgd", "adam"):
        plain = _model(0)
        plain_opt = _optimizer(kind, plain)
        _train(plain, plain_opt, 3, seed=7)
        out[f"{kind}/plain"] = _params(plain)

        model = _model(0)
        opt = _optimizer(kind, model)
        state = ek.TrainState(model, opt)
        at_step_0 = state.state_dict()  # a step-0 snapshot, an initial checkpoint
        out[f"{kind}/state_after_state_dict"] = len(opt.state)
        out[f"{kind}/layout_dtensors"] = sum(
            is_dtensor(v) for s in at_step_0["optimizer"]["state"].values() for v in s.values())
        saved = _copy(at_step_0)
        _train(model, opt, 3, seed=7)
        out[f"{kind}/after_state_dict"] = _params(model)

        resumed = _model(1)
        resumed_opt = _optimizer(kind, resumed)
        ek.TrainState(resumed, resumed_opt).load_state_dict(saved)
        out[f"{kind}/state_after_load"] = len(resumed_opt.state)
        _train(resumed, resumed_opt, 3, seed=7)
        out[f"{kind}/resumed"] = _params(resumed)

    # a load that fails once torch has given the fresh optimizer its state
    model = _model(0)
    opt = _optimizer("adam", model)
    _train(model, opt, 1, seed=8)
    broken = _copy(ek.TrainState(model, opt).state_dict())
    broken["optimizer"]["state"]["layers.1.bias"]["step"] = None  # torch's load: TypeError
    fresh = _model(1)
    fresh_opt = _optimizer("adam", fresh)
    try:
        ek.TrainState(fresh, fresh_opt).load_state_dict(broken)
        out["failed_load"] = None
    except CheckpointMismatchError as e:
        out["failed_load"] = str(e)
    out["state_after_failed_load"] = len(fresh_opt.state)
    return out


@pytest.fixture(scope="module")
def fresh_runs() -> list[dict[str, Any]]:
    return spawn_multi_process(1, _fresh_optimizer_runs)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_state_dict_before_the_first_step_leaves_the_run_unchanged(
        fresh_runs: list[dict[str, Any]], kind: str) -> None:
    for rank in fresh_runs:
        assert rank[f"{kind}/state_after_state_dict"] == 0
        assert rank[f"{kind}/after_state_dict"] == rank[f"{kind}/plain"]
        # the state still gives a restore the optimizer's layout to read shards into
        # (SGD: momentum_buffer; Adam: exp_avg, exp_avg_sq; of 4 parameters)
        assert rank[f"{kind}/layout_dtensors"] == {"sgd": 4, "adam": 8}[kind]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_resume_from_a_state_taken_before_the_first_step_is_a_fresh_start(
        fresh_runs: list[dict[str, Any]], kind: str) -> None:
    for rank in fresh_runs:
        assert rank[f"{kind}/state_after_load"] == 0
        assert rank[f"{kind}/resumed"] == rank[f"{kind}/plain"]


def test_a_failed_load_leaves_a_fresh_optimizer_fresh(
        fresh_runs: list[dict[str, Any]]) -> None:
    for rank in fresh_runs:
        assert rank["failed_load"].startswith("checkpoint does not fit the model: float() "
                                              "argument must be"), rank["failed_load"]
        assert rank["state_after_failed_load"] == 0
