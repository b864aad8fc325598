"""A tiny plain-DDP training script made elastic with elastic_kit.

Run it alone (world size 1, no process group)::

    python examples/minimal/train.py --ckpt /tmp/ek-minimal

or 3 workers on one node, restarted up to 3 times from the newest checkpoint::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nnodes=1 --nproc-per-node=3 \
        --max-restarts=3 examples/minimal/train.py --ckpt /tmp/ek-minimal

Run it again with the same ``--ckpt`` and it resumes (or finds nothing left to do).
The global batch (12) must be divisible by the world size: 1, 2, 3, 4, 6 or 12.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic_kit as ek


def make_dataset(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, generator=g) > 0).long()
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default="/tmp/elastic-kit-minimal", help="checkpoint URL")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=4, help="steps (0: epoch ends)")
    parser.add_argument("--blocking", action="store_true", help="synchronous checkpoints")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="(tests) slow steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    info = ek.init_distributed()
    torch.manual_seed(0)  # same initial weights on every rank
    model = ek.wrap_ddp(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    criterion = nn.CrossEntropyLoss(reduction="none")

    def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        if args.step_sleep:
            import time

            time.sleep(args.step_sleep)
        x, y = batch
        return criterion(model(x), y)

    def on_epoch_end(state: ek.TrainState, summary: ek.EpochSummary) -> None:
        if info.is_main:
            print(f"epoch {summary.epoch}: loss {summary.loss:.4f}, "
                  f"{summary.samples_per_second:.0f} samples/s, audit ok={summary.audit.ok}",
                  flush=True)

    state = ek.TrainState(model, optimizer)
    loop = ek.ElasticLoop(
        state, make_dataset(), loss_fn=loss_fn, store=ek.CheckpointStore(args.ckpt),
        on_epoch_end=on_epoch_end,
        config=ek.LoopConfig(epochs=args.epochs, global_batch_size=args.global_batch,
                             micro_batch_size=args.micro_batch, max_steps=args.max_steps,
                             checkpoint=ek.CheckpointerConfig(
                                 every_steps=args.checkpoint_every or None,
                                 blocking=args.blocking),
                             log_every=4),
    )
    loop.run()
    if info.is_main:
        print(f"done: step {state.step}, epoch {state.epoch}, history {state.history}",
              flush=True)
    ek.destroy_distributed()


if __name__ == "__main__":
    main()
