"""The mark of the state at a step end, which a failing rank snapshots as it exits:
what it keeps (generators, buffers) and when the state no longer holds it."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.checkpointer._step_end import StepEnd
from elastic_kit.state import plain_rng_state
from elastic_kit.state._train_state import restore_rng_state


def _state(scaler: bool = False) -> ek.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ek.TrainState(model, opt, scaler=torch.amp.GradScaler("cpu") if scaler else None)
    state.step = 7
    return state


def test_the_mark_keeps_the_buffers_and_generators_of_its_step_while_a_forward_changes_them(
        ) -> None:
    state = _state()
    marks = StepEnd(state, enabled=True)
    bn = state.model[1]
    bn(torch.randn(8, 4))  # statistics of an earlier step
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    marks.record()
    draws = (torch.rand(3), np.random.rand(2), random.random())  # after the mark
    state.model(torch.randn(8, 3))  # batch norm's statistics and dropout's generator move
    mark = marks.intact()
    assert mark is not None and mark.step == 7
    kept = marks.buffers_at_mark()
    assert sorted(kept) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert not torch.equal(bn.running_mean, before["running_mean"])
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(kept[f"1.{name}"], before[name])
    restore_rng_state(plain_rng_state(mark.rng))
    assert torch.equal(torch.rand(3), draws[0])  # the generators as they were at the mark
    np.testing.assert_array_equal(np.random.rand(2), draws[1])
    assert random.random() == draws[2]


def test_the_mark_no_longer_holds_once_the_optimizer_starts_or_the_step_moves() -> None:
    state = _state()
    marks = StepEnd(state, enabled=True)
    state.optimizer.register_step_pre_hook(lambda *_: marks.optimizer_started())
    marks.record()
    state.model(torch.randn(8, 3)).sum().backward()
    assert marks.intact() is not None  # a forward and backward change no parameter
    state.optimizer.step()
    assert marks.intact() is None
    state.step += 1
    marks.record()
    assert marks.intact() is not None and marks.intact().step == 8  # type: ignore[union-attr]
    state.step += 1  # a step recorded without a mark
    assert marks.intact() is None


def test_a_changed_scale_or_replaced_buffers_break_the_mark() -> None:
    state = _state(scaler=True)
    scaler = state.scaler
    marks = StepEnd(state, enabled=True)
    scaler.scale(state.model(torch.randn(8, 3)).sum()).backward()  # the scale exists now
    marks.record()
    assert marks.intact() is not None
    scaler.step(state.optimizer)
    scaler.update(0.5)
    assert marks.intact() is None  # also without the optimizer's step: the scale moved
    marks.record()
    assert marks.intact() is not None
    state.model.double()  # new buffer tensors: the kept copies are of the old ones
    assert marks.intact() is None


def test_a_disabled_mark_keeps_nothing() -> None:
    state = _state()
    marks = StepEnd(state, enabled=False)
    marks.record()
    assert marks.mark is None and marks.intact() is None


def test_a_disabled_or_unused_scaler_does_not_break_the_mark() -> None:
    state = _state()
    state.scaler = torch.amp.GradScaler("cpu", enabled=False)  # as on a CPU run
    marks = StepEnd(state, enabled=True)
    marks.record()
    assert marks.intact() is not None
    state.scaler = torch.amp.GradScaler("cpu")  # enabled, its scale not made yet
    marks.record()
    assert marks.intact() is not None
