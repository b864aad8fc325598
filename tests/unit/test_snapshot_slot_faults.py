"""The snapshot files a writer reuses, under the faults that could lose or leak one:
a step committed twice, a file dropped while the training thread takes it, a full
shared-memory file system, and a write that fails before its commit."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic_kit as ek
import elastic_kit.snapshot._slots as slots_module
from elastic_kit.snapshot import SnapshotTier
from elastic_kit.snapshot._slots import SLOT_PREFIX, Slot, Slots
from elastic_kit.snapshot._staging import StagedState, StagingBuffers
from elastic_kit.snapshot._writer import Job, SnapshotWriter
from elastic_kit.store import plan_flat


def _tier(shm: str) -> SnapshotTier:
    return SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)


def _state(seed: int, n: int = 4096) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": seed}


def _deleted_mappings(node_dir: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if node_dir in line and "(deleted)" in line]


def test_a_step_committed_twice_leaves_no_slot_behind(shm: str) -> None:
    """An explicit snapshot at a step a periodic one took commits the step again from
    the other file; the file it replaced is dropped with its slot, not kept mapped and
    counted as holding the step for the rest of the run."""
    tier = _tier(shm)
    try:
        for step in (5, 5, 10, 15, 20):
            tier.save(_state(step), step=step, metadata={})
            assert tier.wait(timeout=60)
        slots = tier._slots
        assert slots is not None
        held = sorted(s.step for s in slots._slots if s.step is not None)
        assert held == [20] and slots.count == 2
        assert _deleted_mappings(tier.node_dir) == []
        loaded = tier.load()
        assert loaded is not None and loaded.step == 20
        assert torch.equal(loaded.state["w"], _state(20)["w"])
    finally:
        tier.close(remove=True)


def test_a_free_file_being_dropped_cannot_be_taken_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer thread drops a free file of another layout while the training thread
    looks for a free file: the training thread must not get the one being dropped."""
    slots = Slots(str(tmp_path))
    old = plan_flat([("w", torch.zeros(1024))])
    new = plan_flat([("w", torch.zeros(2048))])
    slots.prepare(old)
    assert slots.count == 1
    dropping, go_on = threading.Event(), threading.Event()

    def pause(*_: Any, **__: Any) -> None:  # the writer thread, on its way to the drop
        dropping.set()
        assert go_on.wait(30)

    original_drop, original_close = Slots._drop, Slot.close
    monkeypatch.setattr(Slots, "_drop", lambda self, s: (pause(), original_drop(self, s)))
    monkeypatch.setattr(Slot, "close", lambda self, **k: (pause(), original_close(self, **k)))
    writer = threading.Thread(target=slots.prepare, args=(new,))
    writer.start()
    try:
        assert dropping.wait(30)
        taken = slots.take_free()
    finally:
        go_on.set()
        writer.join(30)
    assert taken is None
    free = slots.take_free()
    assert free is not None and free.plan == new and free.mapped.numel() == new.size
    monkeypatch.setattr(Slot, "close", original_close)
    slots.close()


