"""A background save that failed on the writer rank is named on every rank: the other
ranks said the save being started failed ("saving checkpoint step 6 ... failed on the
writer rank (see its log)") when it was the step before it, whose file and error only
the writer's log held."""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.testing import FaultFileSystem, spawn_multi_process
from tests.log_lines import LogLines

pytestmark = pytest.mark.timeout(180)


def _run(url: str) -> dict[str, Any]:
    info = ek.init_distributed()
    said = LogLines(logging.ERROR)
    logging.getLogger("elastic_kit").addHandler(said)
    store: Any = url
    if info.rank == 0:
        ffs = FaultFileSystem(fsspec.filesystem("file"))
        ffs.add("open", match="step-000000000003", mode="wb",
                error=OSError(errno.EDQUOT, "Disk quota exceeded", "step-000000000003/x"))
        store = ek.CheckpointStore(url, filesystem=ffs)
    model = ek.wrap_ddp(nn.Linear(2, 2))
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = ek.Checkpointer(state, store, every_steps=3, snapshot_every=0,
                           handle_signals=False, heartbeat_timeout=0)
    ckpt.restore()
    try:
        for _ in range(6):
            ckpt.step(1)
    except Exception as e:
        ckpt.abandon()
        return {"step": state.step, "error": f"{type(e).__name__}: {e}", "said": said.lines}
    ckpt.close()
    return {"step": state.step}


def test_every_rank_names_the_failed_background_save(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    out = spawn_multi_process(2, _run, url)
    assert [o["step"] for o in out] == [6, 6]
    assert "Disk quota exceeded" in out[0]["error"], out[0]
    # the other rank: the step being saved, and the writer's own error (the earlier step)
    assert out[1]["error"].startswith(f"CheckpointError: saving checkpoint step 6 to {url} "
                                      "failed on rank 0: "), out[1]
    assert "Disk quota exceeded" in out[1]["error"] and "step-000000000003" in out[1]["error"]
    # the writer's log names the file too (an OSError's repr leaves its filename out)
    assert any("step 3" in line and "step-000000000003/x" in line for line in out[0]["said"]), \
        out[0]["said"]
