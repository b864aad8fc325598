"""What a checkpointer installs is removed once, and a process that ends from another
thread can keep the optimizer's pre-hook (it holds the training thread meanwhile)."""

from __future__ import annotations

import torch

from elastic_kit.checkpointer._hooks import Hooks


def _optimizer() -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    return torch.optim.SGD([p], lr=0.1)


def test_close_removes_the_pre_hook_once() -> None:
    calls: list[int] = []
    opt = _optimizer()
    hooks = Hooks()
    hooks.install(signals=False, optimizer=opt, wait_staged=lambda *_: calls.append(1))
    opt.step()
    assert hooks.close() is True
    assert hooks.close() is False
    opt.step()
    assert calls == [1]


def test_close_can_keep_the_pre_hook_for_a_process_that_ends_elsewhere() -> None:
    calls: list[int] = []
    opt = _optimizer()
    hooks = Hooks()
    hooks.install(signals=False, optimizer=opt, wait_staged=lambda *_: calls.append(1))
    assert hooks.close(keep_signals=True, keep_step_hook=True) is True
    assert hooks.close() is False  # closed: a second closer (the training thread) does nothing
    opt.step()
    opt.step()
    assert calls == [1, 1]