def test_a_file_the_file_system_has_no_room_for_is_refused_and_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full tmpfs would kill the process that first touches the file's pages
    (SIGBUS): the file is refused with ENOSPC before it is mapped, and removed."""
    real = shutil.disk_usage
    monkeypatch.setattr(slots_module.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1 << 20))
    slots = Slots(str(tmp_path))
    with pytest.raises(OSError) as err:
        slots.prepare(plan_flat([("w", torch.zeros(1 << 20))]))   # 4 MiB
    assert err.value.errno == errno.ENOSPC and "snapshot file" in str(err.value)
    assert [n for n in os.listdir(tmp_path) if n.startswith(SLOT_PREFIX)] == []
    assert slots.count == 0
    slots.prepare(plan_flat([("w", torch.zeros(1024))]))         # 4 KiB: room
    assert slots.count == 1
    slots.close()


def test_a_full_file_system_switches_snapshots_off_instead_of_killing_the_run(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _tier(shm)
    try:
        tier.save(_state(1), step=1, metadata={})
        assert tier.wait(timeout=60) and tier.written == [1]
        real = shutil.disk_usage
        monkeypatch.setattr(slots_module.shutil, "disk_usage",
                            lambda p: real(p)._replace(free=0))
        big = _state(2, n=1 << 16)                 # another layout: a new file
        tier.save(big, step=2, metadata={})
        tier.wait(timeout=60)
        tier.save(big, step=3, metadata={})        # learns of the failure: off
        assert not tier.enabled
        assert tier.written == [1]
    finally:
        tier.close(remove=True)


def test_a_snapshot_whose_write_fails_before_its_commit_gives_its_file_back(
        shm: str) -> None:
    """A failing rank's last snapshot is taken even after a failed write: the failed
    one's file must be free for it (not a third file of the state's size)."""
    tier = _tier(shm)
    try:
        tier.save(_state(1), step=1, metadata={})
        assert tier.wait(timeout=60)

        def fail(_: Any) -> None:
            raise RuntimeError("the audit's sum never came")

        tier.save(_state(2), step=2, metadata={}, finish=fail)
        assert tier.wait(timeout=60)
        slots = tier._slots
        assert slots is not None
        assert [s.busy for s in slots._slots] == [False, False]
        direct = tier.direct
        tier.save(_state(3), step=3, metadata={}, last=True)
        assert tier.wait(timeout=60)
        assert tier.direct == direct + 1 and slots.made == 2 and tier.written == [1, 3]
    finally:
        tier.close(remove=True)


@pytest.mark.parametrize("flush", [True, False], ids=["closing", "failing"])
def test_a_last_write_that_failed_is_a_warning_only_when_the_tier_closes_normally(
        shm: str, flush: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A failing worker closes its tier without flushing: its last write failing (a
    sharded snapshot whose exchange met a dead peer) is expected then, not a warning
    beside the error that ends the worker."""
    import logging

    tier = _tier(shm)

    def fail(_: Any) -> None:
        raise RuntimeError("Connection closed by peer")

    with caplog.at_level(logging.INFO, logger="elastic_kit.snapshot._tier"):
        tier.save(_state(1), step=1, metadata={}, finish=fail)
        tier.close(remove=True, flush=flush)
    said = [(r.levelno, r.getMessage()) for r in caplog.records
            if r.getMessage().startswith("the last snapshot to")]
    assert len(said) == 1 and "Connection closed by peer" in said[0][1]
    assert said[0][0] == (logging.WARNING if flush else logging.INFO)


def test_a_failed_deferred_copy_gives_the_file_back(tmp_path: Path) -> None:
    class Failing(StagedState):
        def copy_deferred(self) -> None:
            self.staged.set()
            raise RuntimeError("CUDA error: unspecified launch failure")

    slot = Slot(str(tmp_path / "slot"), plan_flat([("w", torch.zeros(16))]), pin=False)
    slot.busy = True
    written: list[int] = []
    writer = SnapshotWriter(lambda job: written.append(job.step), name="ek-test-writer")
    try:
        writer.submit(Job(Failing(state={}), 1, {}, StagingBuffers(), slot=slot))
        assert writer.wait(timeout=30)
    finally:
        writer.close()
    assert written == [] and isinstance(writer.take_error(), RuntimeError)
    assert not slot.busy and slot.pending == []
    slot.close(unlink=True)


def test_quantized_and_nested_tensors_are_snapshotted(shm: str) -> None:
    """They are strided, but no buffer of their shape and dtype holds them: staged
    as copies of their own (snapshots stayed on until the first one, then went off)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both are deprecated or prototypes in torch
        q = torch.quantize_per_tensor(torch.arange(6.0), scale=0.5, zero_point=2,
                                      dtype=torch.quint8)
        n = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0) + 10])
    tier = _tier(shm)
    try:
        for step in (1, 2):          # the second one also stages into a free file
            tier.save({"q": q, "n": n, "w": torch.full((64,), float(step))}, step=step,
                      metadata={})
            assert tier.wait(timeout=60)
        assert tier.enabled and tier.written == [1, 2]
        loaded = tier.load()
        assert loaded is not None and loaded.step == 2
        assert torch.equal(loaded.state["q"].dequantize(), q.dequantize())
        assert [t.tolist() for t in loaded.state["n"].unbind()] == [[0.0, 1.0],
                                                                   [10.0, 11.0, 12.0]]
        assert loaded.state["w"].tolist() == [2.0] * 64
    finally:
        tier.close(remove=True)
