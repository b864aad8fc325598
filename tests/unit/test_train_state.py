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
    with pytest.raises(TypeError, match=r"extras\['when'\] is a numpy.float64"):
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
    from elastic_kit.state._audit import expected_digest

    model = torch.nn.Linear(2, 1)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state.history = [
        {"world_size": 3, "step": 0, "restart": 0, "restored_step": None,
         "restored_from": None},
        {"world_size": 2, "step": 14, "restart": 1, "restored_step": 12,
         "restored_from": "store"},
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


def test_ema_module_ordered_dict_and_grad_scaler_round_trip() -> None:
    """What own loops put in a TrainState: an EMA model (live, loaded in place), a
    state_dict() OrderedDict and a GradScaler."""
    import collections

    a = _state(0)
    ema = torch.optim.swa_utils.AveragedModel(
        a.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
    a.extras["ema"] = ema
    a.extras["ema_sd"] = a.model.state_dict()           # an OrderedDict
    assert type(a.extras["ema_sd"]) is collections.OrderedDict
    _train_a_bit(a)
    ema.update_parameters(a.model)
    a.scaler.scale(torch.tensor(1.0))                   # initializes the scale lazily
    a.scaler.update(64.0)
    sd = _roundtrip(a.state_dict())

    b = _state(1)
    ema_b = torch.optim.swa_utils.AveragedModel(
        b.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
    b.extras["ema"] = ema_b
    b.load_state_dict(sd)
    assert b.extras["ema"] is ema_b                         # loaded in place, not replaced
    for pa, pb in zip(ema.module.parameters(), ema_b.module.parameters()):
        assert torch.equal(pa, pb)
    assert int(ema_b.n_averaged) == int(ema.n_averaged) == 1
    assert list(b.extras["ema_sd"]) == list(a.model.state_dict())
    assert b.scaler.get_scale() == a.scaler.get_scale() == 64.0


def test_namespace_in_extras_says_to_store_vars() -> None:
    import argparse

    s = _state()
    s.extras["args"] = argparse.Namespace(lr=0.1)
    with pytest.raises(TypeError, match=r"extras\['args'\].*vars\(args\)"):
        s.state_dict()
    s.extras["args"] = vars(s.extras["args"])
    assert _roundtrip(s.state_dict())["extras"]["args"] == {"lr": 0.1}


def test_mismatched_checkpoint_changes_nothing_before_raising() -> None:
    """A checkpoint of another model is refused before the model, the optimizer or the
    sampler were overwritten."""
    src = _state(0)
    _train_a_bit(src)
    sd = _roundtrip(src.state_dict())
    sd["model"]["2.weight"] = torch.zeros(5, 3)             # one layer of another shape
    dst = _state(1)
    before = {k: v.clone() for k, v in dst.model.state_dict().items()}
    opt_before = json.dumps(dst.optimizer.state_dict()["param_groups"], default=str)
    consumed = dst.sampler.consumed
    with pytest.raises(CheckpointMismatchError, match=r"2\.weight.*nothing was loaded"):
        dst.load_state_dict(sd)
    for k, v in dst.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert json.dumps(dst.optimizer.state_dict()["param_groups"], default=str) == opt_before
    assert dst.sampler.consumed == consumed and dst.step == 0


def test_bad_sampler_state_is_refused_before_the_model_is_overwritten() -> None:
    src = _state(0)
    _train_a_bit(src)
    sd = _roundtrip(src.state_dict())
    sd["sampler"]["consumed"] = 3.7
    dst = _state(1)
    before = {k: v.clone() for k, v in dst.model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"'consumed'=3.7.*nothing was loaded"):
        dst.load_state_dict(sd)
    for k, v in dst.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_state_dict_of_an_unsharded_model_does_not_walk_its_parameters(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots take the state often: whether the model is sharded is read from its
    state dict's values (no DTensor there), not from a walk over its parameters."""
    import elastic_kit.state._train_state as module

    state = _state()
    _train_a_bit(state)
    walks: list[object] = []
    monkeypatch.setattr(module, "is_sharded", lambda m: walks.append(m) or False)
    sd = state.state_dict()
    state.state_dict()
    assert walks == []
    assert set(sd["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert torch.equal(sd["model"]["0.weight"], state.model[0].weight)
    assert sd["optimizer"]["state"][0]["exp_avg"].shape == (3, 4)


class _WithModuleAttr(torch.nn.Module):
    """A user's model whose own submodule is called ``module``, like DDP's."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 1)


def test_a_submodule_named_module_is_part_of_the_model_not_a_wrapper() -> None:
    from elastic_kit.distributed import unwrap_model

    model = _WithModuleAttr()
    assert unwrap_model(model) is model
    saved = TrainState(model).state_dict()["model"]
    assert sorted(saved) == sorted(model.state_dict())
    assert "head.weight" in saved


def test_wrappers_are_unwrapped_nested() -> None:
    from elastic_kit.distributed import unwrap_model

    inner = _WithModuleAttr()
    wrapped = torch.nn.DataParallel(torch.nn.DataParallel(inner))
    assert unwrap_model(wrapped) is inner
    compiled = torch.compile(inner)
    assert unwrap_model(compiled) is inner and unwrap_model(torch.nn.DataParallel(compiled)) is inner


def test_a_sampler_without_a_position_is_refused_naming_the_fix() -> None:
    """torch's DistributedSampler, kept by a script being ported, failed later with an
    AttributeError at restore() or state_dict()."""
    from torch.utils.data import DistributedSampler

    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"got a DistributedSampler, which has no "
                                        r"state_dict, load_state_dict, advance, consumed.*"
                                        r"ek.ElasticDistributedSampler"):
        TrainState(model, sampler=DistributedSampler(range(4), 1, 0))
    state = TrainState(model)
    with pytest.raises(TypeError, match="DistributedSampler"):
        state.sampler = DistributedSampler(range(4), 1, 0)  # ElasticLoop assigns it later
    assert state.sampler is None
    state.sampler = ElasticDistributedSampler(range(4), 1, 0)
    assert state.state_dict()["sampler"]["dataset_length"] == 4
