"""Sharded (FSDP2) state in memory: a snapshot's cost, and a restore after a lost node.

Claim measured: with sharded state every rank keeps its shards in its node's shared
memory (a *part*, streamed to the next node); the training thread pays one copy per
snapshot, and after a node is lost a group at another world size restores from memory
(each rank reads its ranges from its node's parts, or receives them from the node
that holds them), faster than the resharded load from a checkpoint on local disk,
ours or DCP's (the anchor).

Two "nodes" of one gloo rank each (``local_world_size=1``, each its own snapshot
directory under ``/dev/shm``) train the state of ``bench_sharded.py`` (``--layers``
square ``Linear(--dim)`` blocks, ``fully_shard`` per block and on the root, AdamW:
three times the parameters; built by its functions) and take ``--repeats`` snapshots; per snapshot, the
training thread's time (``SnapshotTier.save``: one copy into the snapshot file) and
the commit latency (until written, hashed and committed), against a memory copy of
the rank's shards (the limit). They also save the same state to local disk, with the
store and with DCP. Then node 1 is lost (its directory deleted) and three nodes
restore (node 1 and node 2 with empty memory): from memory (``tier.load(into=...)``,
then ``set_state_dict``), from our checkpoint (``CheckpointStore.load(into=...)``) and
from DCP's (``dcp.load``), alternating, ``--repeats`` times; each is the max over ranks
(barriers around), and all three must restore the same parameters.

Usage::

    .venv/bin/python benchmarks/bench_sharded_snapshot.py            # 24 x 1024^2 (~300 MB)
    .venv/bin/python benchmarks/bench_sharded_snapshot.py --quick    # 8 x 1024^2
    .venv/bin/python benchmarks/bench_sharded_snapshot.py --smoke    # tiny, seconds

The last line printed is a JSON object with every figure and the ratios.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from bench_sharded import _build, _sharded  # noqa: E402  (the same state)

from elastic_kit.testing import spawn_multi_process  # noqa: E402

KEY = "bench-sharded-snapshot"


def _node_env(shm: str) -> None:
    os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = shm
    os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{os.environ.get('GROUP_RANK', '0')}"
    torch.set_num_threads(1)


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _tier(info: Any) -> Any:
    from elastic_kit.snapshot import SnapshotTier

    return SnapshotTier(KEY, info=info, every=1, identity="bench", sharded=True)


def _save_job(shm: str, disk: str, dim: int, layers: int, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import elastic_kit as ek
    from elastic_kit.store import is_dtensor, iter_tensors, state_nbytes

    _node_env(shm)
    info = ek.init_distributed()
    model, opt = _build(dim, layers)
    state = _sharded(model, opt)
    tier = _tier(info)
    tier.connect()
    local = [t.to_local() if is_dtensor(t) else t for t in iter_tensors(state)]
    copies = [torch.empty_like(t) for t in local]
    out: dict[str, Any] = {"shard_bytes": state_nbytes(state), "taken_s": [], "commit_s": [],
                           "copy_s": []}
    for step in range(1, repeats + 2):
        t0 = time.perf_counter()
        for c, t in zip(copies, local):
            c.copy_(t)
        copy_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tier.save(state, step=step, metadata={"epoch": 0})
        taken = time.perf_counter() - t0
        tier.wait()
        if step > 1:  # the first snapshot makes and first touches its file
            out["copy_s"].append(copy_s)
            out["taken_s"].append(taken)
            out["commit_s"].append(tier.commit_latency_s)
    tier.close(remove=False)  # written, and streamed to the next node
    store = ek.CheckpointStore(f"{disk}/ours")
    store.save(state, step=repeats + 1, metadata={"epoch": 0})
    store.close()
    dcp.save(state, checkpoint_id=f"{disk}/dcp")
    torch.distributed.barrier()
    return out


def _load_job(shm: str, disk: str, dim: int, layers: int, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    import elastic_kit as ek

    _node_env(shm)
    info = ek.init_distributed()
    model, opt = _build(dim, layers)
    out: dict[str, Any] = {"memory": [], "ours": [], "dcp": [], "sums": {}, "all_local": []}
    for i in range(repeats):
        order = ("memory", "ours", "dcp") if i % 2 == 0 else ("dcp", "ours", "memory")
        for method in order:
            with torch.no_grad():  # forget the state: the load must bring it back
                for p in model.parameters():
                    p.zero_()

            def memory() -> None:
                tier = _tier(info)
                tier.connect()
                loaded = tier.load(into=lambda: _sharded(model, opt))
                assert loaded is not None, "no snapshot in memory"
                set_state_dict(model, opt, model_state_dict=loaded.state["model"],
                               optim_state_dict=loaded.state["optimizer"])
                out["all_local"].append(tier.loaded_own)
                tier.close(remove=False, flush=False)

            def ours() -> None:
                loaded = ek.CheckpointStore(f"{disk}/ours").load(
                    into=lambda: _sharded(model, opt))
                set_state_dict(model, opt, model_state_dict=loaded.state["model"],
                               optim_state_dict=loaded.state["optimizer"])

            def theirs() -> None:
                state = _sharded(model, opt)
                dcp.load(state, checkpoint_id=f"{disk}/dcp")
                set_state_dict(model, opt, model_state_dict=state["model"],
                               optim_state_dict=state["optimizer"])

            out[method].append(_timed({"memory": memory, "ours": ours, "dcp": theirs}[method]))
            out["sums"][method] = float(sum(p.detach().to_local().double().sum()
                                            for p in model.parameters()))
    return out


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    dim = args.dim or (64 if args.smoke else 1024)
    layers = args.layers or (2 if args.smoke else 8 if args.quick else 24)
    repeats = args.repeats or (2 if args.smoke else 3)
    load_start = _common.load_avg()
    work = tempfile.mkdtemp(prefix="ek-bench-shsnap-")
    shm = tempfile.mkdtemp(prefix="ek-bench-shsnap-", dir="/dev/shm")
    try:
        saves = spawn_multi_process(2, _save_job, shm, work, dim, layers, repeats,
                                    local_world_size=1, timeout=1800)
        run = next(Path(shm).glob("elastic_kit-*/*"))
        shutil.rmtree(run / "node1")  # node 1 is lost; its part lives on node 0
        loads = spawn_multi_process(3, _load_job, shm, work, dim, layers, repeats,
                                    local_world_size=1, timeout=1800)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    sums = {r["sums"][m] for r in loads[:1] for m in ("memory", "ours", "dcp")}
    if len(sums) != 1:
        raise SystemExit(f"the three restores differ: {loads[0]['sums']}")

    def med(key: str, rows: list[dict[str, Any]]) -> float:
        # per repeat the max over ranks, then the median over repeats
        return _common.median([max(r[key][i] for r in rows) for i in range(len(rows[0][key]))])

    shard_mb = max(s["shard_bytes"] for s in saves) / 1e6
    result = {
        "claim": "sharded snapshots: one copy per snapshot; restore from memory after a "
                 "lost node at a new world size vs resharded loads from local disk",
        "baseline": "torch.distributed.checkpoint.load of the same state from local disk "
                    "(and CheckpointStore.load); a memory copy of the rank's shards",
        "scenario": f"{layers} x Linear({dim}) FSDP2 + AdamW, 2 nodes x 1 gloo rank save, "
                    "node 1 lost, 3 nodes x 1 rank restore",
        "shard_mb_per_rank_saved": round(shard_mb, 1),
        "snapshot_taken_s": round(med("taken_s", saves), 4),
        "memory_copy_s": round(med("copy_s", saves), 4),
        "snapshot_commit_s": round(med("commit_s", saves), 4),
        "restore_memory_s": round(med("memory", loads), 3),
        "restore_ours_disk_s": round(med("ours", loads), 3),
        "restore_dcp_disk_s": round(med("dcp", loads), 3),
        "restore_all_local": any(all(r["all_local"]) for r in loads[:1]),
        "repeats": repeats,
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": _common.load_avg(),
        **_common.machine(),
    }
    result["ratio_taken_vs_memory_copy"] = round(
        result["snapshot_taken_s"] / max(result["memory_copy_s"], 1e-9), 2)
    result["ratio_restore_memory_vs_dcp"] = round(
        result["restore_memory_s"] / result["restore_dcp_disk_s"], 3)
    result["ratio_restore_memory_vs_ours_disk"] = round(
        result["restore_memory_s"] / result["restore_ours_disk_s"], 3)
    _common.emit(result, args.results)


if __name__ == "__main__":
    main()
