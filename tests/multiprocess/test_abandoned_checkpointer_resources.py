"""A process that abandons checkpointers (an exception leaves the ``with`` block, and
the script retries in the same process: a notebook, a sweep) does not pile up their
replica receivers: listening threads and sockets."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import torch

from elastic_kit.testing import spawn_multi_process


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _receivers() -> int:
    return sum(t.name.startswith("ek-replica-recv") for t in threading.enumerate())


def _retries(root: str) -> list[tuple[int, int]]:
    import elastic_kit as ek
    from torch.utils.data import DataLoader, TensorDataset

    ek.init_distributed()
    data = TensorDataset(torch.randn(24, 3), torch.randn(24, 1))
    seen: list[tuple[int, int]] = []
    for attempt in range(4):
        model = ek.wrap_ddp(torch.nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sampler = ek.ElasticDistributedSampler(data)
        state = ek.TrainState(model, opt, sampler=sampler)
        try:
            with ek.Checkpointer(state, f"{root}/r{attempt}", every_steps=2,
                                 snapshot_every=1) as ck:
                for epoch in range(ck.restore(), 1):
                    sampler.set_epoch(epoch)
                    for k, (x, y) in enumerate(DataLoader(data, batch_size=2, sampler=sampler)):
                        torch.nn.functional.mse_loss(model(x), y).backward()
                        opt.step()
                        opt.zero_grad()
                        ck.step(len(x))
                        if k == 3:
                            raise ValueError("a bug in the loop")
        except ValueError:
            pass
        del ck, state, model, opt
        gc.collect()
        seen.append((_receivers(), _sockets()))
    return seen


def test_retries_in_one_process_do_not_pile_up_replica_receivers(tmp_path: Any) -> None:
    # two nodes of one rank: each node's writer listens for the other's replicas
    per_rank = spawn_multi_process(2, _retries, str(tmp_path), local_world_size=1,
                                   timeout=240)
    for seen in per_rank:
        receivers = [r for r, _ in seen]
        sockets = [s for _, s in seen]
        assert max(receivers) <= 1, seen  # the last abandoned one's, until the next connects
        assert sockets[-1] <= sockets[0], seen  # not growing with every retry
