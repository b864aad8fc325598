"""Backend choice: NCCL only when every local rank can have a GPU of its own, gloo on the
CPU otherwise (with a log line saying why), and a clear error for a forced NCCL that
cannot work. Checked on the CPU by making torch report CUDA devices that are not there
(with a real process group: ``tests/multiprocess/test_backend_fallback.py``); the real
NCCL runs are in ``tests/gpu``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import elastic_kit as ek
from elastic_kit.distributed import _choose_backend


@pytest.mark.parametrize("local_world_size,devices,expected", [
    (1, 0, "gloo"),
    (1, 1, "nccl"),
    (2, 1, "gloo"),
    (3, 1, "gloo"),
    (2, 2, "nccl"),
    (4, 8, "nccl"),
    (8, 4, "gloo"),
])
def test_nccl_only_with_a_device_for_every_local_rank(local_world_size: int, devices: int,
                                                      expected: str) -> None:
    backend, why = _choose_backend(None, local_world_size=local_world_size, device_count=devices)
    assert backend == expected
    if expected == "gloo" and devices:
        assert why == (f"LOCAL_WORLD_SIZE={local_world_size} ranks on this node but only "
                       f"{devices} CUDA device(s): NCCL needs one device per rank, so the "
                       f"ranks use gloo on the CPU")


def test_a_requested_backend_is_kept_when_it_can_work() -> None:
    assert _choose_backend("gloo", local_world_size=3, device_count=1)[0] == "gloo"
    assert _choose_backend("nccl", local_world_size=2, device_count=2)[0] == "nccl"


def test_forced_nccl_with_fewer_devices_than_ranks_names_both() -> None:
    with pytest.raises(ValueError) as e:
        _choose_backend("nccl", local_world_size=3, device_count=1)
    assert str(e.value).startswith(
        "backend='nccl' needs one CUDA device per local rank, but local ranks 0-2 "
        "(LOCAL_WORLD_SIZE=3) would share 1 visible CUDA device(s)")


def _pretend_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_init_distributed_refuses_forced_nccl_before_touching_the_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_gpus(monkeypatch, 1)
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)

    def no_device(*_: Any) -> None:
        raise AssertionError("torch.cuda.set_device called before the check")

    monkeypatch.setattr(torch.cuda, "set_device", no_device)
    with pytest.raises(ValueError, match=r"local ranks 0-1 \(LOCAL_WORLD_SIZE=2\) would share "
                                         r"1 visible CUDA device"):
        ek.init_distributed(backend="nccl")
    assert not torch.distributed.is_initialized()


def test_without_a_process_group_the_device_follows_the_same_rule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert ek.get_dist_info().device == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert ek.get_dist_info().device == torch.device("cpu")


def test_local_cluster_hides_gpus_from_its_agents_unless_cuda_is_true(tmp_path: Any) -> None:
    from elastic_kit.testing import LocalCluster

    with LocalCluster(["t.py"], log_dir=tmp_path) as c:
        hidden = c._agent_env({"CUDA_VISIBLE_DEVICES": "0"})
    assert hidden["CUDA_VISIBLE_DEVICES"] == ""
    with LocalCluster(["t.py"], log_dir=tmp_path, cuda=True) as c:
        shown = c._agent_env({"CUDA_VISIBLE_DEVICES": "1"})
    assert shown["CUDA_VISIBLE_DEVICES"] == "1"
