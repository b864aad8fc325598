"""Batch policies, seeded augmentation, loop options, and the loop at world size 1."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_kit import CheckpointerConfig
from elastic_kit.errors import BatchPolicyError
from elastic_kit.loop import (BatchPlan, BatchPolicy, ElasticLoop, FixedGlobalBatch,
                              LinearLRScaling, LoopConfig, TerminationFlag, TrainState)
from tests.loop_data import AugmentedData, run_w1


def test_global_batch_not_divisible_by_world_size_names_the_valid_sizes() -> None:
    with pytest.raises(BatchPolicyError) as e:
        FixedGlobalBatch(12, 4).plan(5, 5)
    msg = str(e.value)
    assert "global_batch_size=12" in msg and "world size 5" in msg
    assert "[1, 2, 3, 4, 6, 12]" in msg
    assert isinstance(e.value, ValueError)


def test_fixed_global_plan_accumulates_micro_batches() -> None:
    plan = FixedGlobalBatch(24, 5).plan(2, 4)
    assert (plan.per_rank, plan.micro_batch, plan.accumulation_steps, plan.lr_scale) == (
        12, 5, 3, 1.0)


def test_linear_lr_plan_scales_with_world_size() -> None:
    plan = LinearLRScaling(8).plan(6, 4)
    assert (plan.global_batch, plan.per_rank, plan.lr_scale) == (48, 8, 1.5)


def test_loop_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="scheduler_interval='batch'"):
        LoopConfig(global_batch_size=8, scheduler_interval="batch")
    with pytest.raises(BatchPolicyError, match="global_batch_size"):
        LoopConfig(global_batch_size=None)
    with pytest.raises(BatchPolicyError, match="'adaptive'"):
        LoopConfig(global_batch_size=8, batch_policy="adaptive")


def test_loader_options_torch_refuses_are_refused_when_configured() -> None:
    # torch's DataLoader raises for these without workers; the loop must not drop them
    with pytest.raises(ValueError, match=r"prefetch_factor=2: expected None with num_workers=0"):
        LoopConfig(global_batch_size=8, prefetch_factor=2)
    with pytest.raises(ValueError, match=r"persistent_workers=True: expected False with "
                                         r"num_workers=0"):
        LoopConfig(global_batch_size=8, persistent_workers=True)
    with pytest.raises(TypeError, match=r"collate_fn=5: expected None or a callable"):
        LoopConfig(global_batch_size=8, collate_fn=5)
    cfg = LoopConfig(global_batch_size=8, num_workers=2, prefetch_factor=2,
                     persistent_workers=True, collate_fn=list)
    assert (cfg.prefetch_factor, cfg.persistent_workers, cfg.collate_fn) == (2, True, list)


def test_sizes_given_beside_a_policy_instance_must_agree_with_it() -> None:
    # the instance's sizes are the ones used: others beside it were ignored in silence
    with pytest.raises(BatchPolicyError, match=r"global_batch_size=12 with batch_policy="
                                               r"LinearLRScaling.*whose global_batch_size"):
        LoopConfig(global_batch_size=12, batch_policy=LinearLRScaling(4))
    with pytest.raises(BatchPolicyError, match=r"global_batch_size=12 .*whose "
                                               r"global_batch_size is 8"):
        LoopConfig(global_batch_size=12, batch_policy=FixedGlobalBatch(8, 2))
    with pytest.raises(BatchPolicyError, match=r"micro_batch_size=4 .*whose "
                                               r"micro_batch_size is 2"):
        LoopConfig(global_batch_size=8, micro_batch_size=4,
                   batch_policy=FixedGlobalBatch(8, 2))
    for same in (LoopConfig(batch_policy=FixedGlobalBatch(8, 2)),
                 LoopConfig(global_batch_size=8, micro_batch_size=2,
                            batch_policy=FixedGlobalBatch(8, 2)),
                 LoopConfig(micro_batch_size=4, batch_policy=LinearLRScaling(4))):
        assert same.policy() is same.batch_policy


    class PerWorker(BatchPolicy):  # a policy of the user's own: the sizes beside it
        name = "per_worker"        # are the user's business, not checked

        def plan(self, world_size: int, initial_world_size: int) -> BatchPlan:
            return BatchPlan(world_size, 4 * world_size, 4, 2, 1.0)

    own = PerWorker()
    assert LoopConfig(global_batch_size=48, micro_batch_size=8,
                      batch_policy=own).policy() is own


def test_a_plateau_scheduler_is_refused_before_any_training() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model, opt, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    data = TensorDataset(torch.zeros(8, 2), torch.zeros(8, 1))
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau, which steps on a metric.*"
                                        r"TrainState.extras.*on_epoch_end"):
        ElasticLoop(state, data, loss_fn=lambda m, b: m(b[0]).sum(),
                    config=LoopConfig(global_batch_size=4))


def test_termination_flag_is_set_by_sigterm_and_restores_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with TerminationFlag() as flag:
        assert not flag.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.is_set() and flag.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before



def test_max_steps_stops_mid_epoch() -> None:
    st, _ = run_w1(0, max_steps=3)
    assert st.step == 3 and st.epoch == 0 and st.sampler.consumed == 24


def _manual_mean_loss_run(ds: TensorDataset, epochs: int,
                          batch: int) -> tuple[nn.Linear, list[float]]:
    """What the loop must compute: per step, the mean loss over the step's samples in
    the sampler's order, one optimizer step; also each epoch's mean step loss."""
    from elastic_kit import ElasticDistributedSampler

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticDistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    epoch_losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        losses = []
        for k in range(0, len(order), batch):
            x, y = ds[order[k:k + batch]]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        epoch_losses.append(sum(losses) / len(losses))
    return model, epoch_losses


@pytest.mark.parametrize("scale", [None, 2.0 ** 12])
def test_loop_step_is_the_mean_loss_over_the_steps_samples(scale: float | None) -> None:
    """Micro-batches of 3 accumulate into steps of 8 (the epoch's last step has 6
    samples): the gradient is the mean over exactly the step's samples, with or
    without a GradScaler (a power-of-two scale unscales exactly)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 4, generator=g)
    ds = TensorDataset(x, (x[:, 1] > 0).long())
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale)
    state = TrainState(model, opt, scaler=scaler)
    crit = nn.CrossEntropyLoss(reduction="none")
    loop = ElasticLoop(state, ds, loss_fn=lambda m, b: crit(m(b[0]), b[1]),
                       config=LoopConfig(epochs=2, global_batch_size=8, micro_batch_size=3,
                                         log_every=0, progress_bar=False))
    loop.run()
    ref, ref_losses = _manual_mean_loss_run(ds, epochs=2, batch=8)
    assert state.step == 8
    torch.testing.assert_close(model.weight, ref.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.bias, ref.bias, rtol=0, atol=1e-6)
    assert [s.loss for s in loop.summaries] == pytest.approx(ref_losses, abs=1e-6)
    if scaler is not None:
        assert scaler.get_scale() == scale  # no step was skipped as an overflow


