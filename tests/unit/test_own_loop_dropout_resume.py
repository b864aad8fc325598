"""The README's own loop with dropout resumes mid-epoch bitwise: its loader has a
generator of its own, so the resumed run's new iterator (which draws its base seed
from the loader's generator, else from torch's) leaves the restored RNG state to the
dropout masks. Without one, every later mask shifted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import elastic_kit as ek


def _train(store: str | None, stop_after: int | None, own_generator: bool) -> torch.Tensor:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ek.ElasticDistributedSampler(data, num_replicas=1, rank=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler,
                        generator=torch.Generator() if own_generator else None)
    state = ek.TrainState(model, opt, sampler=sampler)
    ckpt = ek.Checkpointer(state, store, every_steps=3, snapshot_every=0,
                           handle_signals=False, info=ek.DistInfo())
    for epoch in range(ckpt.restore(), 2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            w = ckpt.sample_weights(len(x))
            loss = ((model(x) - y).square().mean(1) * w).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(len(x))
            if state.step == stop_after:
                ckpt.abandon()  # killed: the next run resumes from step 6
                return torch.zeros(0)
        ckpt.end_epoch()
    ckpt.close()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("own_generator", [True, False])
def test_a_mid_epoch_resume_draws_the_same_dropout_masks(tmp_path: Path,
                                                        own_generator: bool) -> None:
    plain = _train(None, None, own_generator)
    store = str(tmp_path / "ck")
    _train(store, 7, own_generator)          # the newest checkpoint: step 6, mid-epoch 0
    resumed = _train(store, None, own_generator)
    assert torch.equal(resumed, plain) == own_generator
