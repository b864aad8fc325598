"""The loop and seeded augmentation with real data-loader worker processes, and the
loop's progress output from a separate interpreter."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from elastic_kit.loop import SeededDataset
from tests.loop_data import run_w1


class _Noisy(Dataset):
    """Returns random numbers from every global RNG: an "augmentation"."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), random.random(), float(np.random.rand()),
                             float(torch.rand(()))])


def _collect(ds: SeededDataset, keys: list, workers: int) -> torch.Tensor:
    loader = DataLoader(ds, batch_size=3, sampler=keys, num_workers=workers)
    return torch.cat(list(loader))


def test_seeded_augmentation_is_independent_of_worker_count() -> None:
    ds = SeededDataset(_Noisy(), seed=7)
    keys = [(e, i) for e in (0, 1) for i in range(16)]
    a = _collect(ds, keys, 0)
    b = _collect(ds, keys, 2)
    c = _collect(ds, list(reversed(keys)), 1).flip(0)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(a[:16, 1:], a[16:, 1:])  # epochs differ
    assert len(set(a[:16, 1].tolist())) == 16  # samples differ
    # the caller's RNG streams are untouched
    random.seed(1)
    torch.manual_seed(1)
    expect = (random.random(), torch.rand(()))
    random.seed(1)
    torch.manual_seed(1)
    ds[(0, 3)]
    assert (random.random(), torch.rand(())) == expect
    ds.set_epoch(1)
    assert torch.equal(ds[3], a[16 + 3])
    assert SeededDataset(_Noisy(), seed=7, return_index=True)[(0, 3)][0] == 3



def test_loop_without_store_or_torchrun_trains_and_audits_with_workers() -> None:
    a, loop = run_w1(0)
    b, _ = run_w1(2)
    assert torch.equal(a.model.weight, b.model.weight)  # same augmentation in workers
    assert a.step == 2 * 4 and a.epoch == 2  # 30 samples / 8: 4 steps, the last partial
    assert [s.samples for s in loop.summaries] == [30, 30]
    assert all(x.ok for x in a.audit.epochs.values())
    assert a.history == [{"world_size": 1, "step": 0, "restart": 0, "restored_step": None,
                          "restored_from": None}]



_QUIET_SCRIPT = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import elastic_kit as ek

torch.manual_seed(0)
ds = TensorDataset(torch.randn(24, 3), torch.randint(0, 2, (24,)))
model = nn.Linear(3, 2)
crit = nn.CrossEntropyLoss(reduction="none")
loop = ek.ElasticLoop(ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)), ds,
                      loss_fn=lambda m, b: crit(m(b[0]), b[1]),
                      config=ek.LoopConfig(epochs=1, global_batch_size=8, micro_batch_size=8,
                                           log_every=1, progress_bar=False))
loop.run()
"""


def test_progress_is_visible_without_configuring_logging() -> None:
    """A script that hands its loop over still sees progress (its own prints are gone)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _QUIET_SCRIPT], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("[elastic_kit]")]
    assert any(ln.startswith("[elastic_kit] step 3 epoch 0 rank-0 loss") for ln in lines), lines
    assert any("epoch 0 done: 3 steps, 24 samples" in ln for ln in lines), lines
    assert any("sample audit: epoch 0: all 24 samples exactly once" in ln for ln in lines)
