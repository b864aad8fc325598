"""The library's collectives are settled before exit, one a peer never joins does not
hold the exit up (its tensor is pinned, still valid), and gloo's thread never frees a
collective's Python-made tensor (during shutdown that aborts a finished worker)."""

from __future__ import annotations

import threading
import time
import weakref
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


def _thread_that_frees_an_unwaited_collective() -> str:
    """Rank 1 starts a flags-style all-reduce and drops it unwaited; rank 0 joins it
    only afterwards, so gloo's thread finishes the work item after Python let go of
    it. Returns the name of the thread on which rank 1's tensor was freed."""
    info = ek.init_distributed()
    kv = torch.distributed.distributed_c10d._get_default_store()
    if info.rank == 0:
        kv.wait(["dropped"])
        distributed.all_reduce_sum_async(torch.ones(2))()
        kv.set("joined", "1")
        distributed.all_reduce_max(0)
        return "joiner"
    given = torch.ones(2)
    result = distributed.all_reduce_sum_async(given)
    # the tensor gloo reduces: the one the result function closes over (not the input)
    (sent,) = [c.cell_contents for c in result.__closure__ or ()
               if isinstance(c.cell_contents, torch.Tensor) and c.cell_contents is not given]
    freed: list[str] = []
    weakref.finalize(sent, lambda: freed.append(threading.current_thread().name))
    del result, sent
    kv.set("dropped", "1")
    kv.wait(["joined"])
    time.sleep(0.5)  # gloo's thread has finished and dropped its work item by now
    distributed.all_reduce_max(1)  # the library's next collective
    return freed[0] if freed else "never freed"


def test_a_collective_tensor_is_never_freed_on_the_backends_thread() -> None:
    # Freed on gloo's thread during interpreter shutdown, a Python-made tensor takes
    # the GIL inside a noexcept destructor: the finished worker aborts (SIGABRT).
    out = spawn_multi_process(2, _thread_that_frees_an_unwaited_collective)
    assert out == ["joiner", "MainThread"]
