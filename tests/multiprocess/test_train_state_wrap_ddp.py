"""``wrap_ddp(sync_batchnorm=True)`` on CPU ranks (gloo): refused up front, naming the
option and the device, while the models it can wrap there still train."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.testing import spawn_multi_process


def _wrap_on_cpu() -> dict[str, Any]:
    ek.init_distributed()
    torch.manual_seed(0)
    with_bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    out: dict[str, Any] = {}
    try:
        ek.distributed.wrap_ddp(with_bn, sync_batchnorm=True)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    out["bn_kept"] = type(with_bn[1]).__name__
    # no BatchNorm to convert: nothing to refuse
    plain = ek.distributed.wrap_ddp(nn.Linear(4, 2), sync_batchnorm=True)
    out["plain_wrapped"] = isinstance(plain, nn.parallel.DistributedDataParallel)
    local_bn = ek.distributed.wrap_ddp(with_bn, sync_batchnorm=False)
    y = local_bn(torch.ones(8, 4) * torch.arange(8.0)[:, None])
    out["local_bn_mean"] = round(float(y.mean()), 5)
    return out


def test_sync_batchnorm_on_cpu_ranks_is_a_value_error_naming_option_and_device() -> None:
    out = spawn_multi_process(2, _wrap_on_cpu)
    for rank in out:
        assert rank["refused"] is not None
        assert "sync_batchnorm=True" in rank["refused"] and "device cpu" in rank["refused"]
        assert rank["bn_kept"] == "BatchNorm1d"
        assert rank["plain_wrapped"] is True
        assert rank["local_bn_mean"] == 0.0  # BatchNorm in training mode: batch mean 0
