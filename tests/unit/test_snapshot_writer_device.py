"""The snapshot writer's thread works on the CUDA device of the thread that hands it
work (a new thread's current device is 0: registering a file or issuing a copy there
would make a context on GPU 0 for a rank of another GPU). CUDA's per-thread current
device is stood in for on this CPU machine."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from elastic_kit.snapshot._writer import SnapshotWriter


@pytest.fixture
def devices(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """torch.cuda's current device, per thread (0 in a new thread, as CUDA has it), and
    the record of set_device calls (thread name, device)."""
    local = threading.local()
    calls: list[tuple[str, int]] = []

    def set_device(d: int) -> None:
        calls.append((threading.current_thread().name, d))
        local.device = d

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return calls


def test_the_writer_thread_takes_the_training_threads_device(
        devices: list[tuple[str, int]]) -> None:
    torch.cuda.set_device(3)  # the training thread's, as init_distributed sets it
    seen: list[Any] = []
    writer = SnapshotWriter(lambda job: None, name="ek-test-writer")
    try:
        writer.prepare(lambda: seen.append(torch.cuda.current_device()))
        writer.prepare(lambda: seen.append(torch.cuda.current_device()))
        assert writer.wait(timeout=30)
    finally:
        writer.close()
    assert seen[-1] == 3 and set(seen) == {3}
    assert devices[0] == ("MainThread", 3)
    assert [d for name, d in devices if name == "ek-test-writer"] == [3]  # set once


def test_without_cuda_in_use_the_writer_leaves_devices_alone(
        devices: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    writer = SnapshotWriter(lambda job: None, name="ek-test-writer")
    try:
        writer.prepare(lambda: None)
        assert writer.wait(timeout=30)
    finally:
        writer.close()
    assert devices == []


def test_the_writer_thread_takes_the_states_device_over_the_current_one(
        devices: list[tuple[str, int]]) -> None:
    """A script that never called torch.cuda.set_device keeps device 0 current while
    its state lives on another GPU: the writer works on the state's device, and keeps
    it for the preparations that follow."""
    from elastic_kit.snapshot._staging import StagedState, StagingBuffers
    from elastic_kit.snapshot._writer import Job

    seen: list[tuple[str, int]] = []
    writer = SnapshotWriter(lambda job: seen.append(("write", torch.cuda.current_device())),
                            name="ek-test-writer")
    try:
        staged = StagedState(state={}, device=torch.device("cuda", 2))
        writer.submit(Job(staged, 1, {}, StagingBuffers()))
        assert writer.wait(timeout=30)
        writer.prepare(lambda: seen.append(("prepare", torch.cuda.current_device())))
        assert writer.wait(timeout=30)
    finally:
        writer.close()
    assert seen == [("write", 2), ("prepare", 2)]
    assert torch.cuda.current_device() == 0  # the training thread's is left alone
