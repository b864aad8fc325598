"""Staging CUDA tensors in pinned memory: a synchronous save's copy to the CPU, and a
snapshot's (taken now, or deferred to the writer thread until the optimizer step),
including a snapshot taken while the previous one is still being written.

Skipped without CUDA; run by ``scripts/gpu-check``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import fsspec
import pytest
import torch

import elastic_kit as ek
from elastic_kit.snapshot import SnapshotTier
from elastic_kit.snapshot._staging import StagingBuffers
from elastic_kit.store._serialize import prepare_state
from elastic_kit.testing import FaultFileSystem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


def _cuda_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(1 << 18, generator=g).cuda() for i in range(4)}


def test_a_synchronous_save_copies_cuda_tensors_into_pinned_memory(tmp_path: Path) -> None:
    state = _cuda_state()
    staged = prepare_state(state, copy=False)
    assert all(v.device.type == "cpu" and v.is_pinned() for v in staged.values())
    expected = {k: v.cpu() for k, v in state.items()}
    with ek.CheckpointStore(str(tmp_path / "ck"), info=ek.DistInfo()) as store:
        store.save(state, step=1)                  # blocking
        loaded = store.load(map_location="cpu")
    assert loaded is not None and loaded.step == 1
    for k, v in expected.items():
        assert torch.equal(loaded.state[k], v), k


def test_snapshot_staging_is_pinned_and_sees_work_queued_before_it() -> None:
    state = _cuda_state()
    for v in state.values():
        v.mul_(3.0)                                # queued, not synchronized
    expected = {k: v.cpu() for k, v in state.items()}
    later = [state["w0"], state["w1"]]
    from elastic_kit.snapshot._staging import storage_keys

    staged = StagingBuffers().stage(state, later=storage_keys(later))
    assert not staged.staged.is_set()              # w0, w1 wait for the writer thread
    staged.copy_deferred()
    assert staged.staged.is_set()
    for v in later:
        v.sub_(100.0)                              # the "optimizer step": after staging
    for k, v in expected.items():
        got = staged.state[k]
        assert got.is_pinned() and torch.equal(got, v), k


def test_deferred_cuda_copies_are_waited_for_on_the_device_not_by_the_cpu() -> None:
    """Deferred CUDA copies go on a side stream at once; wait_staged() makes the
    caller's stream wait for them, so an update issued right after it (the optimizer
    step) cannot change what is copied, and the CPU never waited for the copy."""
    from elastic_kit.snapshot._staging import storage_keys

    live = torch.ones(1 << 26, device="cuda")      # 256 MiB: a copy of milliseconds
    live.mul_(2.0)                                 # queued before the snapshot
    staged = StagingBuffers().stage({"w": live}, later=storage_keys([live]))
    assert staged.side_done is not None and not staged.deferred
    assert not staged.staged.is_set()
    staged.wait_staged()                           # the optimizer-step pre-hook
    assert staged.staged.is_set()
    live.fill_(3.0)                                # the update, issued at once
    torch.cuda.synchronize()
    got = staged.state["w"]
    assert got.is_pinned() and torch.equal(got, torch.full_like(got, 2.0))
    assert staged.stall is not None
    stall = staged.stall.seconds()
    assert stall is not None and 0.0 <= stall < 10.0


def test_relayed_copies_leave_the_optimizer_path_and_still_land_whole() -> None:
    """With a relay budget, the last bytes go to a device buffer before the event the
    optimizer's step waits for and on to the host after it: an update issued right
    after wait_staged() changes neither part, and the writer's wait (copy_deferred)
    covers the relay's copies to the host."""
    from elastic_kit.snapshot._relay import DeviceRelay
    from elastic_kit.snapshot._staging import storage_keys

    live = {"a": torch.ones(1 << 24, device="cuda"), "b": torch.ones(1 << 25, device="cuda")}
    for v in live.values():
        v.mul_(2.0)
    relay = DeviceRelay()
    relay.budget = 5 << 25                         # all of b (128 MiB) and half of a
    staged = StagingBuffers().stage(live, later=storage_keys(live.values()), relay=relay)
    assert staged.side_all is not None and relay.nbytes >= relay.budget
    staged.wait_staged()
    for v in live.values():
        v.fill_(3.0)
    staged.copy_deferred()                         # the writer's wait
    for k, v in live.items():
        got = staged.state[k]
        assert torch.equal(got, torch.full_like(got, 2.0)), k
    assert staged.stall is not None and staged.stall.direct_bytes == 1 << 25
    torch.cuda.synchronize()
    assert staged.stall.copy_seconds() is not None


