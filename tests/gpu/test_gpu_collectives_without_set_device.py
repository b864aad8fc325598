"""2 GPUs: a script that makes its own NCCL group and puts each rank on
cuda:LOCAL_RANK without torch.cuda.set_device (the case the snapshot writer's
device following and staging's primary device are written for): the library's own
collectives run on each rank's GPU, not on cuda:0 on every rank (where NCCL refuses
two ranks of one communicator on one device, "Duplicate GPU detected")."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 GPUs")


def _worker(rank: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    try:
        dev = torch.device("cuda", rank)          # no torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=2)
        x = torch.ones(1, device=dev)
        dist.all_reduce(x)                       # the script's own collective works
        from elastic_kit.distributed import all_reduce_max, collective_device
        got = all_reduce_max(rank)
        q.put((rank, str(collective_device()), got, None))
    except Exception as e:  # noqa: BLE001
        q.put((rank, None, None, repr(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_library_collectives_use_the_ranks_device_not_cuda0() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    for rank, device, got, err in results:
        assert err is None, f"rank {rank}: {err}"
        assert device == f"cuda:{rank}", (rank, device)
        assert got == 1
