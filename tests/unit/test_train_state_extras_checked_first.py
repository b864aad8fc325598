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


class _LenientEma(nn.Module):
    """An EMA whose own load takes a state from before it had its ``updates`` buffer."""

    def __init__(self, with_updates: bool = True) -> None:
        super().__init__()
        self.shadow = nn.Linear(2, 2)
        if with_updates:
            self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    def load_state_dict(self, sd: Any, strict: bool = True, assign: bool = False) -> Any:
        return super().load_state_dict(sd, strict=False)


class _Tracker:
    """A stateful object whose ``check_state_dict`` means something of its own."""

    def __init__(self) -> None:
        self.best = 0.0

    def state_dict(self) -> dict[str, float]:
        return {"best": self.best}

    def load_state_dict(self, sd: dict[str, float]) -> None:
        self.best = sd["best"]

    def check_state_dict(self, sd: Any, strict: bool) -> bool:
        return True


def test_extras_with_a_load_of_their_own_are_left_to_it() -> None:
    # the pre-check is torch's own load's: an extra that overrides load_state_dict
    # (a lenient or migrating one) or is no sampler is loaded as before, by itself
    old = _LenientEma(with_updates=False)
    with torch.no_grad():
        old.shadow.weight.fill_(3.0)
    live = {"ema": _LenientEma(), "tracker": _Tracker()}
    state = ek.TrainState(nn.Linear(2, 2), None, extras=live)
    saved = ek.TrainState(nn.Linear(2, 2), None).state_dict()
    saved["extras"] = {"ema": old.state_dict(), "tracker": {"best": 1.5}}
    state.load_state_dict(saved)
    assert torch.equal(live["ema"].shadow.weight, torch.full((2, 2), 3.0))
    assert live["tracker"].best == 1.5


def test_a_lazy_model_loads_a_checkpoint_that_fits() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.LazyLinear(4)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    src = Net()
    src.body(torch.zeros(1, 7))
    src_opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    src(torch.ones(2, 7)).sum().backward()
    src_opt.step()
    saved = ek.TrainState(src, src_opt).state_dict()
    lazy = Net()
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1, momentum=0.9)  # before its dry run
    ek.TrainState(lazy, opt).load_state_dict(saved)
    assert torch.equal(lazy.body.weight, src.body.weight) and lazy.body.weight.shape == (4, 7)
    assert torch.equal(opt.state[lazy.body.weight]["momentum_buffer"],
                       src_opt.state[src.body.weight]["momentum_buffer"])
