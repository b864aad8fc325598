"""Constructors refuse an argument of the wrong kind when called, with a ``TypeError``
naming it, instead of taking it and failing later, deep inside, as an
``AttributeError`` (at a restore, in a loader worker, after an epoch's training)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

import elastic_kit as ek


def _parts() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return (model(batch[0]) - batch[1]).pow(2).squeeze(1)


DATA = [(torch.randn(2), torch.randn(1)) for _ in range(8)]
CONFIG = ek.LoopConfig(global_batch_size=4, log_every=0)


def _sched_as_optimizer() -> Any:
    model, opt = _parts()
    return ek.TrainState(model, torch.optim.lr_scheduler.StepLR(opt, 1))


def _loop(**kw: Any) -> Any:
    model, opt = _parts()
    args: dict[str, Any] = {"state": ek.TrainState(model, opt), "dataset": DATA,
                            "loss_fn": _loss, "config": CONFIG, **kw}
    return ek.ElasticLoop(args.pop("state"), args.pop("dataset"), **args)


#: (label, call(tmp_path), fragment of the TypeError's message)
CASES: list[tuple[str, Callable[[Path], Any], str]] = [
    ("state model None", lambda t: ek.TrainState(None, _parts()[1]),
     "model=None: expected a torch.nn.Module"),
    ("state model a dict", lambda t: ek.TrainState(_parts()[0].state_dict()),
     "model=<collections.OrderedDict object>"),
    ("state scheduler as optimizer", lambda t: _sched_as_optimizer(),
     "optimizer=<torch.optim.lr_scheduler.StepLR object>: expected None or a "
     "torch.optim.Optimizer (a scheduler goes in scheduler=...); it has no param_groups"),
    ("state scheduler a float", lambda t: ek.TrainState(*_parts(), scheduler=0.1),
     "scheduler=0.1: expected None or an LR scheduler"),
    ("state scaler a str", lambda t: ek.TrainState(*_parts(), scaler="cuda"),
     "scaler='cuda': expected None or a torch.amp.GradScaler"),
    ("state extras a list", lambda t: ek.TrainState(*_parts(), extras=["ema"]),
     "extras=<list object>: expected None or a dict"),
    ("loop given a model", lambda t: ek.ElasticLoop(_parts()[0], DATA, loss_fn=_loss,
                                                    config=CONFIG),
     "state=<torch.nn.modules.linear.Linear object>: expected an ek.TrainState"),
    ("loop config a dict", lambda t: _loop(config={"epochs": 1}),
     "config=<dict object>: expected None or an ek.LoopConfig"),
    ("loop on_epoch_end an int", lambda t: _loop(on_epoch_end=5),
     "on_epoch_end=5: expected None or a callable"),
    ("loop on_step_end a str", lambda t: _loop(on_step_end="log"),
     "on_step_end='log'"),
    ("loop loss_fn None", lambda t: _loop(loss_fn=None), "loss_fn=None: expected a callable"),
    ("loop store an int", lambda t: _loop(store=3), "store=3"),
    ("checkpointer info a str", lambda t: ek.Checkpointer(
        ek.TrainState(*_parts()), None, info="x"), "info='x': expected None or an ek.DistInfo"),
    ("checkpointer info beside a url", lambda t: ek.Checkpointer(
        ek.TrainState(*_parts()), str(t), info="x"), "info='x'"),
    ("seeded transform an int", lambda t: ek.SeededDataset(DATA, transform=5),
     "transform=5: expected None or a callable"),
    ("seeded return_index a str", lambda t: ek.SeededDataset(DATA, return_index="yes"),
     "return_index='yes': expected a bool"),
    ("seeded set_epoch a float", lambda t: ek.SeededDataset(DATA).set_epoch(1.5),
     "epoch=1.5: expected an int >= 0"),
]


@pytest.mark.parametrize("call, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_part_of_the_wrong_kind_is_refused_when_made(tmp_path: Path, call: Callable[[Path], Any],
                                                       fragment: str) -> None:
    with pytest.raises(TypeError) as caught:
        call(tmp_path)
    assert fragment in str(caught.value)


def test_a_negative_epoch_is_a_value_error_and_int_likes_are_epochs() -> None:
    data = ek.SeededDataset([torch.zeros(1)])
    with pytest.raises(ValueError, match=r"epoch=-1: expected an int >= 0"):
        data.set_epoch(-1)
    assert data.epoch == 0
    data.set_epoch(np.int64(3))
    assert data.epoch == 3 and type(data.epoch) is int


def test_the_parts_a_script_passes_are_taken() -> None:
    model, opt = _parts()
    state = ek.TrainState(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
                          scaler=torch.amp.GradScaler("cpu", enabled=False),
                          extras={"best": 0.0})
    assert state.optimizer is opt and state.extras == {"best": 0.0}
    assert ek.TrainState(nn.Sequential()).optimizer is None
    loop = ek.ElasticLoop(state, DATA, loss_fn=_loss, config=CONFIG,
                          on_epoch_end=lambda s, summary: None)
    assert loop.state is state and loop.config is CONFIG
    seeded = ek.SeededDataset(DATA, transform=lambda x: x, return_index=np.bool_(True))
    assert seeded.return_index is True and seeded[(0, 1)][0] == 1
