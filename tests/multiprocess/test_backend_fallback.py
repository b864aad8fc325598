"""The gloo fallback with a real process group: two local ranks and one pretend GPU
(torch made to report a CUDA device that is not there) join gloo on the CPU and local
rank 0 warns why; ``spawn_multi_process`` keeps its ranks off the GPUs unless asked.
The same on real GPUs: ``tests/gpu/test_gpu_backend_choice.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

import elastic_kit as ek
from elastic_kit.testing import spawn_multi_process
from tests.log_lines import LogLines


def _init_with_one_pretend_gpu(_: Any) -> dict[str, Any]:
    torch.cuda.is_available = lambda: True  # this rank process only
    torch.cuda.device_count = lambda: 1
    records = LogLines(logging.WARNING)
    logger = logging.getLogger("elastic_kit.distributed")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    info = ek.init_distributed()
    t = torch.tensor([float(info.rank + 1)], device=info.device)
    torch.distributed.all_reduce(t)
    return {"backend": info.backend, "device": str(info.device), "sum": float(t.item()),
            "why": [line for line in records.lines if "not nccl" in line]}


def test_two_local_ranks_on_one_gpu_fall_back_to_gloo_on_the_cpu_and_say_why() -> None:
    out = spawn_multi_process(2, _init_with_one_pretend_gpu, None)
    expected_why = ("process-group backend gloo, not nccl: LOCAL_WORLD_SIZE=2 ranks on this "
                    "node but only 1 CUDA device(s): NCCL needs one device per rank, so the "
                    "ranks use gloo on the CPU")
    # a warning, once per node (local rank 0): every local rank decides alike
    assert out == [{"backend": "gloo", "device": "cpu", "sum": 3.0, "why": [expected_why]},
                   {"backend": "gloo", "device": "cpu", "sum": 3.0, "why": []}]


# --- the testing helpers keep their ranks on the CPU unless asked ----------------------

def _cuda_view(_: Any) -> dict[str, Any]:
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "available": torch.cuda.is_available(),
            "bad_fork": torch.cuda._is_in_bad_fork()}


def test_spawn_multi_process_hides_gpus_unless_cuda_is_true() -> None:
    hidden = spawn_multi_process(2, _cuda_view, None)
    assert hidden == [{"visible": "", "available": False, "bad_fork": False}] * 2
    shown = spawn_multi_process(1, _cuda_view, None, cuda=True)
    # the ranks see what this process sees, and may initialise CUDA (no bad fork)
    assert shown == [{"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                      "available": torch.cuda.is_available(), "bad_fork": False}]
