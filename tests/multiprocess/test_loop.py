"""ElasticLoop on real gloo ranks: resume at the same and at other world sizes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_kit.testing import spawn_multi_process

N_SAMPLES = 100  # not a multiple of the global batch: the last step of an epoch is partial
GLOBAL_BATCH = 12
EPOCHS = 3  # 9 steps per epoch, 27 in all


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, 6, generator=g)
    y = (x.sum(1) > 0).long()
    return TensorDataset(x, y)


def _train(url: str, max_steps: int | None, checkpoint_every: int | None = 4) -> dict[str, Any]:
    """One life of a worker group; returns the final weights and the state's record."""
    import elastic_kit as ek
    from elastic_kit.store import CheckpointStore
    from elastic_kit.loop import ElasticLoop, LoopConfig, TrainState

    torch.set_num_threads(1)
    info = ek.init_distributed()
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    crit = nn.CrossEntropyLoss(reduction="none")
    state = TrainState(model, opt, scheduler=sched, extras={"seen_epochs": 0})

    def on_epoch_end(st: TrainState, summary: Any) -> None:
        st.extras["seen_epochs"] += 1

    loop = ElasticLoop(
        state, _dataset(), loss_fn=lambda m, b: crit(m(b[0]), b[1]),
        store=CheckpointStore(url), on_epoch_end=on_epoch_end,
        config=LoopConfig(epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, micro_batch_size=4,
                          max_steps=max_steps,
                          checkpoint=ek.CheckpointerConfig(every_steps=checkpoint_every),
                          log_every=0, progress_bar=False),
    )
    loop.run()
    return {
        "rank": info.rank,
        "params": {k: v.detach().numpy().copy()
                   for k, v in ek.unwrap_model(model).state_dict().items()},
        "step": state.step,
        "epoch": state.epoch,
        "history": state.history,
        "audit": {e: a.to_dict() for e, a in state.audit.epochs.items()},
        "extras": dict(state.extras),
        "lr": opt.param_groups[0]["lr"],
        "restored_step": loop.restored_step,
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run on 2 ranks."""
    url = str(tmp_path_factory.mktemp("ref"))
    res = spawn_multi_process(2, _train, url, None)
    for name in res[0]["params"]:  # DDP keeps the replicas identical
        assert np.array_equal(res[0]["params"][name], res[1]["params"][name])
    return res[0]


def _assert_every_sample_once(result: dict[str, Any]) -> None:
    assert sorted(result["audit"]) == list(range(EPOCHS))
    for e, a in result["audit"].items():
        assert a["ok"] is True, a
        assert a["count"] == N_SAMPLES


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
    first = spawn_multi_process(2, _train, url, 11)
    assert first[0]["step"] == 11 and first[0]["epoch"] == 1
    second = spawn_multi_process(2, _train, url, None)
    final = second[0]
    assert final["restored_step"] == 11
    for name, ref in reference["params"].items():
        assert torch.equal(torch.from_numpy(final["params"][name]), torch.from_numpy(ref)), name
    assert final["lr"] == reference["lr"]
    _assert_every_sample_once(final)
    assert [h["restored_step"] for h in final["history"]] == [None, 11]
    # the hook ran once per epoch in total: epoch 0 in the first life, 1 and 2 after
    assert final["extras"]["seen_epochs"] == EPOCHS


def test_resume_after_world_size_change_3_2_1_matches_fixed_size_run(
        reference: dict[str, Any], tmp_path: Any) -> None:
    url = str(tmp_path)
    a = spawn_multi_process(3, _train, url, 5)
    assert [r["step"] for r in a] == [5, 5, 5]
    b = spawn_multi_process(2, _train, url, 13)
    assert b[0]["step"] == 13 and b[0]["restored_step"] == 5
    c = _train(url, None)  # world size 1 in this process: no process group at all
    assert c["step"] == EPOCHS * 9
    assert [(h["world_size"], h["step"], h["restored_step"]) for h in c["history"]] == [
        (3, 0, None), (2, 5, 5), (1, 13, 13)]
    for name, ref in reference["params"].items():
        got = torch.from_numpy(c["params"][name])
        torch.testing.assert_close(got, torch.from_numpy(ref), rtol=1e-5, atol=1e-6)
    _assert_every_sample_once(c)


def test_padded_epoch_ends_weight_only_real_samples(
        reference: dict[str, Any], tmp_path: Any) -> None:
    # At 3 ranks the 100 samples are dealt as 3 x 34 positions, 2 of them padding,
    # in every epoch's last step (4 real samples in 2 positions per rank). The update
    # must be the mean over the real samples, so the run ends where the 2-rank run
    # (no padding: 100 samples deal evenly) ends.
    res = spawn_multi_process(3, _train, str(tmp_path), None, 4)
    assert res[0]["step"] == EPOCHS * 9
    for name, ref in reference["params"].items():
        torch.testing.assert_close(torch.from_numpy(res[0]["params"][name]),
                                   torch.from_numpy(ref), rtol=1e-5, atol=1e-6)
    _assert_every_sample_once(res[0])
