"""The names a sharded restore gives parameters when it looks for those without saved
optimizer state must include the one torch's distributed state dict gives: a name
missed drops that parameter's loaded state (activation-checkpointed blocks did)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from elastic_kit.state._train_state import _dcp_names


def _model() -> nn.Module:
    model = nn.Module()
    model.wrapped = checkpoint_wrapper(nn.Linear(2, 2))
    model.compiled_inside = checkpoint_wrapper(torch.compile(nn.Linear(2, 2)))
    model.wrapped_inside = torch.compile(checkpoint_wrapper(nn.Linear(2, 2)))
    return model


@pytest.mark.parametrize("fallback", [False, True])
def test_every_parameter_is_named_as_torchs_state_dict_names_it(monkeypatch, fallback) -> None:
    from torch.distributed.checkpoint.state_dict import _get_fqns

    model = _model()
    torch_names = {n: set(_get_fqns(model, n)) for n, _ in model.named_parameters()}
    assert torch_names["wrapped._checkpoint_wrapped_module.weight"] == {"wrapped.weight"}
    if fallback:  # a torch without the function
        monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint.state_dict", None)
    for name, expected in torch_names.items():
        assert expected <= _dcp_names(model, name), name
