"""What a save is given must be a state, and what a step or a verify is given a
number: ``save_checkpoint(5, url)`` committed a checkpoint holding 5 (and with the
arguments swapped printed the whole state dict in a ValueError), ``verify(step="1")``
answered an empty list as if the step were missing, ``Checkpointer.step("2")``
failed with a message naming no argument and ``step(True)`` counted one sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import elastic_kit as ek


@pytest.mark.parametrize("state, shown", [
    (5, "state=5"), ("model", "state='model'"), ([torch.zeros(2)], "state=<list object>"),
    (None, "state=None"),
])
def test_save_checkpoint_refuses_what_is_no_state_and_writes_nothing(
        tmp_path: Path, state: Any, shown: str) -> None:
    url = tmp_path / "ck"
    with pytest.raises(TypeError) as caught:
        ek.save_checkpoint(state, str(url), step=1)
    assert shown in str(caught.value)
    assert "expected a dict of the state, or an object with state_dict()" in str(caught.value)
    assert not url.exists()


def test_swapped_arguments_name_the_url_not_the_whole_state(tmp_path: Path) -> None:
    state = {"model": {"weight": torch.arange(1000.0)}}
    with pytest.raises(TypeError) as caught:
        ek.save_checkpoint(str(tmp_path / "ck"), state, step=1)  # type: ignore[arg-type]
    message = str(caught.value)
    assert f"state={str(tmp_path / 'ck')!r}" in message and "999" not in message


@pytest.mark.parametrize("state", [5, [torch.ones(1)], "w"])
def test_store_save_refuses_what_is_no_state(tmp_path: Path, state: Any) -> None:
    store = ek.CheckpointStore(str(tmp_path), info=ek.DistInfo())
    with pytest.raises(TypeError, match=r"state_dict=.*: expected a dict of the state"):
        store.save(state, step=1)
    assert store.list() == []


def test_a_state_or_a_module_is_still_saved(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    ek.save_checkpoint(model, str(tmp_path), step=1)
    ek.save_checkpoint({"w": torch.ones(1)}, str(tmp_path), step=2)
    store = ek.CheckpointStore(str(tmp_path), keep_last=None, info=ek.DistInfo())
    assert [i.step for i in store.list()] == [1, 2]
    assert sorted(store.load().state) == ["w"]


def test_verify_takes_a_step_number_only(tmp_path: Path) -> None:
    store = ek.CheckpointStore(str(tmp_path), info=ek.DistInfo())
    store.save({"w": torch.ones(1)}, step=1)
    with pytest.raises(TypeError, match=r"step='1': expected an int"):
        store.verify(step="1")
    with pytest.raises(TypeError, match="step=True"):
        store.verify(step=True)
    assert [(s, p) for s, _, p in store.verify(step=np.int64(1))] == [(1, None)]
    assert store.verify(step=99) == []


def _restored(tmp_path: Path) -> ek.Checkpointer:
    model = nn.Linear(2, 1)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = ek.Checkpointer(state, None, handle_signals=False, snapshot_every=0,
                           heartbeat_timeout=0, handle_preemption=False, info=ek.DistInfo())
    ckpt.restore()
    return ckpt


@pytest.mark.parametrize("n, error, fragment", [
    ("2", TypeError, "n='2': expected an int"),
    (True, TypeError, "n=True: expected an int, got a bool"),
    (2.0, TypeError, "n=2.0"),
    (-1, ValueError, "n must be >= 0"),
])
def test_checkpointer_step_names_a_wrong_n(tmp_path: Path, n: Any, error: type[Exception],
                                           fragment: str) -> None:
    ckpt = _restored(tmp_path)
    try:
        for call in (ckpt.step, ckpt.record_step):
            with pytest.raises(error) as caught:
                call(n)
            assert fragment in str(caught.value)
        assert ckpt.state.step == 0
        ckpt.step(np.int64(2))
        assert ckpt.state.step == 1
    finally:
        ckpt.close()


def test_a_wrong_n_is_named_before_the_missing_restore() -> None:
    model = nn.Linear(2, 1)
    ckpt = ek.Checkpointer(ek.TrainState(model), None, handle_signals=False,
                           info=ek.DistInfo())
    with pytest.raises(TypeError, match="n='2'"):
        ckpt.step("2")


def test_sample_weights_names_its_arguments(tmp_path: Path) -> None:
    ckpt = _restored(tmp_path)
    try:
        with pytest.raises(TypeError, match="offset='0'"):
            ckpt.sample_weights(2, offset="0")
        with pytest.raises(TypeError, match="step_n=4.0"):
            ckpt.sample_weights(2, step_n=4.0)
    finally:
        ckpt.close()
