"""A train state given a new optimizer after a non-blocking save (a new phase of
training: layers unfrozen, the optimizer rebuilt, the same checkpointer) still waits
for that save's background copy before the new optimizer's first step: the pre-hook
sat on the old optimizer until the step after, so the save held the next step's
weights under its own step's name (every checksum verified)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import elastic_kit as ek
import elastic_kit.store._store as store_module


@pytest.mark.parametrize("first", ["at_construction", "after_restore"])
def test_the_new_optimizers_first_step_waits_for_the_save_before_it(
        tmp_path: Path, monkeypatch: Any, first: str) -> None:
    copying = threading.Event()
    copy_deferred = store_module.copy_deferred

    def slow_copy(*args: Any, **kwargs: Any) -> None:  # a big state on a busy host
        copying.set()
        time.sleep(0.5)
        copy_deferred(*args, **kwargs)

    monkeypatch.setattr(store_module, "copy_deferred", slow_copy)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # an optimizer given only after restore() (a state built without one) is hooked too
    state = ek.TrainState(model, opt if first == "at_construction" else None)
    url = str(tmp_path / "ck")
    ckpt = ek.Checkpointer(state, url, every_steps=3, blocking=False, snapshot_every=0,
                           handle_signals=False)
    ckpt.restore()
    state.optimizer = opt
    x = torch.randn(8, 64)

    def train(o: torch.optim.Optimizer) -> None:
        model(x).pow(2).sum().backward()
        o.step()
        o.zero_grad()

    for _ in range(3):
        train(opt)
        ckpt.step(8)                       # step 3: a non-blocking save
    at3 = {k: v.clone() for k, v in model.state_dict().items()}
    assert copying.wait(5)
    state.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)   # a new phase
    train(state.optimizer)                 # its first step: must wait for the copy
    ckpt.step(8)
    ckpt.close()
    only3 = tmp_path / "only3"
    only3.mkdir(mode=0o700)
    shutil.copytree(Path(url) / "step-000000000003", only3 / "step-000000000003")
    loaded = ek.CheckpointStore(str(only3)).load()
    assert loaded is not None and loaded.step == 3
    for k, v in at3.items():
        assert torch.equal(loaded.state["model"][k], v), k


def test_another_models_optimizer_does_not_wait(tmp_path: Path) -> None:
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    state = ek.TrainState(model, opt)
    ckpt = ek.Checkpointer(state, str(tmp_path / "ck"), every_steps=1, snapshot_every=0,
                           handle_signals=False)
    ckpt.restore()
    waited: list[Any] = []
    ckpt._hooks._wait_staged = lambda *a: waited.append(a[0])  # what the hook would run
    other(torch.ones(1, 4)).sum().backward()
    other_opt.step()
    assert waited == []
    state.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    state.optimizer.step()
    assert waited == [state.optimizer]
    ckpt.close()
