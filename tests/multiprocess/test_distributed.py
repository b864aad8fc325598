"""init_distributed / wrap_ddp / collectives on real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from elastic_kit import distributed as ekd
from elastic_kit.testing import spawn_multi_process


def _collectives(scale: int) -> dict:
    info = ekd.init_distributed()
    mx = ekd.all_reduce_max(info.rank * scale)
    total = ekd.all_reduce_sum(torch.tensor([float(info.rank + 1)]))
    src = torch.tensor([float(info.rank), 1.0], dtype=torch.float64)
    pending = ekd.all_reduce_sum_async(src)
    src.fill_(-100.0)  # the caller may reuse its tensor while the all-reduce runs
    later = pending().tolist()
    obj = ekd.broadcast_object({"hello": info.rank}, src=1)
    ts = [torch.full((3,), float(info.rank)), torch.arange(6.0).reshape(2, 3).t()[0:1]]
    if info.rank != 1:
        ts = [torch.zeros(3), torch.zeros(1, 2)]
    ekd.broadcast_tensors(ts, src=1)
    model = ekd.wrap_ddp(nn.Linear(2, 2))
    return {
        "rank": info.rank, "world": info.world_size, "node": info.node_rank,
        "backend": info.backend, "max": mx, "sum": total.item(), "obj": obj, "later": later,
        "ts": [t.tolist() for t in ts], "ddp": type(model).__name__,
        "unwrapped": type(ekd.unwrap_model(model)).__name__,
    }


def test_collectives_on_three_gloo_ranks_agree() -> None:
    res = spawn_multi_process(3, _collectives, 10, local_world_size=1)
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert [r["node"] for r in res] == [0, 1, 2]
    for r in res:
        assert r["world"] == 3 and r["backend"] == "gloo"
        assert r["max"] == 20
        assert r["sum"] == 6.0
        assert r["later"] == [3.0, 3.0]
        assert r["obj"] == {"hello": 1}
        assert r["ts"] == [[1.0, 1.0, 1.0], [[0.0, 3.0]]]
        assert r["ddp"] == "DistributedDataParallel"
        assert r["unwrapped"] == "Linear"


def test_plain_python_is_world_size_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    info = ekd.init_distributed()
    assert (info.rank, info.world_size, info.is_main, info.is_distributed) == (0, 1, True, False)
    assert not ekd.is_dist_ready()
    m = ekd.wrap_ddp(nn.Linear(2, 2))
    assert isinstance(m, nn.Linear)
    assert ekd.all_reduce_max(7) == 7
    t = torch.tensor([2.0])
    pending = ekd.all_reduce_sum_async(t)
    t.zero_()
    assert pending().tolist() == [2.0]
    assert ekd.broadcast_object("x") == "x"


def test_bad_backend_names_the_value() -> None:
    with pytest.raises(ValueError, match="backend='tcp'"):
        ekd.init_distributed(backend="tcp")


def _fail_on_rank_one() -> int:
    if int(os.environ["RANK"]) == 1:
        raise KeyError("boom on one")
    return 0


def test_spawn_reports_the_failing_rank() -> None:
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed:.*boom on one"):
        spawn_multi_process(2, _fail_on_rank_one, timeout=60)


def _quick_rank_stays() -> bool | int:
    """Rank 1 returns at once after init; rank 0 checks, 2 s later, that it is still
    there (a rank that exits early breaks a peer's gloo connect)."""
    import time

    import psutil
    from torch.distributed.distributed_c10d import _get_default_store

    info = ekd.init_distributed()
    kv = _get_default_store()
    if info.rank == 1:
        kv.set("pid1", str(os.getpid()))
        return 0
    pid = int(kv.get("pid1"))
    time.sleep(2.0)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_spawn_keeps_a_rank_that_returned_until_every_rank_returned() -> None:
    assert spawn_multi_process(2, _quick_rank_stays) == [True, 0]


def _sum_of_ranks() -> float:
    info = ekd.init_distributed()
    t = torch.tensor([float(info.rank)])
    torch.distributed.all_reduce(t)
    return float(t.item())


def test_spawn_group_is_not_broken_by_a_port_taken_after_it_was_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A port found free and bound later by rank 0 can be taken in between (by
    another test's group in a parallel worker): the group's store is listening
    before any rank starts, so what free_port would say does not matter."""
    import socket

    from elastic_kit.testing import _spawn

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(_spawn, "free_port", lambda host="127.0.0.1": taken.getsockname()[1])
        assert spawn_multi_process(2, _sum_of_ranks, timeout=60) == [1.0, 1.0]


def _what_a_rank_starts_with() -> tuple[bool, int]:
    import sys

    return "torch._dynamo" in sys.modules, len(os.listdir("/proc/self/task"))


def test_spawned_ranks_start_with_dynamo_imported_and_no_threads_of_the_parent() -> None:
    """DDP's constructor and an optimizer's first step import ``torch._dynamo`` (1.5 s
    of CPU per rank on a 2-core machine): the ranks' forkserver has imported it, and
    a forked rank still holds only its own threads (the forkserver's import started
    none; a thread of the parent would be a dead copy here)."""
    started = spawn_multi_process(2, _what_a_rank_starts_with, timeout=60)
    assert [dynamo for dynamo, _ in started] == [True, True]
    # the main thread and torch's one pool thread at most (as a fresh `import torch`)
    assert all(threads <= 2 for _, threads in started), started
