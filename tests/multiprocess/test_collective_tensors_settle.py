"""The library's collectives are settled before exit, and one a peer never joins does
not hold the exit up: its tensor is pinned, still valid, and never freed by gloo."""

from __future__ import annotations

from typing import Any

import torch

import elastic_kit as ek
from elastic_kit import distributed
from elastic_kit.testing import spawn_multi_process


def _settle_after_waited() -> dict[str, Any]:
    ek.init_distributed()
    result = distributed.all_reduce_sum_async(torch.ones(3))
    total = result().tolist()
    del result
    peak = distributed.all_reduce_max(distributed.get_dist_info().rank)
    return {"total": total, "peak": peak, "settled": distributed.settle_collectives(10.0)}


def test_waited_collectives_settle_with_nothing_left_held() -> None:
    out = spawn_multi_process(2, _settle_after_waited)
    assert out == [{"total": [2.0, 2.0, 2.0], "peak": 1, "settled": True}] * 2


def _settle_while_a_peer_is_away() -> dict[str, Any]:
    info = ek.init_distributed()
    kv = torch.distributed.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    if info.rank == 0:
        result = distributed.all_reduce_sum_async(torch.full((2,), 3.0))
        out["settled_alone"] = distributed.settle_collectives(0.3)  # rank 1 is away
        kv.set("rank0_settled", "1")
        out["total"] = result().tolist()          # the pinned tensor is still the result
        del result
    else:
        kv.wait(["rank0_settled"])
        distributed.all_reduce_sum_async(torch.full((2,), 4.0))()
    out["settled"] = distributed.settle_collectives(10.0)
    return out


def test_a_collective_a_peer_has_not_joined_is_pinned_not_waited_for() -> None:
    out = spawn_multi_process(2, _settle_while_a_peer_is_away)
    assert out[0] == {"settled_alone": False, "total": [7.0, 7.0], "settled": True}
    assert out[1] == {"settled": True}
