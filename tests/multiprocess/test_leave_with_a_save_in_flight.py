"""A planned leave while a durable save is being written: the leaving node goes once
the step is in the staying nodes' memory, without waiting for another node's upload.

A cloud gives a preempted node 30 s (GCE) or less; a non-blocking checkpoint's upload
to an object store can take longer. The leave's close waited, on every rank, for the
writer rank's upload (its barrier came after the store's wait), so a leaving node
stayed as long as a staying node's upload took, and past its notice it was killed
with the step not yet streamed. Here the writer's upload is held until the leaving
rank has gone: before, the two waited for each other until the hold gave up.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.testing import FaultFileSystem, spawn_multi_process
from tests.log_lines import LogLines

pytestmark = pytest.mark.timeout(240)

N = 400
BATCH = 4        # per rank: 50 steps an epoch over two ranks
SAVED_AT = 4     # the non-blocking durable save held until the leaving rank is gone
NOTICE_AT = 6    # rank 1 (node 1) is told it will go
HOLD_S = 60.0    # the most the upload is held (it then goes on, and the test fails)


def _hold_until_left(marks: Path) -> None:
    """The writer's upload of step SAVED_AT waits for rank 1's exit (at most HOLD_S)."""
    deadline = time.monotonic() + HOLD_S
    while not (marks / "left").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    (marks / "upload").write_text("after the leave" if (marks / "left").exists()
                                  else "held until it gave up")


def _run(url: str, shm: str, marks_dir: str, snapshot_every: int = 1000) -> dict[str, Any]:
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{os.environ['GROUP_RANK']}"
    os.environ["TORCHELASTIC_MAX_RESTARTS"] = "3"  # the staying node is restarted
    marks = Path(marks_dir)
    said = LogLines(logging.INFO)
    logging.getLogger("elastic_kit").addHandler(said)
    logging.getLogger("elastic_kit").setLevel(logging.INFO)
    torch.set_num_threads(1)
    info = ek.init_distributed()
    store: Any = url
    if info.rank == 0:
        ffs = FaultFileSystem(fsspec.filesystem("file"))
        ffs.add("open", match=f"step-{SAVED_AT:012d}", mode="wb", times=1,
                before=lambda _: _hold_until_left(marks))
        store = ek.CheckpointStore(url, filesystem=ffs)
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    sampler = ek.ElasticDistributedSampler(torch.utils.data.TensorDataset(xs, ys), seed=3)
    state = ek.TrainState(model, opt, sampler=sampler)
    ckpt = ek.Checkpointer(state, store, every_steps=1000, snapshot_every=snapshot_every)
    try:
        ckpt.restore()
        sampler.set_epoch(0)
        order = list(sampler)
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            loss = nn.functional.mse_loss(model(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(len(idx))
            time.sleep(0.01)
            if state.step == SAVED_AT:
                ckpt.save(blocking=False)
            if state.step == NOTICE_AT and info.rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
        ckpt.close()
    except SystemExit as e:
        if info.rank == 1:
            (marks / "left").write_text(str(state.step))
        return {"left_at": state.step, "code": e.code,
                "said": [line for line in said.lines if "leave at step" in line]}
    return {"left_at": None}


def test_the_leaving_node_does_not_wait_for_a_staying_writers_upload(tmp_path: Path) -> None:
    url, shm, marks = str(tmp_path / "run"), tmp_path / "shm", tmp_path / "marks"
    shm.mkdir(), marks.mkdir()
    out = spawn_multi_process(2, _run, url, str(shm), str(marks), local_world_size=1,
                              timeout=180)
    step = out[0]["left_at"]
    assert step is not None and step > NOTICE_AT, out
    # no agent above these ranks to stop: the leaving rank fails, as documented
    assert [(o["left_at"], o["code"]) for o in out] == [(step, 143)] * 2
    assert "the state is in memory on the nodes that stay" in out[0]["said"][0]
    assert (marks / "upload").read_text() == "after the leave"
    # the staying writer's upload still committed before its rank exited
    assert ek.CheckpointStore(url).latest_step() == SAVED_AT
    rest = spawn_multi_process(2, _restored, url, str(shm), local_world_size=1)
    assert rest == [(step, "memory")] * 2  # the leave's step, from the nodes' memory


def _restored(url: str, shm: str) -> tuple[int | None, str | None]:
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{os.environ['GROUP_RANK']}"
    ek.init_distributed()
    model = ek.wrap_ddp(nn.Linear(4, 1))
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.05))
    with ek.Checkpointer(state, url, every_steps=1000, snapshot_every=1000) as ckpt:
        ckpt.restore()
        return ckpt.restored_step, ckpt.restored_from


def test_a_leave_without_snapshots_says_the_step_is_saved_durably(tmp_path: Path) -> None:
    """With snapshots off the leave saves the step durably: it said the state was in
    the staying nodes' memory."""
    url, shm, marks = str(tmp_path / "run"), tmp_path / "shm", tmp_path / "marks"
    shm.mkdir(), marks.mkdir()
    (marks / "left").write_text("")  # nothing holds the upload
    out = spawn_multi_process(2, _run, url, str(shm), str(marks), 0, local_world_size=1,
                              timeout=180)
    step = out[0]["left_at"]
    assert [(o["left_at"], o["code"]) for o in out] == [(step, 143)] * 2
    (said,) = out[0]["said"]
    assert f"leave at step {step}" in said and "the state is in a durable checkpoint" in said
    assert ek.CheckpointStore(url).latest_step() == step
