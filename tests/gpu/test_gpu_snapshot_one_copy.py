"""CUDA snapshots go straight into the snapshot file: its mapping is registered as
pinned memory once per file, the device-to-host copies land in it (no staging
buffer, no second copy), and a restore copies back to the device through a few
reused pinned buffers.

Skipped without CUDA; run by ``scripts/gpu-check``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest
import torch

import elastic_kit as ek
from elastic_kit.snapshot import SnapshotTier
from elastic_kit.snapshot._to_device import copy_to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@pytest.fixture()
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A snapshot root in /dev/shm, as in use: Linux refuses to pin a shared mapping
    of a file on a disk's file system for long (CUDA's host registration), and
    pytest's temporary directory may be on one."""
    root = tempfile.mkdtemp(prefix="ek-gpu-test-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                            else str(tmp_path))
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_DIR", root)
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_NODE", "node0")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _cuda_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(1 << 18, generator=g).cuda() for i in range(4)}


def test_cuda_snapshots_are_copied_into_registered_files_and_restored_to_the_device(
        shm: str) -> None:
    tier = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    inodes = []
    for step in range(1, 5):
        state = _cuda_state(step)
        tier.save(state, step=step, metadata={})
        assert tier.wait(timeout=60)
        inodes.append(os.stat(Path(tier.node_dir, f"step-{step:012d}", "tensors.bin")).st_ino)
    slots = tier._slots
    assert slots is not None and slots.pin and slots.made == 2
    assert all(s.registered for s in slots._slots)      # pinned once per file
    assert len(set(inodes)) == 2
    tier.close(remove=False)
    again = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    loaded = again.load(map_location="cuda")
    assert loaded is not None and loaded.step == 4
    for k, v in state.items():
        assert loaded.state[k].device.type == "cuda" and torch.equal(loaded.state[k], v), k
    again.close(remove=True)


def test_a_cuda_snapshot_copied_later_lands_in_the_file_before_the_optimizer_step(
        shm: str) -> None:
    """Parameters deferred to the writer thread are copied (stream-ordered after
    the snapshot was taken) straight into the file's registered pages."""
    tier = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    live = torch.full((1 << 26,), 1.0, device="cuda")   # 256 MiB: the copy takes a while
    tier.save({"w": live}, step=1, metadata={})          # makes the files
    assert tier.wait(timeout=60)
    live.fill_(2.0)
    tier.save({"w": live}, step=2, metadata={}, copy_later=[live])
    tier.wait_staged()                                   # the optimizer-step pre-hook
    live.fill_(3.0)                                      # the update after it
    assert tier.wait(timeout=60)
    loaded = tier.load()
    assert loaded is not None and loaded.step == 2
    assert torch.equal(loaded.state["w"], torch.full((1 << 26,), 2.0))
    tier.close(remove=True)


def test_a_restore_through_small_windows_reuses_its_buffers_and_lands_whole() -> None:
    """Many windows through two buffers: a buffer is refilled only after the copy
    out of it finished, so every tensor lands whole, and the current stream sees it."""
    mapped = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    state = {f"t{i}": mapped[i << 20:(i + 1) << 20].view(torch.float32) for i in range(3)}
    phases: dict[str, float] = {}
    out = copy_to_device(mapped, state, torch.device("cuda"), phases,
                         window_bytes=100_000, windows=2)
    sums = {k: v.view(torch.int32).sum().item() for k, v in out.items()}  # the current stream
    for k, v in state.items():
        assert out[k].is_cuda and sums[k] == v.view(torch.int32).sum().item(), k
        assert torch.equal(out[k].cpu().view(torch.uint8), v.view(torch.uint8)), k
    assert phases["bytes"] == 3 << 20


def _mixed_state(seed: int) -> dict[str, Any]:
    """CUDA tensors of several dtypes, a non-contiguous one, an empty one, and CPU
    tensors between them (a generator's state), as a training state has."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(512, 256, generator=g).cuda(),
                  "n": torch.arange(7).cuda(),
                  "h": torch.rand(999, generator=g).to(torch.bfloat16).cuda()},
        "rng": torch.get_rng_state(),
        "optim": {"m": torch.randn(64, 32, generator=g).cuda().t(),
                  "e": torch.empty(0, 4, device="cuda"),
                  "step": torch.tensor(float(seed))},
        "big": torch.randn(1 << 22, generator=g).cuda(),
    }


def _cpu_copy(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _cpu_copy(v) for k, v in state.items()}
    return state.cpu().clone() if isinstance(state, torch.Tensor) else state


def _assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, dict):
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
        return
    assert got.dtype == want.dtype and torch.equal(got.cpu(), want), path


def test_cuda_snapshots_go_through_the_devices_mirror_in_a_few_copies(shm: str) -> None:
    """Once a registered file waits, the CUDA tensors go into the device's mirror on
    the training stream (so what is queued after the snapshot cannot change them)
    and on to the file in one copy per run; nothing waits before the optimizer step."""
    tier = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    for step in range(1, 5):
        live = _mixed_state(step)
        want = _cpu_copy(live)
        later = [live["model"]["w"], live["optim"]["m"], live["big"]]
        tier.save(live, step=step, metadata={}, copy_later=later)
        if step == 1:
            # no file yet: staged, the tensors to copy later on a side stream, which
            # may read them until wait_staged (copy_later's contract)
            tier.wait_staged()
        for t in later + [live["model"]["n"]]:
            t.add_(1)                              # queued right after: not in the snapshot
        tier.wait_staged()
        assert tier.wait(timeout=60)
        loaded = tier.load()
        assert loaded is not None and loaded.step == step
        _assert_same(loaded.state, want)
    assert tier.direct == 3 and tier.mirror.nbytes > 0
    assert len(tier.mirror_copy_s) >= 2 and all(0 <= s < 1 for s in tier.mirror_copy_s)
    assert not tier.write_cpu_costs                # a GPU host's write leaves training alone
    tier.close(remove=True)


def test_without_room_for_the_mirror_snapshots_are_staged_as_before(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_RELAY_MAX_BYTES", "4096")
    tier = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    for step in range(1, 4):
        live = _mixed_state(step)
        want = _cpu_copy(live)
        tier.save(live, step=step, metadata={}, copy_later=[live["big"]])
        tier.wait_staged()
        live["big"].add_(1)
        assert tier.wait(timeout=60)
        loaded = tier.load()
        assert loaded is not None
        _assert_same(loaded.state, want)
    assert tier.direct == 2 and tier.mirror.nbytes == 0 and not tier.mirror_copy_s
    tier.close(remove=True)


def test_a_large_cuda_states_first_snapshot_waits_for_its_registered_file(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No pinned staging buffer is allocated on the training thread: the first
    snapshot is skipped while the writer makes and registers the file, and the next
    one goes straight into it (through the mirror)."""
    import elastic_kit.snapshot._tier as tier_module

    monkeypatch.setattr(tier_module, "PINNED_STAGING_MAX_BYTES", 1 << 20)  # 4 MB is large
    tier = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    tier.save(_cuda_state(1), step=1, metadata={}, periodic=True)
    assert tier.wait(timeout=60)
    slots = tier._slots
    assert tier.skipped == [1] and tier.written == [] and slots is not None
    assert slots.made == 1 and all(s.registered for s in slots._slots)
    for step in (2, 3):
        state = _cuda_state(step)
        tier.save(state, step=step, metadata={}, periodic=True)
        assert tier.wait(timeout=60)
    assert tier.written == [2, 3] and tier.direct == 2 and tier.skipped == [1]
    assert tier._writer._sets[0].nbytes == 0           # no staging buffer, pinned or not
    loaded = tier.load(map_location="cuda")
    assert loaded is not None and loaded.step == 3
    for k, v in state.items():
        assert torch.equal(loaded.state[k], v), k
    tier.close(remove=True)


def test_a_large_cuda_snapshot_due_while_one_is_written_is_skipped_not_staged(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import elastic_kit.snapshot._tier as tier_module

    monkeypatch.setattr(tier_module, "PINNED_STAGING_MAX_BYTES", 1 << 20)
    tier = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    tier.save(_cuda_state(1), step=1, metadata={}, periodic=True)
    assert tier.wait(timeout=60)
    release = threading.Event()
    tier.save(_cuda_state(2), step=2, metadata={}, periodic=True,
              finish=lambda state: release.wait(30))
    tier.save(_cuda_state(3), step=3, metadata={}, periodic=True)  # step 2 is still being written
    release.set()
    assert tier.wait(timeout=60)
    assert tier.skipped == [1, 3] and tier.written == [2]
    assert tier._writer._sets[0].nbytes == 0 and len(tier._writer._sets) == 1
    state = _cuda_state(4)
    tier.save(state, step=4, metadata={}, periodic=True)
    assert tier.wait(timeout=60) and tier.written == [2, 4]
    loaded = tier.load(map_location="cuda")
    assert loaded is not None and loaded.step == 4
    for k, v in state.items():
        assert torch.equal(loaded.state[k], v), k
    tier.close(remove=True)


def test_a_restored_large_cuda_states_first_snapshot_goes_into_a_registered_file(
        shm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a restore the writer makes and registers the file before the first
    snapshot is due: that snapshot is neither skipped nor staged."""
    import elastic_kit.snapshot._tier as tier_module

    monkeypatch.setattr(tier_module, "PINNED_STAGING_MAX_BYTES", 1 << 20)  # 4 MB is large

    def run(seed: int) -> tuple[ek.Checkpointer, torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(1024, 1024).cuda()
        opt = torch.optim.AdamW(model.parameters())
        ckpt = ek.Checkpointer(ek.TrainState(model, opt), str(tmp_path / "durable"),
                               handle_signals=False, snapshot_every=1, info=ek.DistInfo())
        return ckpt, model, opt

    def train(ckpt: ek.Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step(8)

    first, model, opt = run(0)
    first.restore()
    for _ in range(3):
        train(first, model, opt)
    assert first.snapshots is not None and first.snapshots.wait(timeout=60)
    first.abandon()

    second, model, opt = run(1)
    second.restore(map_location="cuda")
    tier = second.snapshots
    assert second.restored_from == "memory" and tier is not None and tier.wait(timeout=60)
    slots = tier._slots
    assert slots is not None and slots.count == 1 and all(s.registered for s in slots._slots)
    train(second, model, opt)
    assert tier.wait(timeout=60)
    assert tier.skipped == [] and tier.written == [4] and tier.direct == 1
    assert tier._writer._sets[0].nbytes == 0
    loaded = tier.load(map_location="cuda")
    assert loaded is not None and torch.equal(loaded.state["model"]["weight"], model.weight)
    second.close()


def test_a_refused_registration_leaves_no_cuda_error_behind() -> None:
    """The CUDA runtime keeps a refused cudaHostRegister as the thread's last error,
    which the next kernel launch's check reads: a refusal (here, registering memory
    twice; in use, a snapshot file on a disk's file system) must not make an unrelated
    launch on the same thread fail."""
    from elastic_kit.snapshot._cuda_host import register, unregister

    buf = torch.empty(1 << 20, dtype=torch.uint8)
    assert register(buf.data_ptr(), buf.numel()) == (0, "")
    try:
        err, message = register(buf.data_ptr(), buf.numel())
        assert err != 0 and message, (err, message)
        x = torch.ones(4, device="cuda").add_(1)  # launches check the thread's last error
        torch.cuda.synchronize()
        assert x.tolist() == [2.0] * 4
    finally:
        assert unregister(buf.data_ptr()) == 0
