"""A restore's choice between memory and the durable store is made alike on every
rank, faults included: a newest durable checkpoint that does not verify gives way to a
newer snapshot on every rank, and a writer that cannot list the store fails every
rank's restore at once (instead of leaving the others in the next collective)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

import elastic_kit as ek
from elastic_kit.testing import spawn_multi_process
from tests.train_script import TrainConfig, train

N = 48      # 6 steps per epoch of 2 ranks x 4 samples


def _life(url: str, shm: str, stop_after: int | None) -> TrainConfig:
    """Durable saves every 4 steps, snapshots every 3, none at an epoch's end."""
    return TrainConfig(url=url, dataset_size=N, target="x0", data_seed=5, sampler_seed=2,
                       epochs=2, batch_size=4,
                       checkpoint={"every_steps": 4, "blocking": True, "audit": True,
                                   "snapshot_every": 3, "save_at_epoch_end": False},
                       stop_after=stop_after, stop_how="kill", snapshot_dir=shm)


def test_a_corrupt_newest_durable_checkpoint_gives_way_to_a_newer_snapshot_on_every_rank(
        tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    reference = spawn_multi_process(2, train, _life(str(tmp_path / "ref"), str(shm), None))
    url = str(tmp_path / "run")
    assert spawn_multi_process(2, train, _life(url, str(shm), 8)) == [{"crashed_at": 8}] * 2
    assert [i.step for i in ek.CheckpointStore(url).list()] == [4, 8]
    payload = Path(url, "step-000000000008", "state.pt")        # durable 8: corrupt
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    out = spawn_multi_process(2, train, _life(url, str(shm), None))
    for rank in (0, 1):
        history = out[rank]["history"]
        assert [(h["restored_step"], h["restored_from"]) for h in history] == [
            (None, None), (6, "memory")]                         # not durable step 4
        assert out[rank]["step"] == reference[rank]["step"] == 12
        for a, b in zip(out[rank]["params"], reference[rank]["params"]):
            np.testing.assert_array_equal(a, b)
        assert out[rank]["audit"] == [(0, N, True), (1, N, True)]


def _restore_with_a_failing_list(url: str, shm: str) -> tuple[str, str]:
    """Rank 0's store cannot be listed (its retries spent); each rank's error."""
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    info = ek.init_distributed()
    model = torch.nn.Linear(2, 2)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = ek.Checkpointer(state, url, snapshot_every=3, handle_signals=False,
                           heartbeat_timeout=0, handle_preemption=False)
    if info.rank == 0:
        def unreadable() -> list[Any]:
            raise ek.CheckpointError("503 Service Unavailable after 3 attempts")
        ckpt.store.list = unreadable  # type: ignore[union-attr, method-assign]
    try:
        ckpt.restore()
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        ckpt.abandon()
    return "restored", ""


def test_a_writer_that_cannot_list_the_store_fails_every_ranks_restore(
        tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    url = str(tmp_path / "run")
    out = spawn_multi_process(2, _restore_with_a_failing_list, url, str(shm), timeout=60)
    assert out[0] == ("CheckpointError", "503 Service Unavailable after 3 attempts")
    assert out[1][0] == "CheckpointError"
    assert out[1][1] == (f"rank 0 could not list the checkpoint store {url} (see its log); "
                         "nothing was restored")
