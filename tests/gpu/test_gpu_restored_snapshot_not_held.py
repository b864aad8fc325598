"""GPU: after Checkpointer.restore() from a memory snapshot, nothing of the snapshot
file stays mapped (docs/snapshots.md promises it), with CUDA parameters and a plain
Adam too (not fused, not capturable: torch keeps its CPU ``step`` tensors as given in
load_state_dict, which held the whole file for the rest of the run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import elastic_kit as ek

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@pytest.fixture()
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_DIR", str(root))
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_NODE", "node0")
    return str(root)


def _run(root: Path, seed: int, device: str) -> tuple[ek.TrainState, ek.Checkpointer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)  # foreach, step on the CPU
    state = ek.TrainState(model, opt)
    return state, ek.Checkpointer(state, str(root), handle_signals=False, snapshot_every=1,
                                  info=ek.DistInfo())


def _mapped_snapshot_files() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if "tensors.bin" in line]


def test_adam_step_does_not_hold_the_restored_file(shm: str, tmp_path: Path) -> None:
    device = "cuda"
    state, ckpt = _run(tmp_path / "ck", seed=0, device=device)
    ckpt.restore()
    for _ in range(3):
        state.model(torch.randn(4, 64, device=device)).square().mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        ckpt.step(4)
    assert ckpt.snapshots is not None and ckpt.snapshots.wait(timeout=60)
    ckpt.abandon()

    state, ckpt = _run(tmp_path / "ck", seed=1, device=device)
    try:
        ckpt.restore()
        assert ckpt.restored_from == "memory"
        assert _mapped_snapshot_files() == []
    finally:
        ckpt.close()
