"""Sharded (FSDP2) save and resharded load: CheckpointStore vs DCP, at 2 and 3 CPU ranks.

Claim measured: saving a sharded state with every rank writing its own shards
(``CheckpointStore.save`` of ``TrainState``-style DTensor state) and loading it at
another world size (``CheckpointStore.load(into=...)``: each rank reads only its byte
ranges, then ``set_state_dict``) is at least as fast as
``torch.distributed.checkpoint.save`` / ``load`` (the anchor: what torchtitan does) on
the same state and machine, with the store's checksums, layout-independent digest and
commit rules on top; and each rank's memory peak stays within its shard plus one
staging buffer.

The state: ``--layers`` square ``Linear(--dim)`` blocks, ``fully_shard`` per block and
on the root, AdamW after one step (parameters, ``exp_avg``, ``exp_avg_sq``: three
times the parameters). For each saving world size N in (2, 3): one job of N gloo
ranks saves with ours and with DCP, alternating, ``--repeats`` times each; then one
job at the other world size (3, 2) loads the last of each, alternating. Per method:
wall time (max over ranks; barriers around), bytes written per rank (max), peak RSS
growth during the operation (max over ranks; sampled every 2 ms) against the rank's
shard bytes. Ratios are ours / DCP (below 1: ours is faster or smaller). Also, before
each pair, a non-blocking save (``blocking=False``, what the Checkpointer does): the
time ``save()`` blocks (the copy of the rank's shards) and the time to its commit.

Usage::

    .venv/bin/python benchmarks/bench_sharded.py              # 24 x 1024^2 (~300 MB state)
    .venv/bin/python benchmarks/bench_sharded.py --quick      # 8 x 1024^2 (~100 MB)
    .venv/bin/python benchmarks/bench_sharded.py --smoke      # tiny, seconds

The last line printed is a JSON object with every figure and ratio.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from elastic_kit.testing import spawn_multi_process  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """Peak RSS growth of this process while the block runs (sampled every 2 ms)."""

    def __enter__(self) -> _Peak:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.base


def _build(dim: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, dim)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _sharded(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


def _shard_bytes(state: dict[str, Any]) -> int:
    from elastic_kit.store import state_nbytes

    return state_nbytes(state)


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
    import torch.distributed as dist

    dist.barrier()
    with _Peak() as peak:
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        dt = time.perf_counter() - t0
    return dt, peak.growth


def _dir_bytes(path: str, rank: int, method: str) -> int:
    """Bytes this rank wrote: its own files (ours: shards-<rank>*, rank 0 also the
    payload and manifest; DCP: __<rank>_*.distcp, rank 0 also .metadata)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            mine = (name.startswith(f"shards-{rank:05d}") if method == "ours"
                    else name.startswith(f"__{rank}_"))
            if rank == 0 and (name in ("state.pt", "manifest.json", ".metadata")):
                mine = True
            if mine:
                total += os.path.getsize(os.path.join(root, name))
    return total


