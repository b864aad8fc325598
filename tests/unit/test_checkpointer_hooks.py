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


def test_the_unheard_signal_grace_follows_the_step_time(monkeypatch) -> None:
    """Two steps' time, within 5-15 s: a long backward pass is one call that cannot
    hear a signal, and must not be taken for a hung collective."""
    import elastic_kit as ek
    from elastic_kit.checkpointer import _checkpointer as mod

    model = torch.nn.Linear(2, 2)
    ck = ek.Checkpointer(ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                         None, handle_signals=False, snapshot_every=None,
                         heartbeat_timeout=0, handle_preemption=False,
                         info=ek.DistInfo(run_id="j"))
    ck.restore()
    clock = iter([100.0, 101.0, 110.0, 113.0])
    monkeypatch.setattr(mod.time, "monotonic", lambda: next(clock))
    flag = ck._hooks.stop
    ck.record_step(1)
    assert flag.unheard_after_s == 5.0       # no step time yet: the default
    ck.record_step(1)
    assert flag.unheard_after_s == 5.0       # 1 s steps: the floor
    ck.record_step(1)
    assert flag.unheard_after_s == 15.0      # 9 s steps: two would be 18 s, capped
    ck.record_step(1)
    assert flag.unheard_after_s == 6.0       # 3 s steps
    monkeypatch.undo()
    ck.close()
