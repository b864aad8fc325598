"""A large device state's first snapshot: not staged in pinned buffers on the training
thread (a stall of seconds per restart on a GPU), but skipped while the writer thread
makes the snapshot file, into which the next one is copied straight. The CPU stands in
for the device here (``_pinned_staging`` widened, the limit lowered)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic_kit as ek
import elastic_kit.snapshot._tier as tier_module
from elastic_kit.snapshot import SnapshotTier
from elastic_kit.snapshot._writer import SnapshotWriter


@pytest.fixture()
def on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Floating-point tensors count as the device's; more than 64 KB of them is large."""
    monkeypatch.setattr(tier_module, "_pinned_staging", lambda t: t.is_floating_point())
    monkeypatch.setattr(tier_module, "PINNED_STAGING_MAX_BYTES", 64 << 10)


def _tier(shm: str) -> SnapshotTier:
    return SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)


def _state(seed: int, rows: int = 300) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(rows, 64, generator=g),
                      "b": torch.arange(5, dtype=torch.int64)},
            "step": seed}


def _loaded_w(tier: SnapshotTier) -> torch.Tensor:
    loaded = tier.load()
    assert loaded is not None
    return loaded.state["model"]["w"]


def test_the_first_snapshot_waits_for_its_file_instead_of_pinned_buffers(
        shm: str, on_device: None) -> None:
    tier = _tier(shm)
    tier.save(_state(1), step=1, metadata={}, periodic=True)
    assert tier.wait(timeout=60)              # the writer made the file meanwhile
    assert tier.skipped == [1] and tier.written == []
    assert tier._slots is not None and tier._slots.made == 1 and tier._slots.pin
    assert tier._writer._sets[0].nbytes == 0  # no staging buffer was ever allocated

    tier.save(_state(2), step=2, metadata={}, periodic=True)
    assert tier.wait(timeout=60)
    assert tier.written == [2] and tier.direct == 1 and tier.skipped == [1]
    assert torch.equal(_loaded_w(tier), _state(2)["model"]["w"])
    assert tier._writer._sets[0].nbytes == 0
    tier.close(remove=True)


