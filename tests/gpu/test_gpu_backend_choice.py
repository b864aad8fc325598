"""On a real GPU machine: more local ranks than GPUs run with gloo on the CPU (not NCCL's
"invalid usage"), a forced NCCL there is a clear error, and the testing helpers keep
their ranks off the GPUs unless asked. The same rules are checked on the CPU with a
pretend device count in ``tests/unit/test_backend_choice.py`` and
``tests/multiprocess/test_backend_fallback.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import elastic_kit as ek
from elastic_kit.testing import spawn_multi_process

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


def _init_default(_: Any) -> dict[str, Any]:
    info = ek.init_distributed()
    t = torch.tensor([float(info.rank + 1)], device=info.device)
    torch.distributed.all_reduce(t)
    return {"backend": info.backend, "device": str(info.device), "sum": float(t.item())}


def _init_forced_nccl(_: Any) -> str:
    try:
        ek.init_distributed(backend="nccl")
    except ValueError as e:
        return str(e)
    return "no error"


def _sees_cuda(_: Any) -> bool:
    return torch.cuda.is_available()


def test_more_local_ranks_than_gpus_use_gloo_on_the_cpu() -> None:
    n = torch.cuda.device_count() + 1
    out = spawn_multi_process(n, _init_default, None, cuda=True, timeout=300)
    assert out == [{"backend": "gloo", "device": "cpu", "sum": float(n * (n + 1) // 2)}] * n


def test_forced_nccl_with_more_local_ranks_than_gpus_is_a_clear_error() -> None:
    gpus = torch.cuda.device_count()
    n = gpus + 1
    out = spawn_multi_process(n, _init_forced_nccl, None, cuda=True, timeout=300)
    expected = (f"backend='nccl' needs one CUDA device per local rank, but local ranks "
                f"0-{n - 1} (LOCAL_WORLD_SIZE={n}) would share {gpus} visible CUDA device(s)")
    assert all(msg.startswith(expected) for msg in out), out


def test_spawned_ranks_see_the_gpus_only_when_asked() -> None:
    assert spawn_multi_process(1, _sees_cuda, None) == [False]
    assert spawn_multi_process(1, _sees_cuda, None, cuda=True) == [True]
