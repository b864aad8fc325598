"""The checkpointer's options are refused at construction, naming the value, rather
than failing later (in restore()) or meaning something else than was written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import elastic_kit as ek


def _state() -> ek.TrainState:
    model = torch.nn.Linear(2, 2)
    return ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("options, named, error", [
    ({"every_seconds": True}, "every_seconds=True", TypeError),
    ({"every_seconds": float("inf")}, "every_seconds=inf", ValueError),
    ({"every_seconds": float("nan")}, "every_seconds=nan", ValueError),
    ({"every_seconds": "60"}, "every_seconds='60'", TypeError),
    ({"heartbeat_timeout": float("nan")}, "heartbeat_timeout=nan", ValueError),
    ({"heartbeat_timeout": float("inf")}, "heartbeat_timeout=inf", ValueError),
    ({"heartbeat_timeout": True}, "heartbeat_timeout=True", TypeError),
    ({"snapshot_budget": float("nan")}, "snapshot_budget=nan", ValueError),
    ({"blocking": "no"}, "blocking='no'", TypeError),
    ({"save_at_epoch_end": 1}, "save_at_epoch_end=1", TypeError),
    ({"overlap_staging": None}, "overlap_staging=None", TypeError),
    ({"handle_signals": "false"}, "handle_signals='false'", TypeError),
    ({"handle_preemption": 0}, "handle_preemption=0", TypeError),
    ({"audit": []}, r"audit=<list object>", TypeError),
    ({"audit": 1}, "audit=1", TypeError),
    ({"audit": "maybe"}, "audit='maybe'", ValueError),
])
def test_a_bad_option_is_refused_naming_it(options: dict, named: str,
                                           error: type[Exception]) -> None:
    # a wrong type is a TypeError, a wrong value a ValueError (torch's convention)
    with pytest.raises(error, match=f"{named}: expected"):
        ek.CheckpointerConfig(**options)
    with pytest.raises(error, match=f"{named}: expected"):
        ek.Checkpointer(_state(), None, **options)


def test_numpy_numbers_become_plain_ones() -> None:
    cfg = ek.CheckpointerConfig(snapshot_every=np.int64(5), every_steps=np.int64(4),
                                every_seconds=np.float32(2.5))
    assert (cfg.snapshot_every, cfg.every_steps, cfg.every_seconds) == (5, 4, 2.5)
    assert type(cfg.snapshot_every) is int and type(cfg.every_steps) is int
    assert type(cfg.every_seconds) is float
    keep = ek.CheckpointerConfig(keep_last=np.int64(3)).keep_last
    assert keep == 3 and type(keep) is int


def test_a_numpy_keep_last_reaches_the_store_it_makes(tmp_path: Path) -> None:
    state = _state()
    ck = ek.Checkpointer(state, str(tmp_path / "store"), keep_last=np.int64(2),
                         handle_signals=False)
    assert ck.store.keep_last == 2


def test_a_numpy_snapshot_interval_restores_and_snapshots(
        shm: str, tmp_path: Path) -> None:
    """The snapshot tier takes a plain int only: a NumPy one passed to the
    Checkpointer failed in restore() before."""
    state = _state()
    ck = ek.Checkpointer(state, str(tmp_path / "store"), snapshot_every=np.int64(2),
                         handle_signals=False, heartbeat_timeout=0, handle_preemption=False)
    assert ck.restore() == 0
    assert ck.snapshots is not None and ck.snapshots.every == 2
    for _ in range(2):
        state.model(torch.randn(4, 2)).sum().backward()
        state.optimizer.step()
        ck.step(4)
    assert ck.snapshots.wait(timeout=60) and ck.snapshots.written == [2]
    ck.close()


@pytest.mark.parametrize("options", [
    {"every_seconds": 30}, {"heartbeat_timeout": 0}, {"heartbeat_timeout": None},
    {"blocking": True, "handle_signals": False}, {"audit": "warn"}, {"audit": False},
])
def test_good_options_still_pass(options: dict) -> None:
    cfg = ek.CheckpointerConfig(**options)
    assert {k: getattr(cfg, k) for k in options} == options
