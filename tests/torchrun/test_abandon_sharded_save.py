"""A worker whose peer died while a background sharded (FSDP2) save was in flight
(real torchrun, two workers, gloo, CPU).

The survivor's collective fails and it abandons its checkpointer, which waited for the
save, and the save for the dead peer's entries, the healthy group's 300 s: torchrun's
SIGTERM was held meanwhile, and its SIGKILL after the grace ended the worker with
nothing said (a node lost mid-save cost five minutes where torchrun gives no grace).
The wait now gives up a peer silent for seconds, and the worker exits on its own.

The same for a survivor whose training thread waits in its next ``save()`` for the
one in flight: no collective fails there, and torchrun's SIGTERM is all it hears; the
wait went on past torchrun's grace. The signal now has the save give up the silent peer.

The peer dies for real (SIGKILL) when it opens its shard file of the save, through a
fault-injecting fsspec wrapper of the local disk (in the second case 2 s later, once
both training threads wait in the next save).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from elastic_kit.testing import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    import fsspec, torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    import elastic_kit as ek
    from elastic_kit.testing import FaultFileSystem

    url, marks, second = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "second-save"
    info = ek.init_distributed()
    store = url

    def die(_):
        if second:
            time.sleep(2.0)  # the training threads reach their next save meanwhile
        os.kill(os.getpid(), signal.SIGKILL)

    if info.rank == 1:
        ffs = FaultFileSystem(fsspec.filesystem("file"))
        ffs.add("open", match="step-000000000003", mode="wb", before=die)
        store = ek.CheckpointStore(url, filesystem=ffs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ek.TrainState(model, opt)
    try:
        with ek.Checkpointer(state, store, every_steps=100_000, snapshot_every=0,
                             heartbeat_timeout=0) as ckpt:
            ckpt.restore()
            # one background save (at step 3), then training until the peer's death
            # fails a collective (no second save waits for the first meanwhile)
            for _ in range(100_000):
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                ckpt.step(4)
                if state.step == 3 or (second and state.step == 4):
                    ckpt.save(blocking=False)
                time.sleep(0.01)
    except BaseException as e:
        (marks / f"rank{info.rank}").write_text(f"{state.step} {type(e).__name__}")
        raise
""")


@pytest.mark.parametrize("case", ["one-save", "second-save"])
def test_the_survivor_of_a_peer_dead_in_a_sharded_save_exits_on_its_own(
        tmp_path: Path, case: str) -> None:
    script, marks = tmp_path / "train.py", tmp_path / "marks"
    script.write_text(SCRIPT)
    marks.mkdir()
    with LocalCluster([str(script), str(tmp_path / "run"), str(marks), case], nnodes="1",
                      nproc_per_node=2, max_restarts=0, env={"OMP_NUM_THREADS": "1"},
                      log_dir=tmp_path / "logs") as cluster:
        cluster.add_agent()
        codes = cluster.wait(180)
        logs = cluster.logs()
    assert codes == [1], (codes, logs[-6000:])
    # before: no word from rank 0, SIGKILLed by torchrun 30 s after its SIGTERM
    assert (marks / "rank0").exists(), logs[-6000:]
    step, why = (marks / "rank0").read_text().split()
    assert int(step) >= 3 and why in ("SystemExit", "RuntimeError", "DistBackendError",
                                      "CheckpointError"), why
    if case == "second-save":
        # it heard of the failure in its save of step 4 (before: SIGKILLed there)
        assert int(step) == 4, (step, why)
    assert "no sign of progress" in logs, logs[-6000:]
