"""Which GPU the library's own collectives (restore agreement, exit flags) use under
NCCL: the group's bound device, else the device the script made current, else the one
torchrun's LOCAL_RANK maps to. A script that puts each rank on ``cuda:LOCAL_RANK``
without ``torch.cuda.set_device`` has device 0 current on every rank, where NCCL
refuses two ranks of one group (the GPU tests run the real case on two GPUs)."""

from __future__ import annotations

import pytest

from elastic_kit.distributed import collective_device
from elastic_kit._collectives import nccl_device_index


@pytest.mark.parametrize("bound,current,local_rank,count,expected", [
    (3, 0, 1, 4, 3),        # init_process_group(device_id=cuda:3)
    (None, 2, 1, 4, 2),     # the script called set_device(2)
    (None, 0, 1, 4, 1),     # no set_device: device 0 current everywhere -> LOCAL_RANK's
    (None, 0, 5, 4, 1),     # as init_distributed maps it: LOCAL_RANK % device count
    (None, 0, 1, 1, 0),     # one visible GPU per rank (CUDA_VISIBLE_DEVICES)
    (None, 0, None, 4, 0),  # not under torchrun
    (None, 0, 0, 4, 0),
])
def test_the_ranks_gpu_for_the_librarys_collectives(
        bound: int | None, current: int, local_rank: int | None, count: int,
        expected: int) -> None:
    assert nccl_device_index(bound, current, local_rank, count) == expected


def test_without_a_process_group_the_collectives_device_is_the_cpu() -> None:
    assert str(collective_device()) == "cpu"
