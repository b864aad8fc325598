"""A checkpoint's optimizer state is matched to parameters by position: a live
optimizer given its parameters in another order is refused before anything loads,
naming the position and both shapes, while state not shaped like the parameters
(LBFGS's flat history, Adafactor's factored moments) still loads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elastic_kit.errors import CheckpointMismatchError
from elastic_kit.state import TrainState


def _stepped(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    torch.manual_seed(0)
    model(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    return TrainState(model, opt).state_dict(rng=False)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
], ids=["adam", "sgd-momentum"])
def test_parameters_in_another_order_are_refused_before_anything_loads(make) -> None:
    torch.manual_seed(1)
    saved_model = nn.Linear(3, 2)
    sd = _stepped(saved_model, make([saved_model.weight, saved_model.bias]))
    model = nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = make([model.bias, model.weight])  # same group size, other order
    with pytest.raises(CheckpointMismatchError,
                       match=r"parameter 0 of group 0: its '\w+' has shape \(2, 3\), "
                             r"the parameter \(2,\)") as e:
        TrainState(model, opt).load_state_dict(sd)
    assert "nothing was loaded" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert len(opt.state) == 0


def test_parameters_in_the_saved_order_load_their_own_moments() -> None:
    torch.manual_seed(1)
    saved_model = nn.Linear(3, 2)
    saved_opt = torch.optim.Adam([saved_model.weight, saved_model.bias], lr=0.1)
    sd = _stepped(saved_model, saved_opt)
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam([model.weight, model.bias], lr=0.1)
    TrainState(model, opt).load_state_dict(sd)
    assert torch.equal(opt.state[model.weight]["exp_avg"],
                       saved_opt.state[saved_model.weight]["exp_avg"])
    assert torch.equal(opt.state[model.bias]["exp_avg_sq"],
                       saved_opt.state[saved_model.bias]["exp_avg_sq"])


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.LBFGS(ps, lr=0.1, history_size=3),
    lambda ps: torch.optim.Adafactor(ps, lr=0.01),
], ids=["lbfgs", "adafactor"])
def test_state_not_shaped_like_its_parameter_still_loads(make) -> None:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = make(list(net.parameters()))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = net(torch.ones(2, 3)).square().sum()
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    sd = TrainState(net, opt).state_dict(rng=False)
    fresh_net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fresh = make(list(fresh_net.parameters()))
    TrainState(fresh_net, fresh).load_state_dict(sd)
    loaded = fresh.state_dict()["state"]
    for pid, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded[pid][key], value), (pid, key)
