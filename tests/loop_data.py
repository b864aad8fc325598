"""A small augmented dataset and a one-process ElasticLoop run, shared by the loop's
unit tests and its data-loader-worker tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_kit.loop import ElasticLoop, LoopConfig, SeededDataset, TrainState


class AugmentedData(Dataset):
    """30 fixed samples plus torch-RNG noise drawn per access: an "augmentation"."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(30, 4, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


def run_w1(workers: int, **cfg: object) -> tuple[TrainState, ElasticLoop]:
    """Train 2 epochs at world size 1 with ``workers`` loader workers; ``cfg`` overrides."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss(reduction="none")
    state = TrainState(model, opt)
    options = dict(epochs=2, global_batch_size=8, micro_batch_size=3, log_every=0,
                   progress_bar=False, num_workers=workers)
    options.update(cfg)
    loop = ElasticLoop(state, SeededDataset(AugmentedData(), seed=1),
                       loss_fn=lambda m, b: crit(m(b[0]), b[1]), config=LoopConfig(**options))
    loop.run()
    return state, loop