def test_snapshots_due_while_the_file_is_made_are_skipped_and_it_is_made_once(
        shm: str, on_device: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _tier(shm)
    assert tier._slots is not None
    made, release = threading.Event(), threading.Event()
    prepare = tier._slots.prepare

    def slow_prepare(plan: Any) -> None:  # a large file: seconds of first touch
        made.set()
        release.wait(30)
        prepare(plan)

    monkeypatch.setattr(tier._slots, "prepare", slow_prepare)
    tier.save(_state(1), step=1, metadata={}, periodic=True)
    assert made.wait(30)
    for step in (2, 3):
        tier.save(_state(step), step=step, metadata={}, periodic=True)
    release.set()
    assert tier.wait(timeout=60)
    assert tier.skipped == [1, 2, 3] and tier._slots.made == 1
    tier.save(_state(4), step=4, metadata={}, periodic=True)
    assert tier.wait(timeout=60) and tier.written == [4] and tier.direct == 1
    tier.close(remove=True)


def test_a_snapshot_due_while_the_previous_one_is_written_is_skipped_not_staged(
        shm: str, on_device: None) -> None:
    tier = _tier(shm)
    tier.save(_state(1), step=1, metadata={}, periodic=True)       # skipped: the first file is made
    assert tier.wait(timeout=60)
    release = threading.Event()
    tier.save(_state(2), step=2, metadata={}, periodic=True,
              finish=lambda state: release.wait(30))
    tier.save(_state(3), step=3, metadata={}, periodic=True)       # step 2 is still being written
    release.set()
    assert tier.wait(timeout=60)
    assert tier.skipped == [1, 3] and tier.written == [2] and tier.replaced == []
    assert tier._writer._sets[0].nbytes == 0 and len(tier._writer._sets) == 1
    tier.save(_state(4), step=4, metadata={}, periodic=True)       # the next one due after the commit
    assert tier.wait(timeout=60)
    assert tier.written == [2, 4] and tier.direct == 2
    assert torch.equal(_loaded_w(tier), _state(4)["model"]["w"])
    tier.close(remove=True)


def test_a_small_device_state_or_a_cpu_state_is_staged_at_once(
        shm: str, on_device: None) -> None:
    tier = _tier(shm)
    tier.save(_state(1, rows=100), step=1, metadata={}, periodic=True)  # 25 KB: under the limit
    assert tier.wait(timeout=60) and tier.written == [1] and tier.skipped == []
    tier.close(remove=True)

    other = SnapshotTier("/durable2", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    state = {"model": {"i": torch.arange(100_000, dtype=torch.int64)}}  # no device tensor
    other.save(state, step=1, metadata={}, periodic=True)
    assert other.wait(timeout=60) and other.written == [1] and other.skipped == []
    other.close(remove=True)


def test_an_explicit_snapshot_is_always_taken(shm: str, on_device: None) -> None:
    # ckpt.snapshot(), or a leaving node's: staged as before, whatever it costs
    tier = _tier(shm)
    tier.save(_state(1), step=1, metadata={})
    assert tier.wait(timeout=60) and tier.written == [1] and tier.skipped == []
    tier.close(remove=True)


def test_the_last_snapshot_of_a_failing_rank_is_never_skipped(
        shm: str, on_device: None) -> None:
    tier = _tier(shm)
    tier.save(_state(1), step=1, metadata={}, periodic=True, last=True)
    assert tier.wait(timeout=60) and tier.written == [1] and tier.skipped == []
    assert torch.equal(_loaded_w(tier), _state(1)["model"]["w"])
    tier.close(remove=True)


def test_a_state_that_grows_past_its_file_gets_a_new_one_as_it_did(
        shm: str, on_device: None) -> None:
    # files exist: a snapshot of another layout is staged as before (not skipped)
    tier = _tier(shm)
    for step in (1, 2):
        tier.save(_state(step), step=step, metadata={}, periodic=True)
        assert tier.wait(timeout=60)
    tier.save(_state(3, rows=400), step=3, metadata={}, periodic=True)
    assert tier.wait(timeout=60)
    assert tier.skipped == [1] and tier.written == [2, 3]
    assert torch.equal(_loaded_w(tier), _state(3, rows=400)["model"]["w"])
    tier.close(remove=True)


def test_the_writer_runs_preparations_keeps_their_error_and_close_drops_a_pending_one(
) -> None:
    ran: list[str] = []
    writer = SnapshotWriter(lambda job: None)
    started, gate = threading.Event(), threading.Event()
    writer.prepare(lambda: (started.set(), gate.wait(30), ran.append("first")))
    assert started.wait(30)
    writer.prepare(lambda: ran.append("replaced"))  # pending: the newer one replaces it
    writer.prepare(lambda: ran.append("second"))
    gate.set()
    assert writer.wait(timeout=30) and ran == ["first", "second"]

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.prepare(fail)
    assert writer.wait(timeout=30)
    err = writer.take_error()
    assert isinstance(err, OSError) and err.errno == 28

    started.clear()
    gate.clear()
    writer.prepare(lambda: (started.set(), gate.wait(30)))
    assert started.wait(30)
    writer.prepare(lambda: ran.append("dropped"))
    closer = threading.Thread(target=writer.close)
    closer.start()
    while writer._task is not None:  # close() drops it before it joins the thread
        closer.join(0.01)
    gate.set()
    closer.join(30)
    assert not closer.is_alive() and ran == ["first", "second"]


def _checkpointer(tmp_path: Path, name: str) -> tuple[ek.Checkpointer, torch.optim.Optimizer]:
    model = torch.nn.Linear(128, 128)              # 66 KB of parameters: "large"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = ek.Checkpointer(ek.TrainState(model, opt), str(tmp_path / name),
                           handle_signals=False, snapshot_every=1, info=ek.DistInfo())
    ckpt.restore()
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    return ckpt, opt


def test_the_checkpointers_periodic_snapshots_may_be_skipped_its_explicit_ones_not(
        shm: str, on_device: None, tmp_path: Path) -> None:
    periodic, _ = _checkpointer(tmp_path, "a")
    periodic.step(1)                               # due by the interval: no file yet
    tier = periodic.snapshots
    assert tier is not None and tier.wait(timeout=60)
    assert tier.skipped == [1] and tier.written == []
    periodic.close()

    explicit, _ = _checkpointer(tmp_path, "b")
    explicit.snapshot()                            # asked for: taken, whatever it costs
    tier = explicit.snapshots
    assert tier is not None and tier.wait(timeout=60)
    assert tier.skipped == [] and tier.written == [0]
    explicit.close()
