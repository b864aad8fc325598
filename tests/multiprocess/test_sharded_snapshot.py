"""Sharded (FSDP2) state in the in-memory snapshots, on real gloo ranks: every rank keeps
its own shards in its node's memory and streams them to the next node; a group at
another world size, after a node was lost, restores from memory, each rank taking the
ranges it owns now from whichever node holds them.

Nodes are simulated by ``local_world_size``: each "node" has its own snapshot
directory (``node<i>``); a lost node is its directory deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_kit.snapshot import snapshot_dir
from elastic_kit.testing import spawn_multi_process
from tests.multiprocess.test_sharded_state import _close, _full, _model

pytestmark = pytest.mark.timeout(300)

_GLOBAL_BATCH = 6
_SIZE = 30


def _job(url: str, shm: str, stop_at: int | None, snapshots: bool = True,
         round_bytes: int | None = None) -> dict[str, Any]:
    """An own loop over a sharded model with ``ek.Checkpointer``: a snapshot every step,
    a durable checkpoint only at step 10 (the end); 'killed' (nothing closed, the
    snapshots and their streams to the next node landed) once ``state.step ==
    stop_at``. ``round_bytes``: the resharding restore's bytes per round."""
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    if round_bytes is not None:
        os.environ["ELASTIC_KIT_RESHARD_ROUND_BYTES"] = str(round_bytes)
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{os.environ.get('GROUP_RANK', '0')}"
    torch.set_num_threads(1)
    import elastic_kit as ek
    from torch.utils.data import DataLoader, TensorDataset

    info = ek.init_distributed()
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.arange(_SIZE), torch.randn(_SIZE, 5, generator=g),
                         torch.randn(_SIZE, 2, generator=g))
    sampler = ek.ElasticDistributedSampler(data, seed=3)
    loader = DataLoader(data, batch_size=_GLOBAL_BATCH // info.world_size, sampler=sampler)
    state = ek.TrainState(model, opt, sampler=sampler)
    ckpt = ek.Checkpointer(state, url, every_steps=10, audit="error", handle_signals=False,
                           snapshot_every=1 if snapshots else None)
    start = ckpt.restore()
    # the newest step every rank holds its part of: the restored one, at first
    common = ckpt.snapshots.common_step if ckpt.snapshots is not None else None
    if ckpt.snapshots is not None:  # the file a restore has the writer make is made
        ckpt.snapshots.wait(timeout=60)
    first_direct = None  # whether the first snapshot went straight into a file
    for epoch in range(start, 2):
        sampler.set_epoch(epoch)
        for _, x, y in loader:
            w = ckpt.sample_weights(len(x))
            loss = ((model(x) - y).square().mean(1) * w).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(len(x))
            first_direct = _first_direct(ckpt, first_direct)
            if state.step == stop_at:
                tier = ckpt.snapshots
                assert tier is not None and tier.sharded
                tier.close(remove=False)  # written, and streamed to the next node
                torch.distributed.barrier()  # the other ranks' streams are in too
                return {"stopped": state.step, "restored": ckpt.restored_step,
                        "from": ckpt.restored_from, "common_at_restore": common}
        ckpt.end_epoch()
        # the epoch's snapshot may be the first after the restore: judged now, before
        # the next step's, which may come while this one is still written
        first_direct = _first_direct(ckpt, first_direct)
    full = _full(model, opt)
    ckpt.close()
    return {"full": full, "report": state.run_report(), "restored": ckpt.restored_step,
            "from": ckpt.restored_from, "step": state.step, "first_direct": first_direct,
            "common_at_restore": common}


def _first_direct(ckpt: Any, seen: bool | None) -> bool | None:
    """Whether the first snapshot after the restore went straight into a file (None
    until it was taken; judged once)."""
    tier = ckpt.snapshots
    if seen is not None or tier is None or tier.cost_s is None:
        return seen
    return tier.direct == len(tier._costs)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rank 0's result of the uninterrupted run at world size 2."""
    tmp = tmp_path_factory.mktemp("plain")
    (tmp / "shm").mkdir()
    return spawn_multi_process(2, _job, str(tmp / "run"), str(tmp / "shm"), None, False)[0]


@pytest.fixture()
def shm(tmp_path: Path) -> str:
    root = tmp_path / "shm"
    root.mkdir()
    return str(root)


def _parts(run: Path, node: str) -> dict[str, list[str]]:
    """What a node holds: its ranks' parts and its replicas, by directory."""
    out = {}
    for d in sorted((run / node).iterdir()):
        if d.name == "replicas":
            for r in sorted(d.iterdir()):
                out[f"replicas/{r.name}"] = sorted(p.name for p in r.iterdir())
        elif d.is_dir():
            out[d.name] = sorted(p.name for p in d.iterdir() if p.name.startswith("step-"))
    return out


def test_same_world_size_resumes_from_memory_bitwise(tmp_path: Path, shm: str,
                                                     plain: dict[str, Any]) -> None:
    url = str(tmp_path / "run")
    assert spawn_multi_process(2, _job, url, shm, 4, local_world_size=2)[0]["stopped"] == 4
    run = Path(snapshot_dir(shm, "test", url))
    # one node, two ranks: each rank's part in a directory of its own, the newest
    # step's in both (a writer busy with one step may skip the next: it keeps older
    # ones until the flag exchanges show every rank holding a newer one)
    held = _parts(run, "node0")
    assert sorted(held) == ["p0", "p1"]
    assert [v[-1] for v in held.values()] == ["step-000000000004"] * 2
    outs = spawn_multi_process(2, _job, url, shm, None, local_world_size=2)
    out = outs[0]
    assert (out["restored"], out["from"]) == (4, "memory")
    # kept on every rank until every rank holds its part of a newer step
    assert [o["common_at_restore"] for o in outs] == [4, 4]
    # each rank's part of the first snapshot after the restore went straight into the
    # file its writer made at the restore
    assert [o["first_direct"] for o in outs] == [True, True]
    assert out["step"] == plain["step"] == 10
    assert out["full"] == plain["full"]  # the same layout: bit for bit
    assert [(a["epoch"], a["count"], a["ok"]) for a in out["report"]["audit"]] == [
        (0, _SIZE, True), (1, _SIZE, True)]


def test_node_losses_restore_from_memory_at_new_world_sizes(
        tmp_path: Path, shm: str, plain: dict[str, Any]) -> None:
    """2 nodes -> node 0 lost -> 3 nodes -> node 2 lost -> 2 nodes, one rank each; every
    restore comes from memory (the durable store holds nothing before the end), with
    the ranges of a lost node's shards taken from its replica on the survivor, moved
    between the ranks in rounds of at most 256 bytes (many rounds: a wrong pairing of
    the two ends would fail the restored content's digest)."""
    url = str(tmp_path / "run")
    run = Path(snapshot_dir(shm, "test", url))
    assert spawn_multi_process(2, _job, url, shm, 3, local_world_size=1)[0]["stopped"] == 3
    # each node's part, and the other node's streamed into its memory
    held = _parts(run, "node1")
    assert sorted(held) == ["p0", "replicas/node0.p0"]
    assert [v[-1] for v in held.values()] == ["step-000000000003"] * 2
    shutil.rmtree(run / "node0")  # node 0 is lost: its part lives on as node 1's replica
    got = spawn_multi_process(3, _job, url, shm, 7, True, 256, local_world_size=1)
    # ranks 0 and 2 run on nodes with nothing in memory: their ranges came from node 1
    assert got[0] == {"stopped": 7, "restored": 3, "from": "peer", "common_at_restore": 3}
    shutil.rmtree(run / "node2")  # node 2 is lost: node 0 holds its replica
    assert _parts(run, "node0")["replicas/node2.p0"][-1] == "step-000000000007"
    last = spawn_multi_process(2, _job, url, shm, None, True, 256, local_world_size=1)[0]
    assert (last["restored"], last["from"]) == (7, "peer")
    assert last["step"] == 10
    assert _close(last["full"], plain["full"])  # reduction order differs: not bitwise
    assert [(a["epoch"], a["count"], a["ok"]) for a in last["report"]["audit"]] == [
        (0, _SIZE, True), (1, _SIZE, True)]
    assert [(w["world_size"], w["restored_step"], w["restored_from"])
            for w in last["report"]["world_sizes"]] == [
        (2, None, None), (3, 3, "peer"), (2, 7, "peer")]


def test_a_corrupt_part_is_taken_from_its_replica(tmp_path: Path, shm: str,
                                                  plain: dict[str, Any]) -> None:
    url = str(tmp_path / "run")
    spawn_multi_process(2, _job, url, shm, 4, local_world_size=1)
    run = Path(snapshot_dir(shm, "test", url))
    own = run / "node1" / "p0" / "step-000000000004"
    chunks = json.loads((own / "manifest.json").read_text())["sharded"]["chunks"]
    entry = next(c["entry"] for c in chunks if c["entry"]["nbytes"] > 0)
    flat = own / chunks[0]["file"]
    data = bytearray(flat.read_bytes())
    data[entry["offset"] + entry["nbytes"] // 2] ^= 0x10  # inside a tensor's bytes
    flat.write_bytes(bytes(data))
    out = spawn_multi_process(2, _job, url, shm, None, local_world_size=1)[0]
    assert (out["restored"], out["from"]) == (4, "peer")  # node 1's part from node 0
    assert out["full"] == plain["full"]


def test_without_a_complete_snapshot_in_memory_the_durable_store_is_used(
        tmp_path: Path, shm: str) -> None:
    url = str(tmp_path / "run")
    spawn_multi_process(2, _job, url, shm, 4, local_world_size=1)
    run = Path(snapshot_dir(shm, "test", url))
    shutil.rmtree(run / "node0")
    shutil.rmtree(run / "node1" / "replicas")  # rank 0's part is nowhere now
    out = spawn_multi_process(2, _job, url, shm, None, local_world_size=1)[0]
    assert (out["restored"], out["from"]) == (None, None)  # nothing durable before step 10
    assert out["step"] == 10


def test_a_lone_survivor_restores_every_shard_from_its_own_memory(
        tmp_path: Path, shm: str, plain: dict[str, Any]) -> None:
    """2 nodes -> node 1 lost -> 1 rank: node 0 holds its own part and node 1's
    replica, so the restore needs no other node ("this node's memory")."""
    url = str(tmp_path / "run")
    spawn_multi_process(2, _job, url, shm, 7, local_world_size=1)
    shutil.rmtree(Path(snapshot_dir(shm, "test", url)) / "node1")
    (out,) = spawn_multi_process(1, _job, url, shm, None, local_world_size=1)
    assert (out["restored"], out["from"]) == (7, "memory")
    assert out["step"] == 10
    assert _close(out["full"], plain["full"])
    assert [(a["epoch"], a["count"], a["ok"]) for a in out["report"]["audit"]] == [
        (0, _SIZE, True), (1, _SIZE, True)]


def _held_job(url: str, shm: str, restore_to: str | None) -> dict[str, Any]:
    """Three steps with a snapshot each, then 'die' (the snapshots kept); with
    ``restore_to``, instead: restore with that map_location and name the snapshot
    files this rank still has mapped."""
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{os.environ.get('GROUP_RANK', '0')}"
    torch.set_num_threads(1)
    import gc

    import elastic_kit as ek

    info = ek.init_distributed()
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ek.TrainState(model, opt)
    ckpt = ek.Checkpointer(state, url, handle_signals=False, snapshot_every=1)
    if restore_to is None:
        ckpt.restore()
        for _ in range(3):
            model(torch.randn(3, 5)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step(3)
        assert ckpt.snapshots is not None
        ckpt.snapshots.close(remove=False)
        torch.distributed.barrier()
        return {"rank": info.rank}
    ckpt.restore(map_location=restore_to)
    gc.collect()
    with open("/proc/self/maps") as f:
        # a restored step's files (the writer's own slot for the next snapshots aside)
        mapped = sorted({line.split(None, 5)[-1].strip() for line in f
                         if shm in line and "/step-" in line})
    out = {"from": ckpt.restored_from, "step": ckpt.restored_step, "mapped": mapped}
    ckpt.close()
    return out


def test_nothing_of_the_restored_parts_stays_mapped(tmp_path: Path, shm: str) -> None:
    """The rank that read part 0 (its views of the mapping) keeps none of them, also
    with ``map_location="cpu"`` (what ElasticLoop passes): a replicated tensor there
    (AdamW's step) held the whole file for the rest of the run. (Without a
    map_location they were copied before too.)"""
    url = str(tmp_path / "run")
    spawn_multi_process(2, _held_job, url, shm, None)
    got = spawn_multi_process(2, _held_job, url, shm, "cpu")
    assert got == [{"from": "memory", "step": 3, "mapped": []}] * 2
