"""After a restore, the writer makes the snapshot file before the first snapshot is due,
so that snapshot (the first to protect the restored steps) is copied straight into it:
neither staged in buffers allocated on the training thread nor, for a large device
state, skipped while the file is made. The CPU stands in for the device where a test
says so (``_pinned_staging`` widened, the limit lowered)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic_kit as ek
import elastic_kit.snapshot._tier as tier_module
from elastic_kit.snapshot import SnapshotTier


@pytest.fixture()
def on_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Floating-point tensors count as the device's; more than 64 KB of them is large."""
    monkeypatch.setattr(tier_module, "_pinned_staging", lambda t: t.is_floating_point())
    monkeypatch.setattr(tier_module, "PINNED_STAGING_MAX_BYTES", 64 << 10)


class _Run:
    """A model (66 KB of parameters), its SGD with momentum and a checkpointer taking a
    snapshot every step."""

    def __init__(self, root: Path, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(128, 128)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.ckpt = ek.Checkpointer(ek.TrainState(self.model, self.opt), str(root),
                                    handle_signals=False, snapshot_every=1,
                                    info=ek.DistInfo())

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.model(torch.randn(4, 128)).square().mean().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.ckpt.step(4)

    @property
    def tier(self) -> SnapshotTier:
        tier = self.ckpt.snapshots
        assert tier is not None and tier.enabled
        return tier


def _killed_run(root: Path) -> dict[str, torch.Tensor]:
    """A run that took snapshots and ended as a failing worker does (its snapshots
    stay); its last state."""
    first = _Run(root, seed=0)
    first.ckpt.restore()
    first.train(3)
    assert first.tier.wait(timeout=60)
    weights = {"w": first.model.weight.detach().clone(),
               "m": first.opt.state[first.model.weight]["momentum_buffer"].clone()}
    first.ckpt.abandon()
    return weights


def _step_file(tier: SnapshotTier, step: int) -> Path:
    return Path(tier.write_dir) / f"step-{step:012d}" / "tensors.bin"


def _restored(root: Path) -> _Run:
    run = _Run(root, seed=1)
    run.ckpt.restore()
    assert run.ckpt.restored_from == "memory" and run.ckpt.restored_step == 3
    return run


def test_the_first_snapshot_after_a_restore_goes_straight_into_a_file_made_before(
        shm: str, tmp_path: Path) -> None:
    before = _killed_run(tmp_path / "durable")
    run = _restored(tmp_path / "durable")
    tier = run.tier
    assert torch.equal(run.model.weight.detach(), before["w"])
    assert tier.wait(timeout=60)                   # the file was made meanwhile
    assert tier._slots is not None and tier._slots.count == 1 and tier._slots.made == 1

    restored_file = os.stat(_step_file(tier, 3)).st_ino

    run.train(1)                                   # the first snapshot after the restore
    assert tier.wait(timeout=60)
    assert tier.written == [4] and tier.direct == 1
    assert tier._writer._sets[0].nbytes == 0       # no staging buffer was ever allocated
    loaded = tier.load()
    assert loaded is not None and loaded.step == 4
    assert torch.equal(loaded.state["model"]["weight"], run.model.weight.detach())
    del loaded
    # the restored snapshot's file, no longer mapped, is the next snapshot's
    assert not _step_file(tier, 3).parent.exists()
    assert [s.reused for s in tier._slots._slots] == [False, True]
    assert tier._slots._slots[1].inode == restored_file and tier._slots.made == 2
    for _ in range(2):
        run.train(1)
        assert tier.wait(timeout=60)
    assert tier.written == [4, 5, 6] and tier.direct == 3
    loaded = tier.load()
    assert loaded is not None and loaded.step == 6
    assert torch.equal(loaded.state["model"]["weight"], run.model.weight.detach())
    run.ckpt.close()


def test_a_restored_file_still_viewed_by_a_tensor_is_deleted_not_reused(
        shm: str, tmp_path: Path) -> None:
    """A restored tensor on the CPU is a view of the snapshot file's copy-on-write
    mapping, whose pages read the file until written: writing the file would change
    the tensor. A file this process still maps is never taken over."""
    _killed_run(tmp_path / "durable")
    run = _restored(tmp_path / "durable")
    tier = run.tier
    held = tier.load()                             # views of step 3's file, kept
    assert held is not None and held.step == 3
    kept = held.state["model"]["weight"]
    value = kept.clone()
    restored_file = os.stat(_step_file(tier, 3)).st_ino
    for _ in range(3):
        run.train(1)
        assert tier.wait(timeout=60)
    assert tier.written == [4, 5, 6]
    assert restored_file not in {s.inode for s in tier._slots._slots}
    assert not any(s.reused for s in tier._slots._slots)
    assert torch.equal(kept, value)                # the view still reads what was restored
    run.ckpt.close()


def test_a_large_device_states_first_snapshot_after_a_restore_is_not_skipped(
        shm: str, tmp_path: Path, on_device: None) -> None:
    _killed_run(tmp_path / "durable")
    run = _restored(tmp_path / "durable")
    assert run.tier.wait(timeout=60)
    assert run.tier._slots is not None and run.tier._slots.pin  # registered on CUDA

    run.train(1)
    assert run.tier.wait(timeout=60)
    assert run.tier.skipped == [] and run.tier.written == [4] and run.tier.direct == 1
    run.ckpt.close()


def test_a_new_run_prepares_no_file_its_optimizer_state_does_not_exist_yet(
        shm: str, tmp_path: Path) -> None:
    run = _Run(tmp_path / "durable", seed=0)
    run.ckpt.restore()
    assert run.ckpt.restored_step is None or run.ckpt.restored_from is None
    assert run.tier.wait(timeout=60)
    assert run.tier._slots is not None and run.tier._slots.count == 0
    run.ckpt.close()


def test_a_prepared_file_of_another_layout_is_replaced_and_the_snapshot_is_right(
        shm: str) -> None:
    tier = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    assert tier.prepare({"model": {"w": torch.zeros(10, 10)}}) is True
    assert tier.wait(timeout=60) and tier._slots is not None and tier._slots.count == 1
    assert tier.prepare({"model": {"w": torch.zeros(10, 10)}}) is False  # one file is there

    state: dict[str, Any] = {"model": {"w": torch.randn(20, 5), "b": torch.arange(3)}}
    tier.save(state, step=1, metadata={})
    assert tier.wait(timeout=60)
    # the unfit file was replaced by one for this snapshot; the third is the next one's
    assert tier.written == [1] and tier.direct == 0 and tier._slots.made == 3
    loaded = tier.load()
    assert loaded is not None
    assert torch.equal(loaded.state["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded.state["model"]["b"], state["model"]["b"])
    tier.close(remove=True)


def test_no_file_is_prepared_where_two_snapshots_do_not_fit(
        shm: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A file mapped on a full tmpfs kills the process that touches its pages (SIGBUS):
    the free space is checked before any file is made, as before the first snapshot."""
    tier = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    real = shutil.disk_usage
    monkeypatch.setattr(tier_module.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))
    with caplog.at_level("WARNING", logger=tier_module.__name__):
        assert tier.prepare({"model": {"w": torch.zeros(100, 100)}}) is False
    assert tier.wait(timeout=60)
    assert not tier.enabled and tier._slots is not None and tier._slots.made == 0
    assert "need" in caplog.text
    tier.close(remove=True)


# -- a killed worker's free snapshot file is the restarted writer's next one

DEAD_PID = 2**22 + 7  # above Linux's largest pid (pid_max <= 2**22): never alive


def _tier(shm: str) -> SnapshotTier:
    return SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)


def _node_dir(shm: str) -> Path:
    """The node's snapshot directory, made (private) by a tier that is then closed."""
    tier = _tier(shm)
    path = Path(tier.write_dir)
    tier.close(remove=False)
    return path


def _dead_slot(node: Path, tag: str, size: int) -> Path:
    path = node / f".slot-{DEAD_PID}-{tag}-1"
    path.write_bytes(b"\xab" * size)
    path.chmod(0o600)
    return path


def test_a_dead_workers_free_file_becomes_the_restarted_writers_first_slot(shm: str) -> None:
    node = _node_dir(shm)
    dead = _dead_slot(node, "aaaa0000", 300 * 1024)
    inode = dead.stat().st_ino
    tier = _tier(shm)                              # the restarted worker's
    assert not dead.exists()                       # claimed under a name of its own

    state: dict[str, Any] = {"model": {"w": torch.randn(200, 256), "b": torch.arange(3)}}
    assert tier.prepare(state) and tier.wait(timeout=60)
    assert tier._slots is not None and tier._slots.count == 1
    slot = tier._slots._slots[0]
    assert slot.reused and slot.inode == inode     # the same file, not a new one
    assert os.stat(slot.path).st_size == slot.plan.size

    tier.save(state, step=1, metadata={})
    assert tier.wait(timeout=60) and tier.written == [1] and tier.direct == 1
    loaded = tier.load()                           # its old bytes were all overwritten
    assert loaded is not None
    assert torch.equal(loaded.state["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded.state["model"]["b"], state["model"]["b"])
    tier.close(remove=True)


def test_only_plain_files_are_claimed_live_writers_keep_theirs_and_extras_go(
        shm: str, tmp_path: Path) -> None:
    node = _node_dir(shm)
    outside = tmp_path / "not-a-slot"
    outside.write_bytes(b"keep me")
    (node / f".slot-{DEAD_PID}-bbbb0000-1").symlink_to(outside)
    linked = tmp_path / "other-name"
    hard = node / f".slot-{DEAD_PID}-cccc0000-1"
    hard.write_bytes(b"x" * 4096)
    os.link(hard, linked)                          # two names: not this writer's alone
    live = node / f".slot-{os.getpid()}-dddd0000-1"
    live.write_bytes(b"y" * 4096)                  # a live process's: another tier's
    for tag in ("eeee0000", "ffff0000", "gggg0000"):
        _dead_slot(node, tag, 4096)                # plain files, one more than usable

    tier = _tier(shm)
    slots = tier._slots
    assert slots is not None and len(slots._spares) == slots.max_slots == 2
    assert outside.read_bytes() == b"keep me"      # a link is removed, never followed
    assert linked.read_bytes() == b"x" * 4096      # the other name of the file is intact
    assert live.exists()
    names = sorted(p.name for p in node.iterdir() if p.name.startswith(".slot-"))
    assert names == sorted([live.name, *(Path(p).name for p in slots._spares)])
    assert slots.spare_bytes == 2 * 4096

    tier.close(remove=False)                       # claimed files not reused are removed
    assert sorted(p.name for p in node.iterdir() if p.name.startswith(".slot-")) == [live.name]
    live.unlink()


def test_the_space_check_counts_the_claimed_files_as_room(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    node = _node_dir(shm)
    state = {"model": {"w": torch.zeros(256, 256)}}          # 256 KiB
    _dead_slot(node, "aaaa0000", 256 * 1024 + 4096)
    tier = _tier(shm)
    real = shutil.disk_usage
    need = int(tier_module.SPACE_FACTOR * 256 * 1024)
    monkeypatch.setattr(tier_module.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=need - 256 * 1024))
    assert tier.prepare(state) and tier.wait(timeout=60) and tier.enabled
    tier.close(remove=True)


def test_the_commit_latency_ends_at_the_commit_not_after_the_cleanup_that_follows(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What follows a commit on the writer thread (deleting the older snapshot, which
    for a restored run's first snapshot is a state's size of pages to free, and making
    the next file) does not delay the snapshot being restorable: the commit latency
    reported stops at the manifest."""
    import time

    tier = _tier(shm)
    release_started: list[float] = []
    release = tier._release_older

    def slow_release(step: int) -> None:
        release_started.append(time.perf_counter())
        time.sleep(0.05)
        release(step)

    monkeypatch.setattr(tier, "_release_older", slow_release)
    taken = time.perf_counter()
    tier.save({"model": {"w": torch.randn(64, 64)}}, step=1, metadata={}, started=taken)
    assert tier.wait(timeout=60) and tier.written == [1]
    assert len(release_started) == 1
    assert 0 < tier.commit_latency_s <= release_started[0] - taken
    tier.close(remove=True)
