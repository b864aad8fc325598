"""A TrainState checkpoint whose extras do not fit the live ones (a validation sampler
over a dataset of another length, an EMA model of another shape) is refused before the
model, the optimizer or the sampler changes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.errors import CheckpointMismatchError


def _state(val_len: int = 37, ema_out: int = 1) -> ek.TrainState:
    torch.manual_seed(val_len + ema_out)
    model = nn.Linear(3, 1)
    ema = torch.optim.swa_utils.AveragedModel(nn.Linear(3, ema_out))
    return ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         sampler=ek.ElasticDistributedSampler(range(10), 1, 0),
                         extras={"val_sampler": ek.ElasticDistributedSampler(range(val_len), 1, 0),
                                 "ema": ema, "note": "kept"})


def _saved() -> dict[str, Any]:
    state = _state()
    state.sampler.advance(4)
    state.step = 5
    return copy.deepcopy(state.state_dict())


@pytest.mark.parametrize("live,match", [
    (dict(val_len=40), r"extras\['val_sampler'\] does not fit ElasticDistributedSampler: .*37.*40"),
    (dict(ema_out=2), r"extras\['ema'\] does not fit AveragedModel: checkpoint does not fit "
                      r"the model: other shapes"),
])
def test_an_extra_that_does_not_fit_changes_nothing(live: dict[str, int], match: str) -> None:
    saved = _saved()
    state = _state(**live)
    before = copy.deepcopy(state.state_dict())
    with pytest.raises(CheckpointMismatchError, match=match + r".*nothing was loaded"):
        state.load_state_dict(saved)
    after = state.state_dict()
    assert (after["step"], after["sampler"]) == (before["step"], before["sampler"])
    for k, v in before["model"].items():
        assert torch.equal(after["model"][k], v), k


def test_extras_that_fit_load() -> None:
    saved = _saved()
    state = _state()
    state.load_state_dict(saved)
    assert state.step == 5 and state.sampler.consumed == 4
    assert state.extras["note"] == "kept"
    for k, v in saved["model"].items():
        assert torch.equal(state.model.state_dict()[k], v)
