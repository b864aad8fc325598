"""The scheduler's and the scaler's states in a TrainState load: a checkpoint whose
state does not fit them changes nothing (their fit is only known by loading them),
a disabled scaler's empty state is no state, and a live EMA the checkpoint lacks is
said to keep its fresh weights."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.errors import CheckpointMismatchError


def _state(seed: int, *, scaler: bool = True, ema: bool = False) -> ek.TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    extras: dict[str, Any] = {}
    if ema:
        extras["model_ema"] = torch.optim.swa_utils.AveragedModel(model)
    return ek.TrainState(model, opt, scheduler=sched, extras=extras,
                         scaler=torch.amp.GradScaler("cpu", enabled=scaler, init_scale=64.0))


def _trained(seed: int, **kw: Any) -> dict[str, Any]:
    state = _state(seed, **kw)
    state.model(torch.ones(4, 3)).sum().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.step = 3
    return copy.deepcopy(state.state_dict())


def test_a_disabled_scalers_empty_state_resumes_with_the_scaler_enabled(
        caplog: pytest.LogCaptureFixture) -> None:
    """A CPU run of a script that enables its GradScaler on GPUs only saves ``{}``; the
    same job resumed on a GPU must not fail on every restart."""
    saved = _trained(0, scaler=False)
    assert saved["scaler"] == {}
    state = _state(1, scaler=True)
    with caplog.at_level(logging.WARNING, logger="elastic_kit"):
        state.load_state_dict(saved)
    assert state.step == 3 and state.scaler.get_scale() == 64.0  # the fresh one's
    assert state.scheduler.last_epoch == 1
    assert "checkpoint's scaler state is empty (saved by a disabled scaler); keeping the " \
           "fresh GradScaler" in caplog.text


def test_a_scheduler_state_that_does_not_fit_changes_nothing() -> None:
    """A StepLR's state into a SequentialLR (torch's load raises KeyError): found only by
    loading it, after the checks that run before anything is loaded."""
    saved = _trained(0)
    state = _state(1)
    state.scheduler = torch.optim.lr_scheduler.SequentialLR(
        state.optimizer, [torch.optim.lr_scheduler.ConstantLR(state.optimizer),
                          torch.optim.lr_scheduler.StepLR(state.optimizer, step_size=1)],
        milestones=[2])
    before = copy.deepcopy(state.state_dict())
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint scheduler state does not "
                                                      r"fit the scheduler: .*nothing was loaded"):
        state.load_state_dict(saved)
    after = state.state_dict()
    assert after["step"] == before["step"] == 0
    for k, v in before["model"].items():
        assert torch.equal(after["model"][k], v), k
    assert after["optimizer"]["state"] == {}  # the fresh optimizer's
    assert after["scheduler"] == before["scheduler"]


def test_a_scaler_state_that_does_not_fit_puts_the_scheduler_back() -> None:
    saved = _trained(0)
    saved["scaler"] = {"scale": 8.0}  # torch's load reads more keys than this
    state = _state(1)
    sched_before = copy.deepcopy(state.scheduler.state_dict())
    weight = state.model.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint scaler state does not fit "
                                                      r"the scaler: .*nothing was loaded"):
        state.load_state_dict(saved)
    assert state.scheduler.state_dict() == sched_before  # loaded first, then put back
    assert state.scaler.get_scale() == 64.0 and torch.equal(state.model.weight, weight)


def test_an_ema_the_checkpoint_lacks_is_said_to_keep_its_fresh_weights(
        caplog: pytest.LogCaptureFixture) -> None:
    """An EMA built before the restore copied the fresh weights: turned on at a resume
    of a checkpoint without it, it silently averaged from them."""
    saved = _trained(0)
    state = _state(1, ema=True)
    with caplog.at_level(logging.WARNING, logger="elastic_kit"):
        state.load_state_dict(saved)
    assert torch.equal(state.model.weight, saved["model"]["weight"])
    assert "checkpoint has no extras['model_ema']; keeping the fresh AveragedModel" in caplog.text