def test_loss_fn_must_return_per_sample_losses() -> None:
    model = nn.Linear(2, 1)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ds = TensorDataset(torch.randn(8, 2))
    loop = ElasticLoop(state, ds, loss_fn=lambda m, b: m(b[0]).mean(),
                       config=LoopConfig(global_batch_size=4, progress_bar=False))
    with pytest.raises(ValueError, match="one loss per sample"):
        loop.run()


def test_linear_lr_policy_rescales_lr_on_resume_without_compounding(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Life 1 at (faked) W0=2, then two lives at W=1: lr = base / 2 both times."""
    from elastic_kit.store import CheckpointStore
    from elastic_kit.distributed import DistInfo
    from elastic_kit.loop import _trainer as trainer

    def life(world: int, max_steps: int) -> tuple[float, TrainState]:
        if world != 1:
            # Pretend to be rank 0 of `world` (only this rank's share is trained).
            monkeypatch.setattr(trainer, "init_distributed",
                                lambda: DistInfo(rank=0, world_size=world))
        else:
            monkeypatch.undo()
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.4)
        crit = nn.CrossEntropyLoss(reduction="none")
        state = TrainState(model, opt)
        loop = ElasticLoop(state, AugmentedData(), loss_fn=lambda m, b: crit(m(b[0]), b[1]),
                           store=CheckpointStore(str(tmp_path)),
                           config=LoopConfig(batch_policy="linear_lr", micro_batch_size=4,
                                             max_steps=max_steps, epochs=5,
                                             checkpoint=CheckpointerConfig(audit="off"),
                                             log_every=0, progress_bar=False))
        loop.run()
        return opt.param_groups[0]["lr"], state

    lr, st = life(2, 1)
    assert lr == pytest.approx(0.4) and st.initial_world_size == 2
    lr, st = life(1, 2)
    assert lr == pytest.approx(0.2) and st.lr_scale == 0.5
    lr, st = life(1, 3)
    assert lr == pytest.approx(0.2) and st.step == 3
    assert [h["world_size"] for h in st.history] == [2, 1, 1]


@pytest.mark.parametrize("overlap", [True, False])
def test_nonblocking_checkpoints_hold_the_state_of_their_step_with_a_slow_copy(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """The deferred copy of the parameters and optimizer state is slowed down: the loop
    must still wait for it before optimizer.step, so each checkpoint holds its step."""
    import time

    from elastic_kit.store import CheckpointStore
    from elastic_kit.store import _store as store_mod

    real_copy = store_mod.copy_deferred
    deferred_counts: list[int] = []

    def slow_copy(pairs, after=None):  # type: ignore[no-untyped-def]
        deferred_counts.append(len(pairs))
        time.sleep(0.05)
        real_copy(pairs, after)

    monkeypatch.setattr(store_mod, "copy_deferred", slow_copy)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    crit = nn.CrossEntropyLoss(reduction="none")
    state = TrainState(model, opt)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(st: TrainState, info: object) -> None:
        seen[st.step] = {k: v.clone() for k, v in st.model.state_dict().items()}
        seen[st.step]["momentum"] = opt.state[model.weight]["momentum_buffer"].clone()

    store = CheckpointStore(str(tmp_path), keep_last=None)
    loop = ElasticLoop(state, AugmentedData(), loss_fn=lambda m, b: crit(m(b[0]), b[1]),
                       store=store, on_step_end=on_step_end,
                       config=LoopConfig(epochs=2, global_batch_size=8, micro_batch_size=8,
                                         checkpoint=CheckpointerConfig(
                                             every_steps=1, blocking=False,
                                             overlap_staging=overlap),
                                         log_every=0, progress_bar=False))
    loop.run()
    saved = [i.step for i in store.list()]
    assert saved == list(range(1, 9))
    # with overlap every save defers the 2 parameters and the 2 momentum buffers
    # (the first save has no momentum yet); without it nothing is deferred
    assert (sum(deferred_counts) > 0) == overlap
    for info in store.list():
        ck = torch.load(f"{info.path}/state.pt", weights_only=True)
        for k in ("weight", "bias"):
            assert torch.equal(ck["model"][k], seen[info.step][k]), (info.step, k)
        mom = ck["optimizer"]["state"][0]["momentum_buffer"]
        assert torch.equal(mom, seen[info.step]["momentum"]), info.step


def test_progress_bar_reads_the_loss_at_most_twice_a_second() -> None:
    # Reading a CUDA loss waits for the device: a bar that read it every step would
    # sync rank 0 with its GPU at every step.
    from elastic_kit.loop._progress import POSTFIX_EVERY_S, ProgressReporter

    class Loss:
        reads = 0

        def __float__(self) -> float:
            Loss.reads += 1
            return 0.5

    rep = ProgressReporter(enabled=True, log_every=0, total_samples=1000, total_steps=100,
                           progress_bar=True)
    assert rep._bar is not None  # tqdm: the examples extra, which scripts/test installs
    t0 = time.monotonic()
    try:
        for step in range(1, 101):
            rep.update(step=step, epoch=0, samples=10, loss=Loss(), lr=None, world_size=1)
    finally:
        rep.close()
    elapsed = time.monotonic() - t0
    assert 1 <= Loss.reads <= 1 + elapsed / POSTFIX_EVERY_S
    assert Loss.reads < 100


def test_loop_keeps_its_hooks_out_of_the_step_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``on_step_end`` and ``on_epoch_end`` call's duration reaches the
    checkpointer as time that is not training (and so does each ``end_epoch``, the
    checkpointer's own work)."""
    from elastic_kit.checkpointer._cadence import Cadence

    excluded: list[float] = []
    real = Cadence.exclude_time

    def spy(self: Cadence, seconds: float) -> None:
        excluded.append(seconds)
        real(self, seconds)

    monkeypatch.setattr(Cadence, "exclude_time", spy)
    hooks: list[str] = []
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    crit = nn.CrossEntropyLoss(reduction="none")
    ds = TensorDataset(torch.randn(16, 4), torch.zeros(16, dtype=torch.long))
    loop = ElasticLoop(state, ds, loss_fn=lambda m, b: crit(m(b[0]), b[1]),
                       on_step_end=lambda s, i: hooks.append("step"),
                       on_epoch_end=lambda s, e: hooks.append("epoch"),
                       config=LoopConfig(epochs=2, global_batch_size=8, log_every=0,
                                         progress_bar=False))
    loop.run()
    assert hooks == ["step", "step", "epoch"] * 2
    assert len(excluded) == len(hooks) + 2 and all(s >= 0 for s in excluded)


@pytest.mark.parametrize("sampled", [4, 12])
def test_a_sampler_over_another_datasets_length_is_refused_naming_both(sampled: int) -> None:
    """A shorter sampler would train on a prefix of the data with an audit that
    passes; a longer one would fail in the loader mid-epoch with an IndexError."""
    from elastic_kit import ElasticDistributedSampler

    model = nn.Linear(2, 1)
    sampler = ElasticDistributedSampler(range(sampled), num_replicas=1, rank=0)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler)
    ds = TensorDataset(torch.randn(8, 2))
    loop = ElasticLoop(state, ds, loss_fn=lambda m, b: m(b[0]).sum(1),
                       config=LoopConfig(global_batch_size=4, progress_bar=False))
    with pytest.raises(ValueError, match=rf"state.sampler covers a dataset of {sampled} "
                                         rf"samples, but the loop's dataset has 8"):
        loop.run()
    assert state.step == 0 and sampler.consumed == 0


