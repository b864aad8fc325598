"""A snapshot replaced before it was written: its copies still running on the device
come before the newer snapshot's, and the file they write into stays mapped until
they complete. CUDA's events and streams are stood in for on this CPU machine (the
GPU suite runs the real race)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic_kit.snapshot._slots as slots_module
from elastic_kit.snapshot._slots import PARKED, Slot
from elastic_kit.snapshot._staging import StagedState, StagingBuffers
from elastic_kit.snapshot._writer import Job, SnapshotWriter
from elastic_kit.store import plan_flat


class _Event:
    """A CUDA event stand-in: completed once ``done`` is set."""

    def __init__(self, done: bool = False, fails: bool = False) -> None:
        self.done = done
        self.fails = fails

    def query(self) -> bool:
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done


class _Stream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


@pytest.fixture
def unregistered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The addresses given to cudaHostUnregister (stood in for)."""
    calls: list[int] = []
    monkeypatch.setattr(slots_module, "host_unregister", lambda ptr: calls.append(ptr) or 0)
    return calls


def _slot(tmp_path: Path, name: str = "slot") -> Slot:
    plan = plan_flat([("w", torch.zeros(1024))])
    slot = Slot(str(tmp_path / name), plan, pin=False)
    slot.registered = True  # as on CUDA (the registration itself is stood in for)
    return slot


def test_a_closed_slot_whose_copies_still_run_stays_mapped_until_they_complete(
        tmp_path: Path, unregistered: list[int]) -> None:
    slot = _slot(tmp_path)
    mapped, ptr = slot.mapped, slot.mapped.data_ptr()
    del mapped
    event = _Event()
    slot.pending = [event]
    before = len(PARKED)
    slot.close(unlink=True)
    assert not os.path.exists(slot.path)           # the file's name goes at once
    assert len(PARKED) == before + 1 and unregistered == []
    assert not slot.registered and slot.pending == [] and slot.views == []
    assert PARKED.reap() == 0 and unregistered == []   # still running: kept
    event.done = True
    assert PARKED.reap() == 1
    assert unregistered == [ptr] and len(PARKED) == before


def test_a_slot_whose_copies_completed_is_given_back_at_its_close(
        tmp_path: Path, unregistered: list[int]) -> None:
    slot = _slot(tmp_path)
    ptr = slot.mapped.data_ptr()
    slot.pending = [_Event(done=True)]
    before = len(PARKED)
    slot.close(unlink=True)
    assert unregistered == [ptr] and len(PARKED) == before


def test_a_parked_mapping_is_given_back_at_the_next_close_of_any_slot(
        tmp_path: Path, unregistered: list[int]) -> None:
    first, second = _slot(tmp_path, "a"), _slot(tmp_path, "b")
    ptrs = [first.mapped.data_ptr(), second.mapped.data_ptr()]
    event = _Event()
    first.pending = [event]
    first.close(unlink=True)
    event.done = True
    second.close(unlink=True)                      # reaps the first on its way
    assert sorted(unregistered) == sorted(ptrs)


def test_an_event_that_cannot_say_keeps_its_mapping(tmp_path: Path,
                                                    unregistered: list[int]) -> None:
    slot = _slot(tmp_path)
    slot.pending = [_Event(fails=True)]
    before = len(PARKED)
    slot.close(unlink=True)
    assert PARKED.reap() == 0 and unregistered == [] and len(PARKED) == before + 1


def test_replacing_a_queued_snapshot_orders_its_copies_before_the_newer_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The training stream waits (on the device) for the replaced snapshot's copies on
    the snapshot stream, and its file keeps their events for its close."""
    streams: dict[Any, _Stream] = {}
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: streams.setdefault(device, _Stream()))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    started, release = threading.Event(), threading.Event()

    def write(job: Job) -> None:
        started.set()
        release.wait(30)

    writer = SnapshotWriter(write, name="ek-test-writer")
    device = torch.device("cuda", 1)
    try:
        buffers, idle = writer.buffers()
        assert idle
        writer.submit(Job(StagedState(state={}), 1, {}, buffers))
        assert started.wait(30)                                        # in flight
        buffers, idle = writer.buffers()
        assert not idle
        side_done, mirror_read = _Event(), _Event()
        queued = StagedState(state={}, device=device, side_done=side_done)
        queued.mirrored = type("M", (), {"read": mirror_read})()
        slot = _slot(tmp_path)
        slot.busy = True
        writer.submit(Job(queued, 2, {}, buffers, slot=slot))         # queued
        again, idle = writer.buffers()                 # a newer snapshot replaces it
        assert again is buffers and not idle and writer.replaced == [2]
        assert queued.staged.is_set()
        assert streams[device].waited == [side_done, mirror_read]
        assert slot.pending == [side_done, mirror_read] and not slot.busy
    finally:
        release.set()
        writer.close()
        slot.close(unlink=True)


def test_a_replaced_snapshot_without_device_copies_fences_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_stream(device: Any = None) -> Any:
        raise AssertionError("no stream is asked for")

    monkeypatch.setattr(torch.cuda, "current_stream", no_stream)
    StagedState(state={}).fence()                                      # CPU state
    StagedState(state={}, device=torch.device("cuda", 0)).fence()      # no side copies
    assert StagingBuffers().stage({"w": torch.ones(3)}).side_events() == []
