"""ElasticDistributedSampler on real gloo ranks: defaults from the process group."""

from __future__ import annotations

from collections import Counter

import pytest

from elastic_kit.distributed import init_distributed, is_dist_ready
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
