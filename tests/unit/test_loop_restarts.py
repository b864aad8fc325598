"""The loop after a restart trains as if never stopped: the CPU generator is not
shifted by the loader, an epoch's scheduler step is part of the epoch's last step,
and a failing set-up leaves no hooks behind."""

from __future__ import annotations

import logging

import dataclasses
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic_kit as ek
from elastic_kit import CheckpointerConfig
from elastic_kit.loop import ElasticLoop, LoopConfig, TrainState


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


_crit = nn.CrossEntropyLoss(reduction="none")


def _loss(m: nn.Module, b: Any) -> torch.Tensor:
    return _crit(m(b[0]), b[1])


def _run(store: str | None, *, max_steps: int | None = None, epochs: int = 2,
         scheduler: bool = False, on_epoch_end: Any = None,
         stop_at: int | None = None) -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    state = TrainState(model, opt, scheduler=sched)
    cfg = LoopConfig(epochs=epochs, global_batch_size=12, micro_batch_size=12,
                     max_steps=max_steps, log_every=0, progress_bar=False,
                     checkpoint=CheckpointerConfig(blocking=True, snapshot_every=0,
                                                   handle_signals=False))

    def on_step_end(state: TrainState, info: Any) -> None:
        if state.step == stop_at:             # as SIGTERM would
            loop.request_stop(restart=True)

    loop = ElasticLoop(state, _data(), loss_fn=_loss,
                       store=None if store is None else ek.CheckpointStore(store),
                       config=cfg, on_epoch_end=on_epoch_end, on_step_end=on_step_end)
    loop.run()
    return state


def _params(state: TrainState) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in state.model.parameters()])


def test_a_mid_epoch_resume_draws_dropout_like_the_uninterrupted_run(tmp_path: Path) -> None:
    """The loader's iterator draws its base seed from a generator of the loop's own:
    from the global one, the resumed run's draw (made where it resumed) shifted
    every later dropout mask."""
    plain = _params(_run(None))
    store = str(tmp_path / "store")
    _run(store, max_steps=3)                  # stops inside epoch 0 (8 steps an epoch)
    resumed = _params(_run(store))
    assert torch.equal(resumed, plain)


def test_an_epochs_scheduler_step_is_in_the_save_of_its_last_step(tmp_path: Path) -> None:
    """A SIGTERM acted on at an epoch's last step saves that step at once; killed
    during ``on_epoch_end`` (a validation longer than torchrun's grace period), the
    restart finds the epoch exhausted and moves on: the scheduler's step for that
    epoch must be in that save."""
    plain = _run(None, epochs=3, scheduler=True)
    store = str(tmp_path / "store")

    def killed(state: TrainState, summary: Any) -> None:
        raise KeyboardInterrupt("killed during validation")

    with pytest.raises(KeyboardInterrupt):
        _run(store, epochs=3, scheduler=True, stop_at=8, on_epoch_end=killed)
    assert [i.step for i in ek.CheckpointStore(store).list()] == [8]
    resumed = _run(store, epochs=3, scheduler=True)
    assert resumed.scheduler is not None and plain.scheduler is not None
    assert resumed.scheduler.last_epoch == plain.scheduler.last_epoch == 3
    assert resumed.optimizer.param_groups[0]["lr"] == plain.optimizer.param_groups[0]["lr"]
    assert torch.equal(_params(resumed), _params(plain))


def test_an_epoch_whose_end_was_cut_short_gets_its_end_of_epoch_work_after_a_restart(
        tmp_path: Path) -> None:
    """Killed during ``on_epoch_end`` (a peer failed during validation), the state of
    the epoch's last step is what the restart restores: the loop runs that epoch's
    ``on_epoch_end`` (the validation) before training the next one."""
    store = str(tmp_path / "store")

    def killed(state: TrainState, summary: Any) -> None:
        raise KeyboardInterrupt("killed during validation")

    with pytest.raises(KeyboardInterrupt):
        _run(store, epochs=3, stop_at=8, on_epoch_end=killed)
    seen: list[tuple[int, int, int]] = []

    def validate(state: TrainState, summary: Any) -> None:
        seen.append((summary.epoch, summary.steps, state.step))

    _run(store, epochs=3, on_epoch_end=validate)
    assert seen == [(0, 0, 8), (1, 8, 16), (2, 8, 24)]
    assert 8 in [i.step for i in ek.CheckpointStore(store).list()]


def test_replace_with_a_new_checkpoint_config_takes_it_as_given() -> None:
    cfg = LoopConfig(global_batch_size=12, checkpoint=CheckpointerConfig(every_steps=10))
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")   # no deprecation warning either
        new = dataclasses.replace(
            cfg, checkpoint=CheckpointerConfig(every_steps=50, blocking=True))
    assert (new.checkpoint.every_steps, new.checkpoint.blocking) == (50, True)
    assert dataclasses.replace(cfg, epochs=3).checkpoint.every_steps == 10


