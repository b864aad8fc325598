"""ElasticLoop on real gloo ranks: resume at the same and at other world sizes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from elastic_kit.testing import spawn_multi_process
from tests.train_script import TrainConfig, train

N_SAMPLES = 100  # not a multiple of the global batch: the last step of an epoch is partial
GLOBAL_BATCH = 12
EPOCHS = 3  # 9 steps per epoch, 27 in all


def _train(url: str, max_steps: int | None, checkpoint_every: int | None = 4) -> TrainConfig:
    """One life of a worker group on ElasticLoop (a StepLR halving the lr every epoch, an
    epoch-end hook counting in the state's extras); stops after ``max_steps``."""
    return TrainConfig(url=url, loop="elastic", dataset_size=N_SAMPLES, features=6, hidden=8,
                       target="sum", data_seed=1, lr=0.2, scheduler="halve", extras=True,
                       epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, micro_batch_size=4,
                       max_steps=max_steps, checkpoint={"every_steps": checkpoint_every})


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run on 2 ranks."""
    url = str(tmp_path_factory.mktemp("ref"))
    res = spawn_multi_process(2, train, _train(url, None))
    for name in res[0]["named_params"]:  # DDP keeps the replicas identical
        assert np.array_equal(res[0]["named_params"][name], res[1]["named_params"][name])
    return res[0]


def _assert_every_sample_once(result: dict[str, Any]) -> None:
    assert result["audit"] == [(e, N_SAMPLES, True) for e in range(EPOCHS)]


def test_reference_run_sees_each_sample_once_per_epoch(reference: dict[str, Any]) -> None:
    assert reference["step"] == EPOCHS * 9 and reference["epoch"] == EPOCHS
    _assert_every_sample_once(reference)
    assert reference["extras"]["seen_epochs"] == EPOCHS
    assert reference["lr"] == pytest.approx(0.2 * 0.5 ** EPOCHS)
    assert reference["history"] == [
        {"world_size": 2, "step": 0, "restart": 0, "restored_step": None,
        "restored_from": None}]


def test_resume_at_same_world_size_is_bitwise_identical(
        reference: dict[str, Any], tmp_path: Any) -> None:
    url = str(tmp_path)
    # Stop mid-epoch 1 at a step that is no multiple of checkpoint_every: the
    # max_steps exit saves it; a fresh group resumes from there.
    first = spawn_multi_process(2, train, _train(url, 11))
    assert first[0]["step"] == 11 and first[0]["epoch"] == 1
    second = spawn_multi_process(2, train, _train(url, None))
    final = second[0]
    assert final["restored"] == 11
    for name, ref in reference["named_params"].items():
        assert torch.equal(torch.from_numpy(final["named_params"][name]),
                           torch.from_numpy(ref)), name
    assert final["lr"] == reference["lr"]
    _assert_every_sample_once(final)
    assert [h["restored_step"] for h in final["history"]] == [None, 11]
    # the hook ran once per epoch in total: epoch 0 in the first life, 1 and 2 after
    assert final["extras"]["seen_epochs"] == EPOCHS


def test_resume_after_world_size_change_3_2_1_matches_fixed_size_run(
        reference: dict[str, Any], tmp_path: Any) -> None:
    url = str(tmp_path)
    a = spawn_multi_process(3, train, _train(url, 5))
    assert [r["step"] for r in a] == [5, 5, 5]
    b = spawn_multi_process(2, train, _train(url, 13))
    assert b[0]["step"] == 13 and b[0]["restored"] == 5
    c = train(_train(url, None))  # world size 1 in this process: no process group at all
    assert c["step"] == EPOCHS * 9
    assert [(h["world_size"], h["step"], h["restored_step"]) for h in c["history"]] == [
        (3, 0, None), (2, 5, 5), (1, 13, 13)]
    for name, ref in reference["named_params"].items():
        got = torch.from_numpy(c["named_params"][name])
        torch.testing.assert_close(got, torch.from_numpy(ref), rtol=1e-5, atol=1e-6)
    _assert_every_sample_once(c)


def test_padded_epoch_ends_weight_only_real_samples(
        reference: dict[str, Any], tmp_path: Any) -> None:
    # At 3 ranks the 100 samples are dealt as 3 x 34 positions, 2 of them padding,
    # in every epoch's last step (4 real samples in 2 positions per rank). The update
    # must be the mean over the real samples, so the run ends where the 2-rank run
    # (no padding: 100 samples deal evenly) ends.
    res = spawn_multi_process(3, train, _train(str(tmp_path), None, 4))
    assert res[0]["step"] == EPOCHS * 9
    for name, ref in reference["named_params"].items():
        torch.testing.assert_close(torch.from_numpy(res[0]["named_params"][name]),
                                   torch.from_numpy(ref), rtol=1e-5, atol=1e-6)
    _assert_every_sample_once(res[0])
