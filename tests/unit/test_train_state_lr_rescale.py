"""``TrainState.apply_lr_scale`` on the schedulers that keep learning rates beyond
``base_lrs``: a scheduler built at lr 0.1 and scaled by 2 runs the schedule of one
built at lr 0.2, step for step."""

from __future__ import annotations

import logging
from typing import Callable

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from elastic_kit.state import TrainState, _train_state

Build = Callable[[torch.optim.Optimizer, float], object]

SCHEDULES: dict[str, Build] = {
    "SequentialLR(warmup, cosine)": lambda opt, lr: sched.SequentialLR(
        opt, [sched.LinearLR(opt, 0.1, 1.0, total_iters=3),
              sched.CosineAnnealingLR(opt, T_max=10, eta_min=lr / 20)], milestones=[3]),
    "ChainedScheduler": lambda opt, lr: sched.ChainedScheduler(
        [sched.LinearLR(opt, 0.1, 1.0, total_iters=3), sched.StepLR(opt, 4, 0.5)]),
    "OneCycleLR": lambda opt, lr: sched.OneCycleLR(opt, max_lr=lr, total_steps=20),
    "CyclicLR": lambda opt, lr: sched.CyclicLR(opt, base_lr=lr / 10, max_lr=lr,
                                               step_size_up=3),
    "CosineAnnealingWarmRestarts": lambda opt, lr: sched.CosineAnnealingWarmRestarts(
        opt, T_0=4, eta_min=lr / 10),
}


def _lrs(build: Build, lr: float, scale: float, steps: int = 12) -> list[float]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=lr, momentum=0.9)
    scheduler = build(opt, lr)
    state = TrainState(nn.Linear(1, 1), opt, scheduler=scheduler)
    state.apply_lr_scale(scale)
    out = []
    for _ in range(steps):
        opt.step()
        scheduler.step()
        out.append(opt.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_scaled_schedule_is_the_schedule_built_at_the_scaled_lr(name: str) -> None:
    reference = _lrs(SCHEDULES[name], 0.2, 1.0)
    assert _lrs(SCHEDULES[name], 0.1, 2.0) == pytest.approx(reference, rel=1e-9)


def _plateau_lrs(lr: float, scale: float) -> list[float]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=lr)
    scheduler = sched.ReduceLROnPlateau(opt, factor=0.5, patience=0, min_lr=lr / 4)
    TrainState(nn.Linear(1, 1), opt, scheduler=scheduler).apply_lr_scale(scale)
    out = []
    for _ in range(5):  # the loss never improves: halved each step, down to min_lr
        scheduler.step(1.0)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_reduce_on_plateau_floor_is_scaled_with_the_lr() -> None:
    assert _plateau_lrs(0.1, 2.0) == pytest.approx([0.2, 0.1, 0.05, 0.05, 0.05], rel=1e-9)
    assert _plateau_lrs(0.1, 2.0) == pytest.approx(_plateau_lrs(0.2, 1.0), rel=1e-9)


class _OwnWarmup(sched.LambdaLR):
    """A user's scheduler: torch's base class, its own class."""


def test_a_scheduler_it_does_not_know_is_named_in_one_warning(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_train_state, "_warned_schedulers", set())
    caplog.set_level(logging.WARNING, logger="elastic_kit.state._train_state")
    for _ in range(2):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = _OwnWarmup(opt, lambda step: 1.0)
        TrainState(nn.Linear(1, 1), opt, scheduler=scheduler).apply_lr_scale(2.0)
        assert scheduler.base_lrs == [pytest.approx(0.2)]
    warned = [r.getMessage() for r in caplog.records if "_OwnWarmup" in r.getMessage()]
    assert len(warned) == 1
    named = [r.getMessage() for r in caplog.records if "LambdaLR" in r.getMessage()]
    assert named == []
