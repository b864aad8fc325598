"""``init_distributed`` and ``wrap_ddp`` refuse wrong arguments at the call, with or
without a process group: a wrong type raises ``TypeError``, a wrong value
``ValueError``, each naming the argument (a script run alone never reaches the torch
call that would have caught it, so the mistake would surface only on the cluster)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn

import elastic_kit as ek


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun environment: ``init_distributed`` makes no process group."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("timeout, error, fragment", [
    (30, TypeError, "timeout=30: expected a datetime.timedelta"),
    (30.0, TypeError, "got float"),
    ("30", TypeError, "timeout='30'"),
    (datetime.timedelta(seconds=-1), ValueError, "expected a positive datetime.timedelta"),
    (datetime.timedelta(0), ValueError, "timeout=0 s"),
    (datetime.timedelta(seconds=-1.5), ValueError, "timeout=-1.5 s"),
])
def test_a_wrong_timeout_is_refused_without_a_process_group(
        alone: None, timeout: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as caught:
        ek.init_distributed(timeout=timeout)
    assert fragment in str(caught.value)
    assert not dist.is_initialized()


def test_the_timeout_is_checked_before_any_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 1 of 2: a rendezvous would wait for rank 0, which never comes
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"),
                        ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    called: list[Any] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: called.append(k))
    with pytest.raises(TypeError, match="timeout=300"):
        ek.init_distributed(timeout=300)
    assert called == []


def test_a_backend_of_the_wrong_type_is_a_type_error(alone: None) -> None:
    with pytest.raises(TypeError, match="backend=1: expected None or one of 'nccl'"):
        ek.init_distributed(backend=1)


def test_a_positive_timedelta_is_taken(alone: None) -> None:
    info = ek.init_distributed(timeout=datetime.timedelta(seconds=5))
    assert (info.world_size, dist.is_initialized()) == (1, False)


@pytest.mark.parametrize("call, fragment", [
    (lambda: ek.wrap_ddp(None), "model=None: expected a torch.nn.Module"),
    (lambda: ek.wrap_ddp({"w": 1}), "model=<dict object>"),
    (lambda: ek.wrap_ddp(nn.Linear(1, 1), info="cpu"), "info='cpu': expected None or an "
                                                       "ek.DistInfo"),
    (lambda: ek.wrap_ddp(nn.Linear(1, 1), sync_batchnorm="no"), "sync_batchnorm='no'"),
    (lambda: ek.wrap_ddp(nn.Linear(1, 1), find_unused_parameter=True),
     "['find_unused_parameter'] that DistributedDataParallel does not take; did you mean "
     "'find_unused_parameters'"),
    (lambda: ek.wrap_ddp(nn.Linear(1, 1), bucket_cap=5, device_id=[0]),
     "['bucket_cap', 'device_id']"),
])
def test_wrap_ddp_refuses_wrong_arguments_without_a_process_group(
        alone: None, call: Any, fragment: str) -> None:
    with pytest.raises(TypeError) as caught:
        call()
    assert fragment in str(caught.value)


def test_wrap_ddp_takes_ddps_own_options_without_a_process_group(alone: None) -> None:
    model = nn.Linear(2, 1)
    wrapped = ek.wrap_ddp(model, find_unused_parameters=True, bucket_cap_mb=5,
                          static_graph=False, info=ek.DistInfo())
    assert wrapped is model