@pytest.mark.parametrize("kw, error", [
    ({"clip_grad_norm": -1.0}, ValueError), ({"clip_grad_norm": 0.0}, ValueError),
    ({"num_workers": -2}, ValueError), ({"prefetch_factor": 0}, ValueError),
    ({"epochs": True}, TypeError), ({"max_steps": 2.5}, TypeError),
    ({"max_steps": "5"}, TypeError), ({"progress_bar": "no"}, TypeError),
    ({"shuffle": "yes"}, TypeError), ({"seed": 1.5}, TypeError),
])
def test_loop_config_refuses_values_that_would_train_wrongly_or_fail_later(
        kw: dict[str, Any], error: type[Exception]) -> None:
    # a wrong type is a TypeError, a wrong value a ValueError (torch's convention)
    (name, value), = kw.items()
    with pytest.raises(error, match=f"LoopConfig.{name}={value!r}: expected"):
        LoopConfig(global_batch_size=12, **kw)


def test_the_loop_gives_loss_fn_what_a_seeded_dataset_returns() -> None:
    """``SeededDataset(return_index=True)`` yields ``(index, sample)`` under the loop
    as under a ``DataLoader``."""
    seen: list[torch.Tensor] = []

    def loss(m: nn.Module, batch: Any) -> torch.Tensor:
        index, (x, y) = batch
        seen.append(index)
        return _crit(m(x), y)

    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = LoopConfig(epochs=1, global_batch_size=12, micro_batch_size=12, log_every=0,
                     progress_bar=False, checkpoint=CheckpointerConfig(handle_signals=False))
    ElasticLoop(state, ek.SeededDataset(_data(), return_index=True), loss_fn=loss,
                config=cfg).run()
    assert sorted(torch.cat(seen).tolist()) == list(range(96))


@pytest.mark.parametrize("wrap", [
    lambda d: torch.utils.data.Subset(d, range(48)),
    lambda d: torch.utils.data.ConcatDataset([_data(), torch.utils.data.Subset(d, range(8))]),
])
def test_a_seeded_dataset_inside_another_dataset_is_refused(wrap: Any) -> None:
    """The loop gives epoch keys only to an outermost SeededDataset: one inside a Subset
    would get plain indices and augment every epoch as epoch 0 did."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = LoopConfig(epochs=1, global_batch_size=12, micro_batch_size=12, log_every=0,
                     progress_bar=False, checkpoint=CheckpointerConfig(handle_signals=False))
    with pytest.raises(ValueError, match="SeededDataset.*outermost"):
        ElasticLoop(state, wrap(ek.SeededDataset(_data())), loss_fn=_loss, config=cfg).run()
    assert state.step == 0


def test_a_run_that_fails_making_its_loader_leaves_no_hooks_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    before = signal.getsignal(signal.SIGTERM)
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model, opt)
    cfg = LoopConfig(epochs=1, global_batch_size=12, micro_batch_size=12, log_every=0,
                     progress_bar=False)             # handles SIGTERM (the default)
    loop = ElasticLoop(state, _data(), loss_fn=_loss, config=cfg)

    def broken() -> Any:
        raise OSError("no such dataset file")

    monkeypatch.setattr(loop, "_make_loader", broken)
    with pytest.raises(OSError, match="no such dataset"):
        loop.run()
    assert signal.getsignal(signal.SIGTERM) is before
    assert not opt._optimizer_step_pre_hooks


@pytest.mark.parametrize("enabled", [True, False])
def test_throughput_is_recent_on_every_rank(enabled: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``samples_per_second`` is measured over the window since the last log line on
    every rank (not since the start on the ranks that do not log)."""
    from elastic_kit.loop import _progress

    now = [100.0]
    monkeypatch.setattr(_progress.time, "monotonic", lambda: now[0])
    rep = _progress.ProgressReporter(enabled=enabled, log_every=2, total_samples=10_000,
                                     progress_bar=False)
    for step, dt in enumerate([1.0, 1.0, 0.1, 0.1], start=1):   # 10 samples a step
        now[0] += dt
        rep.update(step=step, epoch=0, samples=10, loss=0.5, lr=None, world_size=2)
    assert rep.samples_per_second == pytest.approx(100.0)     # 20 samples in 0.2 s