def test_a_cuda_snapshot_taken_during_a_write_is_queued_and_written_next(
        tmp_path: Path) -> None:
    fs = FaultFileSystem(fsspec.filesystem("file"))
    opened, entered = threading.Event(), threading.Event()

    def hold(path: str) -> None:
        entered.set()
        opened.wait(60)

    fs.add("pipe", match="manifest.json", before=hold, times=1)
    root = tmp_path / "shm"
    root.mkdir()
    tier = SnapshotTier("run", info=ek.DistInfo(run_id="t"), every=1, root=str(root),
                        filesystem=fs)
    live = _cuda_state()
    tier.save(live, step=1, metadata={}, copy_later=list(live.values()))
    tier.wait_staged()
    assert entered.wait(60)
    for v in live.values():
        v.fill_(2.0)
    tier.save(live, step=2, metadata={}, copy_later=list(live.values()))
    tier.wait_staged()                             # queued: copies already on the side stream
    for v in live.values():
        v.fill_(-1.0)
    opened.set()
    assert tier.wait(timeout=60) and tier.written == [1, 2]
    loaded = tier.load(map_location="cpu")
    assert loaded is not None and loaded.step == 2
    assert all(torch.equal(v, torch.full_like(v, 2.0)) for v in loaded.state.values())
    tier.close(remove=True)


def test_a_replaced_snapshots_late_copies_land_before_the_newer_ones() -> None:
    """A snapshot queued behind a write is replaced by a newer one, which takes over
    its pinned buffers. The older one's copies on the snapshot stream are held up (a
    long kernel ahead of them there); the newer one's run on the training stream. The
    state written must be the newer one's: the older copies may not land on it after
    it was copied (the writer here reads once the snapshot stream is idle)."""
    from elastic_kit.snapshot._staging import storage_keys
    from elastic_kit.snapshot._streams import side_stream
    from elastic_kit.snapshot._writer import Job, SnapshotWriter

    device = torch.device("cuda", torch.cuda.current_device())
    older = torch.full((1 << 22,), 1.0, device=device)
    newer = torch.full((1 << 22,), 2.0, device=device)
    written: dict[int, torch.Tensor] = {}
    started, release = threading.Event(), threading.Event()

    def write(job: Job) -> None:
        if job.step == 1:
            started.set()
            release.wait(60)
            return
        side_stream(device).synchronize()      # every copy of the older one has run
        written[job.step] = job.staged.state["w"].clone()

    writer = SnapshotWriter(write, name="ek-test-writer")
    try:
        buffers, _ = writer.buffers()
        writer.submit(Job(buffers.stage({"w": torch.zeros(4, device=device)}), 1, {},
                          buffers))
        assert started.wait(60)                # in flight, held
        buffers, idle = writer.buffers()
        assert not idle
        with torch.cuda.stream(side_stream(device)):
            torch.cuda._sleep(int(1e9))        # ~0.5 s on the snapshot stream
        queued = buffers.stage({"w": older}, later=storage_keys([older]))
        assert queued.side_done is not None
        writer.submit(Job(queued, 2, {}, buffers))
        again, idle = writer.buffers()         # replaced before it was written
        assert again is buffers and writer.replaced == [2]
        writer.submit(Job(again.stage({"w": newer}), 3, {}, again))
        release.set()
        assert writer.wait(timeout=60)
    finally:
        release.set()
        writer.close()
    assert writer.written == [1, 3]
    assert torch.equal(written[3], torch.full_like(written[3], 2.0))


def _doubled_late(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` doubled by kernels that run ~0.5 s from now (behind a sleep on device
    1), with device 0 current, as in a script that never called set_device."""
    torch.cuda.set_device(0)
    with torch.cuda.device(1):
        torch.cuda._sleep(int(1e9))
    for t in tensors:
        t.mul_(2.0)
    return tensors


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_state_off_the_current_device_is_staged_whole() -> None:
    """A script that never called torch.cuda.set_device keeps device 0 current while
    its state lives on device 1 (and a state may span both): the snapshot's events
    cover the copies on the state's device, and a second device's tensors are copied
    at once."""
    from elastic_kit.snapshot._staging import storage_keys

    on1, on0 = _doubled_late(torch.ones(1 << 24, device="cuda:1"),
                             torch.ones(1 << 20, device="cuda:0"))
    staged = StagingBuffers().stage({"a": on1, "b": on0, "c": on1 * 1})
    assert staged.device == torch.device("cuda", 1)
    staged.copy_deferred()                     # the writer's wait
    for k in "abc":
        got = staged.state[k]
        assert torch.equal(got, torch.full_like(got, 2.0)), k
    deferred = StagingBuffers().stage({"a": on1, "b": on0}, later=storage_keys([on1, on0]))
    deferred.wait_staged()
    deferred.copy_deferred()
    assert all(torch.equal(v, torch.full_like(v, 2.0)) for v in deferred.state.values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_non_blocking_save_of_a_state_off_the_current_device_is_whole(
        tmp_path: Path) -> None:
    """The durable non-blocking save's pinned copies and its deferred copies wait for
    the work queued on the state's device, not on the current one."""
    w, p = _doubled_late(torch.ones(1 << 24, device="cuda:1"),
                         torch.ones(1 << 22, device="cuda:1"))
    with ek.CheckpointStore(str(tmp_path / "ck"), info=ek.DistInfo()) as store:
        handle = store.save({"w": w, "p": p}, step=1, blocking=False, copy_later=[p])
        handle.staged.result(60)
        p.fill_(3.0)                           # the optimizer step, after staging
        handle.wait(60)
        loaded = store.load(map_location="cpu")
    assert loaded is not None
    for k in "wp":
        got = loaded.state[k]
        assert torch.equal(got, torch.full_like(got, 2.0)), k