def test_the_runs_end_is_saved_without_epoch_end_saves_and_a_restart_trains_nothing(
        tmp_path) -> None:
    from elastic_kit import CheckpointStore

    def run() -> tuple[TrainState, ElasticLoop]:
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        ds = TensorDataset(torch.randn(10, 2))
        loop = ElasticLoop(state, ds, loss_fn=lambda m, b: m(b[0]).sum(1),
                           store=CheckpointStore(str(tmp_path / "ck")),
                           config=LoopConfig(epochs=2, global_batch_size=4, progress_bar=False,
                                             log_every=0,
                                             checkpoint=CheckpointerConfig(
                                                 every_steps=4, save_at_epoch_end=False)))
        loop.run()
        return state, loop

    state, _ = run()
    assert state.step == 6  # 3 steps an epoch (4 + 4 + 2 samples)
    assert [i.step for i in CheckpointStore(str(tmp_path / "ck")).list()] == [4, 6]
    again, loop = run()
    assert loop.restored_step == 6 and again.step == 6 and loop.summaries == []


def test_a_user_sampler_over_a_dataset_without_len_still_trains() -> None:
    """A map-style dataset need not define __len__ (torch does not ask for it): with a
    sampler of the script's, there is nothing to compare, and the loop trains."""
    from elastic_kit import ElasticDistributedSampler

    class NoLen(torch.utils.data.Dataset):
        def __getitem__(self, i: int) -> tuple[torch.Tensor]:
            return (torch.full((2,), float(i)),)

    model = nn.Linear(2, 1)
    sampler = ElasticDistributedSampler(list(range(8)), num_replicas=1, rank=0)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01), sampler=sampler)
    loop = ElasticLoop(state, NoLen(), loss_fn=lambda m, b: m(b[0]).sum(1),
                       config=LoopConfig(epochs=1, global_batch_size=4, progress_bar=False,
                                         log_every=0))
    loop.run()
    assert state.step == 2 and sampler.epoch == 1  # the epoch of 8 samples ended
