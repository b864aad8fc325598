"""A rank that fails alone must surface its own error at once, not a collective's.

Regression: ``ElasticLoop.run()`` waited for the in-flight background save in
``finally`` with a *collective* ``store.wait()``, even while an exception was
propagating on one rank only. That all-reduce was matched against the peers' DDP
gradient all-reduce (or blocked until the collective timeout), and the failing rank
reported a misleading ``CheckpointError`` instead of its real error.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic_kit as ek
from elastic_kit.testing import MultiProcessError, spawn_multi_process


def _fail_on_rank_one(ckpt: str) -> str:
    info = ek.init_distributed(backend="gloo", timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    calls = {"n": 0}

    def loss_fn(m: nn.Module, b: list[torch.Tensor]) -> torch.Tensor:
        calls["n"] += 1
        if info.rank == 1 and calls["n"] == 5:  # one rank fails alone: a bad batch
            raise KeyError("boom on rank 1")
        return ((m(b[0]) - b[1]) ** 2).sum(1)

    loop = ek.ElasticLoop(
        ek.TrainState(model, opt), data, loss_fn=loss_fn, store=ek.CheckpointStore(ckpt),
        config=ek.LoopConfig(epochs=1, global_batch_size=4, micro_batch_size=2,
                             checkpoint=ek.CheckpointerConfig(every_steps=1, blocking=False)))
    loop.run()
    return "finished"


def test_rank_failing_alone_reports_its_own_error_without_a_collective(tmp_path) -> None:
    with pytest.raises(MultiProcessError) as exc:
        spawn_multi_process(2, _fail_on_rank_one, str(tmp_path / "ck"), timeout=90)
    assert exc.value.first_rank == 1, str(exc.value)
    report = exc.value.failures[1]
    last_line = report.strip().splitlines()[-1]
    assert last_line == "KeyError: 'boom on rank 1'", report
    assert "CheckpointError" not in report, report
    # a collective on the failing rank's way out would have ended in the gloo
    # timeout error (20 s here) instead of the KeyError above
    # the checkpoints the writer committed before the failure are intact
    store = ek.CheckpointStore(str(tmp_path / "ck"))
    steps = [i.step for i in store.list()]
    assert steps and all(s >= 1 for s in steps)
    assert store.load() is not None
