"""``wrap_ddp`` without a process group (``python train.py``) returns the module itself,
which behaves as the DDP model does where a training loop touches it, ``no_sync()``
included: a gradient-accumulation loop written for DDP runs unchanged."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import elastic_kit as ek


def test_the_plain_module_has_a_no_sync_that_accumulates_as_usual() -> None:
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Linear(4, 1))
    assert ek.unwrap_model(model) is model and not torch.distributed.is_initialized()
    x = torch.randn(6, 4)
    with model.no_sync():
        model(x[:3]).sum().backward()
    model(x[3:]).sum().backward()
    expected = nn.Linear(4, 1)
    expected.load_state_dict(model.state_dict())
    expected(x).sum().backward()
    assert torch.allclose(model.weight.grad, expected.weight.grad)
    assert list(model.state_dict()) == ["weight", "bias"]


def test_a_module_with_its_own_no_sync_keeps_it() -> None:
    class Own(nn.Linear):
        def no_sync(self) -> contextlib.AbstractContextManager[str]:
            return contextlib.nullcontext("own")

    model = ek.wrap_ddp(Own(2, 2))
    with model.no_sync() as got:
        assert got == "own"


def test_the_stand_in_no_sync_does_not_count_as_averaging_gradients() -> None:
    # ElasticLoop warns at world size > 1 when the model does not average its gradients
    # (wrap_ddp called before init_distributed): the stand-in must not silence it
    from elastic_kit.distributed import averages_gradients

    class Fsdp2Like(nn.Linear):
        def set_requires_gradient_sync(self, on: bool) -> None:
            pass

    class DdpLike(nn.Linear):
        def no_sync(self) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    assert averages_gradients(ek.wrap_ddp(nn.Linear(2, 2))) is False
    assert averages_gradients(nn.Linear(2, 2)) is False
    assert averages_gradients(Fsdp2Like(2, 2)) is True
    assert averages_gradients(DdpLike(2, 2)) is True
