"""TrainState round-trips through torch.load(weights_only=True), RNGs included."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from elastic_kit.errors import CheckpointMismatchError
from elastic_kit.loop import TrainState
from elastic_kit.sampler import ElasticDistributedSampler


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    sampler = ElasticDistributedSampler(list(range(20)), num_replicas=2, rank=0, seed=3)
    return TrainState(model, opt, scheduler=sched, scaler=scaler, sampler=sampler,
                      extras={"best_acc1": 0.0, "tags": ["a", "b"]})


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _train_a_bit(state: TrainState) -> None:
    for _ in range(3):
        x = torch.randn(5, 4)
        loss = state.model(x).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.step += 1


def test_state_round_trips_under_weights_only_and_restores_rngs() -> None:
    src = _state()
    _train_a_bit(src)
    src.epoch = 4
    src.sampler.set_epoch(4)
    src.sampler.advance(6)
    src.extras["best_acc1"] = 71.5
    src.history.append({"world_size": 2, "step": 0, "restart": 0, "restored_step": None})
    src.initial_world_size = 2
    src.audit.epoch(3).add(torch.tensor([20, 5, 7]))
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)

    loaded = _roundtrip(src.state_dict())
    expect = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(),
              np.random.randn(), torch.rand(4))

    dst = _state(seed=99)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    dst.load_state_dict(loaded)
    got = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(),
           np.random.randn(), torch.rand(4))
    assert got[:4] == expect[:4]
    assert torch.equal(got[4], expect[4])

    for a, b in zip(src.model.parameters(), dst.model.parameters()):
        assert torch.equal(a, b)
    assert dst.optimizer.state_dict()["state"][0]["step"] == 3
    assert dst.scheduler.last_epoch == 3
    assert dst.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert dst.scaler.get_scale() == 128.0
    assert (dst.sampler.epoch, dst.sampler.consumed) == (4, 6)
    assert (dst.epoch, dst.step, dst.initial_world_size) == (4, 3, 2)
    assert dst.extras == {"best_acc1": 71.5, "tags": ["a", "b"]}
    assert dst.history == src.history
    assert dst.audit.epochs[3].count == 20
    # the restored optimizer keeps training identically
    torch.manual_seed(5)
    _train_a_bit(src)
    torch.manual_seed(5)
    _train_a_bit(dst)
    for a, b in zip(src.model.parameters(), dst.model.parameters()):
        assert torch.equal(a, b)


def test_extras_that_weights_only_would_refuse_are_named() -> None:
    st = _state()
    st.extras["when"] = np.float64(1.0)
    with pytest.raises(TypeError, match=r"extras\['when'\] is a float64"):
        st.state_dict()


def test_checkpoint_of_another_model_is_a_mismatch_error() -> None:
    sd = _state().state_dict()
    other = TrainState(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))
    with pytest.raises(CheckpointMismatchError, match="does not fit the model"):
        other.load_state_dict(sd)


def test_sampler_of_another_dataset_length_is_a_mismatch_error() -> None:
    sd = _state().state_dict()
    dst = _state()
    dst.sampler = ElasticDistributedSampler(list(range(21)), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="21|20"):
        dst.load_state_dict(sd)


def test_linear_lr_scaling_does_not_compound_across_restarts() -> None:
    """W0=2; restarts at 4, 4 again, then 1: lr is base*W/W0 each time."""
    base = 0.1

    def life(world: int, saved: dict | None) -> tuple[dict, float, list[float]]:
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=base)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0)
        st = TrainState(model, opt, scheduler=sched)
        if saved is not None:
            st.load_state_dict(_roundtrip(saved))
        if st.initial_world_size is None:
            st.initial_world_size = world
        st.apply_lr_scale(world / st.initial_world_size)
        opt.step()
        sched.step()  # a closed-form scheduler recomputes lr from base_lrs
        return st.state_dict(), opt.param_groups[0]["lr"], list(sched.base_lrs)

    sd, lr, _ = life(2, None)
    assert lr == pytest.approx(base)
    sd, lr, base_lrs = life(4, sd)
    assert lr == pytest.approx(2 * base) and base_lrs == [pytest.approx(2 * base)]
    sd, lr, _ = life(4, sd)
    assert lr == pytest.approx(2 * base)
    sd, lr, _ = life(1, sd)
    assert lr == pytest.approx(0.5 * base)
    assert sd["lr_scale"] == 0.5 and sd["initial_world_size"] == 2


def test_run_report_lists_segments_restores_and_finished_epoch_audits() -> None:
    from elastic_kit.loop.audit import expected_digest

    model = torch.nn.Linear(2, 1)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state.history = [
        {"world_size": 3, "step": 0, "restart": 0, "restored_step": None},
        {"world_size": 2, "step": 14, "restart": 1, "restored_step": 12},
    ]
    state.step, state.epoch = 20, 1
    state.audit.epoch(0).add(expected_digest(8))
    state.audit.epoch(0).finish(8)
    state.audit.epoch(1)  # running: not reported yet
    report = state.run_report()
    assert report == {
        "steps": 20,
        "epochs": 1,
        "world_sizes": state.history,
        "restarts": 1,
        "restored_steps": [12],
        "audit": [{"epoch": 0, "count": 8, "expected": 8, "ok": True}],
    }
    json.dumps(report)  # JSON-able as is
