"""Optimizer states of an FSDP2 model (DTensor parameters; one gloo rank: they are
DTensors all the same) through a real store: a parameter that had no gradient yet
when the state was saved (an unrouted expert, a head used later) has no optimizer
state, and an optimizer kept in ``extras`` was read without a layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.store import is_dtensor
from elastic_kit.testing import spawn_multi_process

pytestmark = pytest.mark.timeout(180)


class _Net(nn.Module):
    def __init__(self) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        super().__init__()
        # activation checkpointing (the usual FSDP recipe): torch names its parameters
        # without the wrapper's ``_checkpoint_wrapped_module.``
        self.body = checkpoint_wrapper(nn.Linear(4, 4))
        self.aux = nn.Linear(4, 2)  # no gradient until ``use_aux``

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        y = torch.tanh(self.body(x))
        return self.aux(y).sum() if use_aux else y.square().sum()


def _model(seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _Net()
    fully_shard(model.body)
    fully_shard(model)
    return model


def _step(model: nn.Module, opts: list[torch.optim.Optimizer], x: torch.Tensor,
          use_aux: bool) -> None:
    model(x, use_aux).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def _params(model: nn.Module) -> list[list[float]]:
    return [p.full_tensor().flatten().tolist() for p in model.parameters()]


def _runs(url: str) -> dict[str, Any]:
    ek.init_distributed()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))
    out: dict[str, Any] = {}
    # 1. AdamW over every parameter; ``aux`` has no gradient before the save
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, [opt], x, use_aux=False)
    store = ek.CheckpointStore(f"{url}/unused")
    store.save(ek.TrainState(model, opt).state_dict(), step=1)
    store.wait()
    for _ in range(2):  # the run going on: ``aux`` first trained in the next step
        _step(model, [opt], x, use_aux=True)
    resumed = _model(1)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.01)
    try:
        ek.load_checkpoint(ek.TrainState(resumed, resumed_opt), store)
    except Exception as e:  # noqa: BLE001 - the test reports it
        out["unused/error"] = f"{type(e).__name__}: {e}"
    out["unused/aux_state"], out["unused/body_state"] = (
        [len(resumed_opt.state.get(p, {})) for p in part.parameters()]
        for part in (resumed.aux, resumed.body))
    for _ in range(2):
        _step(resumed, [resumed_opt], x, use_aux=True)
    out["unused/going_on"], out["unused/resumed"] = _params(model), _params(resumed)
    store.close()

    # 2. a second optimizer in extras, over the sharded ``aux``
    model = _model(0)
    opt, opt2 = (torch.optim.AdamW(model.body.parameters(), lr=0.01),
                 torch.optim.SGD(model.aux.parameters(), lr=0.05, momentum=0.9))
    for _ in range(2):
        _step(model, [opt, opt2], x, use_aux=True)
    store = ek.CheckpointStore(f"{url}/extras")
    store.save(ek.TrainState(model, opt, extras={"opt2": opt2}).state_dict(), step=2)
    store.wait()
    _step(model, [opt, opt2], x, use_aux=True)
    resumed = _model(1)
    r_opt, r_opt2 = (torch.optim.AdamW(resumed.body.parameters(), lr=0.01),
                     torch.optim.SGD(resumed.aux.parameters(), lr=0.05, momentum=0.9))
    ek.load_checkpoint(ek.TrainState(resumed, r_opt, extras={"opt2": r_opt2}), store)
    out["extras/dtensor_state"] = [is_dtensor(r_opt2.state[p]["momentum_buffer"])
                                   for p in resumed.aux.parameters()]
    try:
        _step(resumed, [r_opt, r_opt2], x, use_aux=True)
    except RuntimeError as e:
        out["extras/error"] = str(e)
    out["extras/going_on"], out["extras/resumed"] = _params(model), _params(resumed)
    store.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return spawn_multi_process(1, _runs, str(tmp_path_factory.mktemp("ckpt")))[0]


def test_a_parameter_without_optimizer_state_restores_and_first_trains_as_if_never_saved(
        runs: dict[str, Any]) -> None:
    assert "unused/error" not in runs, runs.get("unused/error")
    # left without state, as saved: its first step after the restore is an optimizer's
    # first step, not a second one after a zero-gradient step
    assert runs["unused/aux_state"] == [0, 0]
    assert runs["unused/body_state"] == [3, 3]  # AdamW's step, exp_avg, exp_avg_sq
    assert runs["unused/resumed"] == runs["unused/going_on"]


def test_an_optimizer_in_extras_gets_its_state_laid_out_as_its_sharded_parameters(
        runs: dict[str, Any]) -> None:
    assert runs["extras/dtensor_state"] == [True, True]
    assert "extras/error" not in runs, runs.get("extras/error")
    assert runs["extras/resumed"] == runs["extras/going_on"]
