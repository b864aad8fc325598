"""A planned leave while a staying node's writer uploads a durable save (real torchrun
agents, two nodes of two workers, gloo, CPU).

The leaving node must not wait for that upload (its notice may be shorter), but the
staying ranks must: a staying rank that exits makes its agent stop the node's other
workers, the writer among them, and the upload was cut off by the SIGKILL after
torchrun's grace (the close let every rank but the writer go at once).

The writer (rank 0, node 0) holds its upload of step 4 until the leaving node's
ranks have exited, and a few seconds more; node 1 is told to leave at step 6.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from elastic_kit.testing import LocalCluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    import fsspec, torch
    from torch import nn
    import elastic_kit as ek
    from elastic_kit.testing import FaultFileSystem

    url, marks = sys.argv[1], Path(sys.argv[2])
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{os.environ['GROUP_RANK']}"
    torch.set_num_threads(1)
    info = ek.init_distributed()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        sys.exit(0)  # the staying node's restart: the test is over

    def hold(_):
        deadline = time.monotonic() + 60
        while not (marks / "left-2").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(3)  # time enough for a staying rank to exit, were it let go
        (marks / "released").write_text(str(time.time()))

    def left(*_):
        mark = marks / f"left-{info.rank}"
        if not mark.exists():
            mark.write_text(str(time.time()))

    # a leaving rank's agent, which it stops, stops it in turn (SIGTERM): on a loaded
    # machine that can come before its SystemExit reaches the mark below (the
    # checkpointer gives the signal back to this handler once it closed)
    signal.signal(signal.SIGTERM, lambda *a: (left(), os._exit(143)))
    store = url
    if info.rank == 0:
        ffs = FaultFileSystem(fsspec.filesystem("file"))
        ffs.add("open", match="step-000000000004", mode="wb", before=hold)
        store = ek.CheckpointStore(url, filesystem=ffs)
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = ek.TrainState(model, opt)
    ckpt = ek.Checkpointer(state, store, every_steps=1000, snapshot_every=1000)
    try:
        ckpt.restore()
        for _ in range(10_000):
            model(torch.randn(4, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(4)
            time.sleep(0.02)
            if state.step == 4:
                ckpt.save(blocking=False)
            if state.step == 6 and info.node_rank == 1 and info.local_rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)
        ckpt.close()
    except SystemExit:
        left()
        raise
""")


def test_the_staying_ranks_wait_for_their_writers_upload(tmp_path: Path) -> None:
    script, marks, url = tmp_path / "train.py", tmp_path / "marks", tmp_path / "ckpt"
    script.write_text(SCRIPT)
    marks.mkdir()
    (tmp_path / "shm").mkdir()
    env = {"OMP_NUM_THREADS": "1", "ELASTIC_KIT_SNAPSHOT_DIR": str(tmp_path / "shm")}
    with LocalCluster([str(script), str(url), str(marks)], nnodes="1:2", nproc_per_node=2,
                      max_restarts=3, env=env, log_dir=tmp_path / "logs",
                      rdzv_conf="join_timeout=60,last_call_timeout=1,keep_alive_interval=1,"
                                "keep_alive_max_attempt=3") as cluster:
        cluster.add_agent()
        cluster.add_agent()
        wait_for(lambda: (marks / "left-0").exists() and (marks / "left-1").exists(), 240,
                 interval=0.05, what="the staying ranks' exit", abort_if=cluster.all_exited)
        logs = cluster.logs()
    left = {r: float((marks / f"left-{r}").read_text()) for r in range(4)}
    released = float((marks / "released").read_text())
    # the leaving node went before the upload was let go; the staying ranks after it
    assert left[2] < released and left[3] < released, logs[-6000:]
    assert left[1] > released and left[0] > released, (left, released, logs[-6000:])
    assert (url / "step-000000000004" / "manifest.json").exists(), logs[-6000:]