def test_the_step_line_says_its_loss_is_rank_0s(caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0's loss (of its share of the batch) changes with the world size on the same
    trajectory: the line says whose it is, so it is not read as the global loss."""
    from elastic_kit.loop import _progress

    rep = _progress.ProgressReporter(enabled=True, log_every=1, total_samples=100,
                                     progress_bar=False)
    with caplog.at_level(logging.INFO, logger=_progress.log.name):
        rep.update(step=1, epoch=0, samples=10, loss=0.25, lr=None, world_size=2)
    assert "step 1 epoch 0 rank-0 loss 0.2500 " in caplog.text, caplog.text


def test_linear_lr_refuses_a_fixed_global_batch_too() -> None:
    from elastic_kit.errors import BatchPolicyError

    with pytest.raises(BatchPolicyError, match="global_batch_size=64 with batch_policy='linear_lr'"):
        LoopConfig(batch_policy="linear_lr", global_batch_size=64, micro_batch_size=8)
    assert LoopConfig(batch_policy="linear_lr", micro_batch_size=8).policy().plan(2, 2).global_batch == 16


def test_step_info_has_the_learning_rate_the_step_used() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
    state = TrainState(model, opt, scheduler=sched)
    seen: list[float] = []
    cfg = LoopConfig(epochs=1, global_batch_size=12, micro_batch_size=12, log_every=0,
                     progress_bar=False, scheduler_interval="step",
                     checkpoint=CheckpointerConfig(handle_signals=False))
    ElasticLoop(state, _data(), loss_fn=_loss, config=cfg,
                on_step_end=lambda s, info: seen.append(info.lr)).run()
    assert seen == pytest.approx([0.1 / (k + 1) for k in range(8)])


@pytest.mark.parametrize("restart", [False, True])
def test_a_stop_request_ends_its_own_run_only(tmp_path: Path, restart: bool) -> None:
    """The request was kept: the next ``run()`` of the same loop saved and stopped after
    its first step (returning as if done, or exiting 143 again under torchrun)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = LoopConfig(epochs=2, global_batch_size=12, micro_batch_size=12, log_every=0,
                     progress_bar=False,
                     checkpoint=CheckpointerConfig(blocking=True, snapshot_every=0,
                                                   handle_signals=False))
    asked: list[int] = []

    def on_step_end(state: TrainState, info: Any) -> None:
        if state.step == 3 and not asked:
            asked.append(state.step)
            loop.request_stop(restart=restart)

    loop = ElasticLoop(state, _data(), loss_fn=_loss, store=str(tmp_path / "ck"),
                       on_step_end=on_step_end, config=cfg)
    if restart:
        with pytest.raises(SystemExit):
            loop.run()
    else:
        loop.run()
    assert state.step == 3
    loop.run()  # trains on to the end
    assert (state.step, state.epoch) == (16, 2)


def test_a_stop_without_a_store_does_not_say_it_saved(caplog: Any) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="elastic_kit"), pytest.raises(SystemExit):
        _run(None, stop_at=2)
    assert "checkpoint step" not in caplog.text
    assert "stop: no store: step 2 not saved; exiting with status 143" in caplog.text



def test_a_stop_does_not_promise_a_restart(caplog: Any, tmp_path: Any) -> None:
    """A SIGTERM comes as well from a torchrun that is ending the job (it was stopped
    itself, or has no restart left): the line says what happens then too."""
    import logging

    with caplog.at_level(logging.INFO, logger="elastic_kit"), pytest.raises(SystemExit):
        _run(str(tmp_path / "ckpt"), stop_at=2)
    assert ("stop: checkpoint step 2 saved; exiting with status 143 so torchrun restarts "
            "the group (or, if the job is ending, a relaunch resumes there)") in caplog.text


def test_a_path_as_the_store_is_made_into_one_with_the_configs_keep_last(
        tmp_path: Path, caplog: Any) -> None:
    """``ElasticLoop(store=<path>)``, as documented: the checkpointer makes the store,
    with ``config.checkpoint``'s ``keep_last``."""
    def run(max_steps: int) -> TrainState:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 2))
        state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        cfg = LoopConfig(epochs=2, global_batch_size=12, micro_batch_size=12,
                         max_steps=max_steps, log_every=0, progress_bar=False,
                         checkpoint=CheckpointerConfig(blocking=True, snapshot_every=0,
                                                       every_steps=1, keep_last=2,
                                                       handle_signals=False))
        ElasticLoop(state, _data(), loss_fn=_loss, store=str(tmp_path / "ckpt"),
                    config=cfg).run()
        return state

    assert run(5).step == 5
    assert [i.step for i in ek.CheckpointStore(str(tmp_path / "ckpt")).list()] == [4, 5]
    with caplog.at_level(logging.INFO, logger="elastic_kit"):
        assert run(7).step == 7
    assert "restored checkpoint step 5" in caplog.text  # resumed there, not started over
    assert [i.step for i in ek.CheckpointStore(str(tmp_path / "ckpt")).list()] == [6, 7]