def _save_job(base: str, dim: int, layers: int, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import elastic_kit as ek

    info = ek.init_distributed()
    model, opt = _build(dim, layers)
    state = _sharded(model, opt)
    out: dict[str, Any] = {"shard_bytes": _shard_bytes(state), "ours": [], "dcp": [],
                           "background": []}
    for i in range(repeats):
        # the background save: how long save() blocks the training thread, then the rest
        store = ek.CheckpointStore(f"{base}/bg-w{info.world_size}-{i}", keep_last=None)
        blocked, _ = _timed(lambda: store.save(state, step=1, blocking=False))
        total, _ = _timed(store.wait)
        store.close()
        out["background"].append({"blocked_s": blocked, "total_s": blocked + total})
        for method in (("ours", "dcp") if i % 2 == 0 else ("dcp", "ours")):
            path = f"{base}/{method}-w{info.world_size}-{i}"
            if method == "ours":
                store = ek.CheckpointStore(path, keep_last=None)
                dt, peak = _timed(lambda: store.save(state, step=1))
                store.close()
                written = _dir_bytes(f"{path}/step-000000000001", info.rank, "ours")
            else:
                dt, peak = _timed(lambda: dcp.save(state, checkpoint_id=path))
                written = _dir_bytes(path, info.rank, "dcp")
            out[method].append({"s": dt, "peak": peak, "written": written, "path": path})
    return out


def _load_job(paths: dict[str, str], dim: int, layers: int, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    import elastic_kit as ek

    ek.init_distributed()
    model, opt = _build(dim, layers)
    out: dict[str, Any] = {"shard_bytes": _shard_bytes(_sharded(model, opt)), "ours": [],
                           "dcp": [], "sums": {}}
    for i in range(repeats):
        for method in (("ours", "dcp") if i % 2 == 0 else ("dcp", "ours")):
            with torch.no_grad():  # forget the state: the load must bring it back
                for p in model.parameters():
                    p.zero_()

            def ours() -> None:
                store = ek.CheckpointStore(paths["ours"])
                loaded = store.load(into=lambda: _sharded(model, opt))
                set_state_dict(model, opt, model_state_dict=loaded.state["model"],
                               optim_state_dict=loaded.state["optimizer"])

            def theirs() -> None:
                state = _sharded(model, opt)
                dcp.load(state, checkpoint_id=paths["dcp"])
                set_state_dict(model, opt, model_state_dict=state["model"],
                               optim_state_dict=state["optimizer"])

            dt, peak = _timed(ours if method == "ours" else theirs)
            out[method].append({"s": dt, "peak": peak})
            out["sums"][method] = float(sum(p.detach().to_local().double().sum()
                                            for p in model.parameters()))
    return out


def _summary(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Per method: median over repeats of the max over ranks."""
    out = {}
    for method in ("ours", "dcp"):
        reps = len(results[0][method])
        times = [max(r[method][i]["s"] for r in results) for i in range(reps)]
        peaks = [max(r[method][i]["peak"] for r in results) for i in range(reps)]
        out[method] = {"s": round(_common.median(times), 4), "s_all": [round(t, 4) for t in times],
                       "peak_rss_mb": round(_common.median(peaks) / 1e6, 1)}
        if key == "save":
            out[method]["written_mb_per_rank"] = [
                round(r[method][-1]["written"] / 1e6, 2) for r in results]
    out["shard_mb_per_rank"] = [round(r["shard_bytes"] / 1e6, 2) for r in results]
    return out


def main() -> None:
    args = _parse()
    if args.smoke:
        dim, layers, repeats = 64, 2, 1
    elif args.quick:
        dim, layers, repeats = 1024, 8, 2
    else:
        dim, layers, repeats = args.dim, args.layers, args.repeats
    state_mb = 3 * dim * dim * layers * 4 / 1e6
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="ek-bench-sharded-", dir=args.dir)
    load0 = _common.load_avg()
    per: dict[str, Any] = {}
    try:
        for saved_at, loaded_at in ((2, 3), (3, 2)):
            saves = spawn_multi_process(saved_at, _save_job, base, dim, layers, repeats,
                                        timeout=1800)
            paths = {m: saves[0][m][-1]["path"] for m in ("ours", "dcp")}
            loads = spawn_multi_process(loaded_at, _load_job, paths, dim, layers, repeats,
                                        timeout=1800)
            same = all(abs(r["sums"]["ours"] - r["sums"]["dcp"]) == 0 for r in loads)
            reps = range(len(saves[0]["background"]))
            blocked = [max(r["background"][i]["blocked_s"] for r in saves) for i in reps]
            total = [max(r["background"][i]["total_s"] for r in saves) for i in reps]
            per[f"{saved_at}->{loaded_at}"] = {
                "save": _summary(saves, "save"), "load": _summary(loads, "load"),
                "background": {"blocked_s": round(_common.median(blocked), 4),
                               "total_s": round(_common.median(total), 4)},
                "loaded_states_equal": same}
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(base, exist_ok=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def ratio(kind: str, what: str = "s") -> dict[str, float]:
        return {k: round(v[kind]["ours"][what] / max(v[kind]["dcp"][what], 1e-9), 3)
                for k, v in per.items()}

    def written_ratio() -> dict[str, float]:
        return {k: round(max(v["save"]["ours"]["written_mb_per_rank"])
                         / max(max(v["save"]["dcp"]["written_mb_per_rank"]), 1e-9), 3)
                for k, v in per.items()}

    def peak_vs_shard(kind: str) -> dict[str, float]:
        return {k: round(v[kind]["ours"]["peak_rss_mb"]
                         / max(max(v[kind]["shard_mb_per_rank"]), 1e-9), 3)
                for k, v in per.items()}

    _common.emit({
        "claim": "sharded save and resharded load at least as fast as DCP on the same "
                 "state, each rank writing only its shards, memory within a shard plus "
                 "a staging buffer",
        "baseline": "torch.distributed.checkpoint save / load + set_state_dict",
        "state_mb": round(state_mb, 1), "dim": dim, "layers": layers, "repeats": repeats,
        "per_case": per,
        "ratio_save_ours_vs_dcp": ratio("save"),
        "ratio_load_ours_vs_dcp": ratio("load"),
        "ratio_written_per_rank_ours_vs_dcp": written_ratio(),
        # a non-blocking save: the training thread waits only for the copy of its shards
        "ratio_background_blocked_vs_dcp_save": {
            k: round(v["background"]["blocked_s"] / max(v["save"]["dcp"]["s"], 1e-9), 3)
            for k, v in per.items()},
        "ratio_save_peak_rss_vs_shard_ours": peak_vs_shard("save"),
        "ratio_load_peak_rss_vs_shard_ours": peak_vs_shard("load"),
        "machine": _common.machine(), "load_avg_1m_start": load0, "load_avg_1m": load0,
    }, args.results)


def _parse() -> Any:
    p = _common.parser(__doc__)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    return p.parse_args()


if __name__ == "__main__":
    main()
