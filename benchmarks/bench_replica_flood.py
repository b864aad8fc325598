"""Training throughput and replica latency while strangers flood the replica channel.

Claim checked: with unauthenticated connections opened as fast as one client can and one
idle connection held open, the peer's replica of each snapshot still arrives within
2 s of its commit, training throughput stays >= 0.95x of the same loop without the
flood, and the receiver's ``close()`` takes <= 1 s.

Setting (one process, as on a node's local rank 0): a small MLP trains on one CPU
thread; every 0.5 s its state is saved as a snapshot into a private node-local
:class:`~elastic_kit.CheckpointStore`, and each commit is streamed by a
:class:`ReplicaSender` to a :class:`ReplicaReceiver` listening on loopback in the
same process (the receiver's thread competes with training for the interpreter, as
on a real node). In the ``flood`` phases a second process holds one idle connection
to the receiver and opens unauthenticated connections in a tight loop; the ``baseline``
phases run the same loop without it. Phases alternate (baseline, flood, ...), each
timed alone; a watcher thread (in both phases) notes when each replica lands.

Usage::

    .venv/bin/python benchmarks/bench_replica_flood.py            # 3 pairs of 10 s phases
    .venv/bin/python benchmarks/bench_replica_flood.py --quick    # 2 pairs of 6 s
    .venv/bin/python benchmarks/bench_replica_flood.py --smoke    # seconds, numbers meaningless

The last printed line is a JSON object: steps/s per phase kind, the ratio flood /
baseline, replica latencies (commit to arrival), replicas missing, close() times and
the flood's connection rate.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import emit, load_avg, machine, median, parser, spread  # noqa: E402

from elastic_kit.snapshot._replica import ReplicaReceiver, ReplicaSender  # noqa: E402
from elastic_kit.store import CheckpointStore  # noqa: E402

TOKEN = "bench-token"
SNAPSHOT_EVERY_S = 0.5


def _flood(host: str, port: int, stop: Any, count: Any) -> None:
    """One client: an idle connection held open, and unauthenticated connections as fast
    as it can open them."""
    wrong = b'{"mac": "' + b'0' * 64 + b'", "run": "bench", "source": "x", "step": 1}\n'
    idle = socket.create_connection((host, port), timeout=5)
    n = 0
    while not stop.is_set():
        try:
            with socket.create_connection((host, port), timeout=5) as c:
                c.sendall(wrong)
            n += 1
        except OSError:
            pass
    idle.close()
    count.value = n


def _phase(tmp: Path, seconds: float, flood: bool, tag: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    loss_fn = nn.CrossEntropyLoss()
    receiver = ReplicaReceiver(str(tmp / f"peer-{tag}"), run="bench", token=TOKEN,
                               host="127.0.0.1")
    sender = ReplicaSender((receiver.host, receiver.port), to=receiver.ident, source="nodeA", run="bench",
                           token=TOKEN)
    store = CheckpointStore(str(tmp / f"own-{tag}"), keep_last=1, node_local=True,
                            private=True)
    committed: dict[int, float] = {}
    arrived: dict[int, float] = {}
    done = threading.Event()

    def on_commit(step: int, path: str) -> None:
        committed[step] = time.perf_counter()
        sender.offer(step, path)

    def watch() -> None:
        while not done.is_set():
            for _, step in list(receiver.received):
                arrived.setdefault(step, time.perf_counter())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ctx = mp.get_context("fork")
    stop, count = ctx.Event(), ctx.Value("q", 0)
    proc = ctx.Process(target=_flood, args=(receiver.host, receiver.port, stop, count)) \
        if flood else None
    if proc is not None:
        proc.start()
        time.sleep(0.3)  # the flood is running before training starts
    steps, snap = 0, 0
    t0 = time.perf_counter()
    next_snap = t0 + SNAPSHOT_EVERY_S
    while (now := time.perf_counter()) - t0 < seconds:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        steps += 1
        if now >= next_snap:
            snap += 1
            store.wait()  # a snapshot's write never overlaps the next (as in the tier)
            store.save(model.state_dict(), step=snap, blocking=False, on_commit=on_commit)
            next_snap = now + SNAPSHOT_EVERY_S
    elapsed = time.perf_counter() - t0
    store.close()
    sender.flush(timeout=10)
    time.sleep(0.05)  # the watcher's last look
    c0 = time.perf_counter()
    receiver.close()  # the flood and the idle connection are still there
    close_s = time.perf_counter() - c0
    if proc is not None:
        stop.set()
        proc.join(timeout=30)
    done.set()
    watcher.join()
    sender.close(timeout=1.0)
    lat = [arrived[s] - committed[s] for s in committed if s in arrived]
    return {"steps_per_s": steps / elapsed, "snapshots": len(committed),
            "missing": len([s for s in committed if s not in arrived]),
            "latency_s": lat, "close_s": close_s, "refused": receiver.refused,
            "flood_conn_per_s": count.value / elapsed if flood else 0.0}


def main() -> None:
    args = parser(__doc__).parse_args()
    load0 = load_avg()
    pairs, seconds = (1, 1.5) if args.smoke else (2, 6.0) if args.quick else (3, 10.0)
    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "flood": []}
    with tempfile.TemporaryDirectory(prefix="bench-replica-", dir="/dev/shm"
                                     if os.access("/dev/shm", os.W_OK) else None) as d:
        for i in range(pairs):
            for kind in ("baseline", "flood"):
                r = _phase(Path(d), seconds, kind == "flood", f"{kind}{i}")
                runs[kind].append(r)
                print(f"{kind} {i}: {r['steps_per_s']:.1f} steps/s, replicas "
                      f"{r['snapshots'] - r['missing']}/{r['snapshots']}, max latency "
                      f"{max(r['latency_s'], default=float('nan')):.3f} s, close "
                      f"{r['close_s']:.3f} s, flood {r['flood_conn_per_s']:.0f}/s",
                      file=sys.stderr)

    def rate(kind: str) -> float:
        return median([r["steps_per_s"] for r in runs[kind]])

    flood_lat = [x for r in runs["flood"] for x in r["latency_s"]]
    base_lat = [x for r in runs["baseline"] for x in r["latency_s"]]
    emit({
        "benchmark": "replica_flood",
        "claim": "a flood of unauthenticated connections and an idle connection cost training "
                 "< 5% and delay no replica past 2 s of its commit; close() <= 1 s",
        "machine": machine(),
        "load_avg_1m_start": load0,
        "phases": pairs, "phase_s": seconds, "snapshot_every_s": SNAPSHOT_EVERY_S,
        "baseline": "the same loop and replica channel without the flood",
        "steps_per_s": {k: round(rate(k), 1) for k in runs},
        "steps_per_s_runs": {k: [round(r["steps_per_s"], 1) for r in v] for k, v in runs.items()},
        "replica_latency_s": {k: spread(v) if v else None
                              for k, v in (("baseline", base_lat), ("flood", flood_lat))},
        "replicas_missing": {k: sum(r["missing"] for r in v) for k, v in runs.items()},
        "replicas": {k: sum(r["snapshots"] for r in v) for k, v in runs.items()},
        "close_s_max": {k: round(max(r["close_s"] for r in v), 3) for k, v in runs.items()},
        "flood_conn_per_s": round(median([r["flood_conn_per_s"] for r in runs["flood"]]), 0),
        "refused_per_flood_phase": [r["refused"] for r in runs["flood"]],
        "ratio_throughput_flood_vs_baseline": round(rate("flood") / rate("baseline"), 3),
        "ratio_max_latency_flood_vs_2s": round(max(flood_lat, default=float("inf")) / 2.0, 3),
    }, args.results)


if __name__ == "__main__":
    main()
