"""ElasticDistributedSampler on real gloo ranks: defaults from the process group, and a
DataLoader training loop that advances the sampler by the all-reduced real count."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from elastic_kit.distributed import all_reduce_sum, init_distributed, is_dist_ready
from elastic_kit.sampler import ElasticDistributedSampler
from elastic_kit.testing import spawn_multi_process

N = 23


def _shares(n: int, resume_state: dict) -> dict:
    info = init_distributed(backend="gloo")
    sampler = ElasticDistributedSampler(list(range(n)), seed=5)
    fresh = (sampler.local_indices().tolist(), sampler.local_padding_mask().tolist())
    sampler.load_state_dict(resume_state)
    sampler.set_epoch(resume_state["epoch"])
    resumed = (sampler.local_indices().tolist(), sampler.local_padding_mask().tolist())
    return {
        "rank": sampler.rank, "world": sampler.num_replicas, "group": is_dist_ready(),
        "info": (info.rank, info.world_size), "fresh": fresh, "resumed": resumed,
        "order": sampler.permutation().tolist(),
    }


def _real(share: tuple[list[int], list[bool]]) -> list[int]:
    indices, mask = share
    return [i for i, pad in zip(indices, mask) if not pad]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_from_process_group_split_epoch_and_resume_covers_the_rest(world: int) -> None:
    consumed = 10
    state = {"epoch": 2, "consumed": consumed, "seed": 5, "dataset_length": N,
             "shuffle": True, "drop_last": False}
    results = spawn_multi_process(world, _shares, N, state, timeout=120)

    assert [(r["rank"], r["world"], r["group"]) for r in results] == [
        (rank, world, True) for rank in range(world)
    ]
    assert [r["info"] for r in results] == [(rank, world) for rank in range(world)]

    fresh_real = Counter(i for r in results for i in _real(r["fresh"]))
    assert fresh_real == Counter(range(N))  # disjoint apart from padding, and complete
    assert len({len(r["fresh"][0]) for r in results}) == 1

    order = results[0]["order"]
    assert all(r["order"] == order for r in results)
    resumed_real = Counter(i for r in results for i in _real(r["resumed"]))
    assert resumed_real == Counter(order[consumed:])
    assert not set(resumed_real) & set(order[:consumed])
    assert len({len(r["resumed"][0]) for r in results}) == 1


def _train_epochs(n: int, batch: int, epochs: int, call_set_epoch: bool) -> dict:
    """Iterate a DataLoader per epoch as a script does, advancing after every step.

    The real samples of a step are found with ``pass_start`` and
    ``local_padding_mask(position=pass_start)`` and summed over the ranks.
    """
    init_distributed(backend="gloo")
    sampler = ElasticDistributedSampler(list(range(n)), seed=11)
    loader = DataLoader(list(range(n)), batch_size=batch, sampler=sampler)
    trained: list[list[int]] = []
    lengths: list[list[int]] = []
    epochs_seen: list[int] = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        ids, seen_len = [], [len(loader)]
        mask = None
        for b in loader:
            if mask is None:
                mask = sampler.local_padding_mask(position=sampler.pass_start)
            j = (sampler.consumed - sampler.pass_start) // sampler.num_replicas
            keep = ~mask[j:j + len(b)]
            ids.extend(b[keep].tolist())
            real = int(all_reduce_sum(torch.tensor([int(keep.sum())]))[0])
            sampler.advance(real)
            seen_len.append(len(loader))
        trained.append(ids)
        lengths.append(seen_len)
        epochs_seen.append(sampler.epoch)
    return {"trained": trained, "lengths": lengths, "epochs": epochs_seen,
            "orders": [sampler.permutation(e).tolist() for e in range(epochs)]}


@pytest.mark.parametrize("call_set_epoch", [True, False])
def test_dataloader_loop_trains_each_epoch_once_with_constant_len(call_set_epoch: bool) -> None:
    n, batch, epochs, world = 29, 3, 3, 3
    results = spawn_multi_process(world, _train_epochs, n, batch, epochs, call_set_epoch,
                                  timeout=120)
    steps = math.ceil(math.ceil(n / world) / batch)  # 10 per rank, padding included
    for r in results:
        # len(loader) asked before the epoch and after every step: always the same.
        assert r["lengths"] == [[steps] * (steps + 1)] * epochs
        # Without set_epoch the sampler moved on by itself, one epoch per pass.
        assert r["epochs"] == list(range(epochs))
    for e in range(epochs):
        per_epoch = Counter(i for r in results for i in r["trained"][e])
        assert per_epoch == Counter(range(n))
    # Each epoch is its own permutation: rank 0's first sample follows it.
    assert [r0[0] for r0 in results[0]["trained"]] == [o[0] for o in results[0]["orders"]]
