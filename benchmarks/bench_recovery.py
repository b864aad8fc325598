"""Recovery time of the ImageNet example under torchrun after SIGKILL, node loss and a join.

Claim (issue 6, claim 4): after a worker is SIGKILLed, training is running again
(first optimizer step after the restore) in under 10 s on this machine, and the time
splits into detection, rendezvous, worker start, restore.

Scenario (the integration suite's, on ``examples/imagenet/main.py``): two torchrun
agents ("nodes", 1 worker each) on 127.0.0.1 form one elastic job (c10d rendezvous,
``--nnodes=1:3``, ``--rdzv-conf=last_call_timeout=1,join_timeout=60``, monitor
interval 0.5 s, via :class:`elastic_kit.local_cluster.LocalCluster`), training
``-a tinycnn --image-size 32 -j 0`` on a small synthetic image folder, checkpointing
every 5 steps. Then, each once training has passed a new checkpoint:

1. ``kill_worker``: SIGKILL agent 1's worker; torchrun restarts the group at W=2;
2. ``kill_node``: SIGKILL agent 1 and everything below it (a lost node); W=2 -> 1;
3. ``add_node``: start a new agent (a node joins); W=1 -> 2.

A thread tails every agent's log (agent + workers, unbuffered) every 20 ms and
timestamps each line when it appears; the phases of each event come from those
lines:

- ``detect``: event -> the first "Worker group FAILED" / "Detected N new nodes"
  line of a surviving agent (torchrun's monitor loop, 0.5 s period);
- ``rendezvous``: -> the last agent's "Rendezvous complete";
- ``worker_start``: -> the example's first line of the new group ("world size W
  (restart r"): process start, Python and torch imports, process-group init;
- ``restore``: -> the loop's "restored checkpoint step N" (building the data set
  and model, loading the newest checkpoint);
- ``first_step``: -> the first "step N" line after it (one optimizer step).

For ``add_node`` the detection includes the new agent's own start (Python + torch
import) before it asks to join. The kill-and-grow timeline (world size and step over
wall time) is plotted to ``benchmarks/results/recovery_cpu2_202611.png``.

Usage::

    .venv/bin/python benchmarks/bench_recovery.py            # all 3 events, twice
    .venv/bin/python benchmarks/bench_recovery.py --quick    # all 3 events, once
"""

from __future__ import annotations

import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common

EXAMPLE = _common.ROOT / "examples" / "imagenet" / "main.py"

PAT = {
    "failed": re.compile(r"Worker group FAILED|Detected \d+ new nodes"),
    "rdzv_start": re.compile(r"Rendezvous'ing worker group"),
    "rdzv_done": re.compile(r"Rendezvous complete for workers"),
    "start_group": re.compile(r"Starting worker group"),
    "worker_up": re.compile(r"world size (\d+) \(restart (\d+)"),
    "restored": re.compile(r"restored checkpoint step (\d+)"),
    "step": re.compile(r"\bstep (\d+) epoch (\d+) loss .*\(W=(\d+)\)"),
}


class LogWatcher(threading.Thread):
    """Tails every log file in a directory; records (time, agent, kind, match)."""

    def __init__(self, log_dir: Path, t0: float) -> None:
        super().__init__(daemon=True)
        self.log_dir, self.t0 = log_dir, t0
        self.events: list[tuple[float, int, str, tuple[str, ...]]] = []
        self._pos: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self._halt = threading.Event()
        self.lock = threading.Lock()

    def poll(self) -> None:
        now = time.monotonic() - self.t0
        for path in sorted(self.log_dir.glob("agent-*.log")):
            idx = int(path.stem.split("-")[1])
            with open(path, errors="replace") as f:
                f.seek(self._pos.get(path, 0))
                chunk = f.read()
                self._pos[path] = f.tell()
            if not chunk:
                continue
            text = self._partial.get(path, "") + chunk
            lines = text.split("\n")
            self._partial[path] = lines.pop()
            for line in lines:
                for kind, pat in PAT.items():
                    m = pat.search(line)
                    if m:
                        with self.lock:
                            self.events.append((now, idx, kind, m.groups()))
                        break

    def run(self) -> None:
        while not self._halt.is_set():
            self.poll()
            time.sleep(0.02)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.poll()

    def snapshot(self) -> list[tuple[float, int, str, tuple[str, ...]]]:
        with self.lock:
            return list(self.events)

    def last_step(self) -> int:
        steps = [int(g[0]) for _, _, k, g in self.snapshot() if k == "step"]
        return max(steps, default=0)

    def world_size(self) -> int | None:
        ws = [int(g[2]) for _, _, k, g in self.snapshot() if k == "step"]
        return ws[-1] if ws else None


def _wait(pred: Any, timeout: float, what: str, cluster: Any) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if cluster.all_exited():
            raise RuntimeError(f"all agents exited while waiting for {what}\n"
                               f"{cluster.logs()[-5000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{what} within {timeout}s\n{cluster.logs()[-5000:]}")


def committed(ckpt: Path) -> int:
    steps = [int(p.parent.name.split("-")[1]) for p in ckpt.glob("step-*/manifest.json")]
    return max(steps, default=-1)


def phases(events: list[tuple[float, int, str, tuple[str, ...]]], t_event: float,
           survivors: set[int], restart: int) -> dict[str, float]:
    """Phase end times (relative to t_event) of the recovery that starts at t_event."""
    after = [e for e in events if e[0] >= t_event]

    def first(kind: str, t_min: float, agents: set[int] | None = None,
              cond: Any = None) -> float:
        for t, a, k, g in after:
            if k == kind and t >= t_min and (agents is None or a in agents) and (
                    cond is None or cond(g)):
                return t
        raise LookupError(f"no {kind!r} line after t={t_min:.2f}")

    t_detect = first("failed", t_event, survivors)
    t_rdzv = max(first("rdzv_done", t_detect, {a}) for a in survivors)
    # not by restart count: scale-up restarts do not raise TORCHELASTIC_RESTART_COUNT,
    # and a joining agent's count starts at 0
    t_up = first("worker_up", t_rdzv)
    t_restored = first("restored", t_up)
    t_step = first("step", t_restored)
    return {"detect": t_detect - t_event, "rendezvous": t_rdzv - t_detect,
            "worker_start": t_up - t_rdzv, "restore": t_restored - t_up,
            "first_step": t_step - t_restored, "total": t_step - t_event}


def run_once(work: Path, data: Path, *, log_dir: Path, keep_logs: Path | None = None,
             monitor_interval: float = 0.1, fork: bool = False,
             rdzv_backend: str = "c10d", rdzv_endpoint: str | None = None) -> dict[str, Any]:
    from elastic_kit.local_cluster import LocalCluster

    ckpt = work / "ckpt"
    argv = [str(EXAMPLE), str(data), "-a", "tinycnn", "--image-size", "32", "-j", "0",
            "--epochs", "1000", "-b", "12", "--global-batch-size", "24", "--seed", "0",
            "-p", "1", "--checkpoint-every", "5", "--checkpoint-dir", str(ckpt),
            "--summary-json", str(work / "summary.json")]
    t0 = time.monotonic()
    watcher = LogWatcher(log_dir, t0)
    watcher.start()
    marks: list[dict[str, Any]] = []
    cluster = LocalCluster(argv, nnodes="1:3", max_restarts=5, log_dir=log_dir,
                           env={"OMP_NUM_THREADS": "1"}, monitor_interval=monitor_interval,
                           rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint,
                           torchrun_args=["--start-method=fork", "--run-path"] if fork else ())
    try:
        cluster.add_agent()
        cluster.add_agent()
        _wait(lambda: watcher.world_size() == 2 and committed(ckpt) >= 5, 180,
              "a 2-worker group past its first checkpoint", cluster)
        restart = 0

        def event(name: str, action: Any, survivors: set[int], w_after: int) -> None:
            nonlocal restart
            base = committed(ckpt)
            _wait(lambda: committed(ckpt) > base, 120, "a fresh checkpoint", cluster)
            step_at = watcher.last_step()
            t = time.monotonic() - t0
            action()
            restart += 1
            _wait(lambda: any(k == "step" and e >= t and int(g[2]) == w_after
                              for e, _, k, g in watcher.snapshot()
                              if any(k2 == "restored" and e2 >= t
                                     for e2, _, k2, _ in watcher.snapshot())),
                  180, f"training at W={w_after} after {name}", cluster)
            marks.append({"event": name, "t": t, "step_at_event": step_at,
                          "committed_at_event": committed(ckpt), "survivors": survivors,
                          "restart": restart, "w_after": w_after})

        a1 = cluster.agents[1]
        event("kill_worker", lambda: cluster.kill_worker(a1, sig=signal.SIGKILL), {0, 1}, 2)
        event("kill_node", lambda: cluster.kill_agent(a1), {0}, 1)
        event("add_node", lambda: cluster.add_agent(), {0}, 2)
        # a few steps at the new size for the plot
        s = watcher.last_step()
        _wait(lambda: watcher.last_step() >= s + 5, 60, "5 more steps", cluster)
    finally:
        cluster.close()
        watcher.stop()
        if keep_logs is not None:
            shutil.copytree(log_dir, keep_logs, dirs_exist_ok=True)
    events = watcher.snapshot()
    out = []
    for m in marks:
        ph = phases(events, m["t"], m["survivors"], m["restart"])
        restored = next(int(g[0]) for t, _, k, g in events if k == "restored" and t >= m["t"])
        out.append({"event": m["event"], "w_after": m["w_after"],
                    "step_at_event": m["step_at_event"], "restored_step": restored,
                    # a join restarts from a checkpoint taken after the event
                    "steps_redone": (m["step_at_event"] - restored
                                     if m["event"] != "add_node" else None),
                    **{k: round(v, 3) for k, v in ph.items()}, "t_event": round(m["t"], 3)})
    timeline = [(round(t, 3), int(g[0]), int(g[2])) for t, _, k, g in events if k == "step"]
    return {"events": out, "timeline": timeline}


def plot(run: dict[str, Any], png: str, fork: bool = False) -> str:
    """Plot one run's timeline to ``benchmarks/results/<png>``; returns its path."""
    plt = _common.pyplot()
    tl = run["timeline"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True,
                                   gridspec_kw={"height_ratios": [1, 2]})
    ax1.step([t for t, _, _ in tl], [w for _, _, w in tl], where="post", color="C1")
    ax1.set_ylabel("world size")
    ax1.set_ylim(0, 3.5)
    ax2.plot([t for t, _, _ in tl], [s for _, s, _ in tl], ".", ms=3, color="C0")
    ax2.set_ylabel("global step (rank 0 log)")
    ax2.set_xlabel("wall time (s) since the agents started")
    colors = {"detect": "C3", "rendezvous": "C4", "worker_start": "C2", "restore": "C5",
              "first_step": "C0"}
    for ev in run["events"]:
        t = ev["t_event"]
        for ax in (ax1, ax2):
            ax.axvline(t, color="k", lw=0.8, ls=":")
        ax1.text(t, 3.3, f" {ev['event']}\n {ev['total']:.1f} s", va="top", fontsize=8)
        for name in colors:
            ax2.axvspan(t, t + ev[name], color=colors[name], alpha=0.25, lw=0,
                        label=name if ev is run["events"][0] else None)
            t += ev[name]
    ax2.legend(loc="upper left", fontsize=8, title="recovery phases", title_fontsize=8)
    fig.suptitle("examples/imagenet under torchrun: SIGKILL worker, lose node, add node"
                 + (" (workers forked)" if fork else ""))
    fig.tight_layout()
    return _common.save_plot(fig, png)


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=None, help="scenario runs (default 2, quick 1)")
    ap.add_argument("--keep-logs", default=None, metavar="DIR", help="copy agent logs here")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--monitor-interval", type=float, default=0.1,
                    help="torchrun --monitor-interval (default 0.1, torchrun's own default)")
    ap.add_argument("--fork", action="store_true",
                    help="torchrun --start-method=fork --run-path: workers are forked from "
                         "the agent, which has torch imported already")
    ap.add_argument("--rdzv-backend", default="c10d", choices=["c10d", "etcd-v2"],
                    help="etcd-v2 starts a local etcd server (needs the etcd binary)")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    load0 = _common.load_avg()
    base = Path(tempfile.mkdtemp(prefix="ek-bench-recovery-"))
    runs = []
    try:
        data = base / "data"
        subprocess.run([sys.executable, "-m", "elastic_kit.data.make_imagefolder", str(data),
                        "--classes", "4", "--per-class", "150", "--val-per-class", "4",
                        "--size", "32", "--seed", "0"], check=True, capture_output=True)
        for i in range(repeats):
            etcd = None
            if args.rdzv_backend == "etcd-v2":
                from elastic_kit.local_cluster import EtcdServer

                etcd = EtcdServer(log_path=base / f"etcd{i}.log").start()
            try:
                runs.append(run_once(
                    base / f"run{i}", data, log_dir=base / f"run{i}" / "logs",
                    keep_logs=Path(args.keep_logs) / f"run{i}" if args.keep_logs else None,
                    monitor_interval=args.monitor_interval, fork=args.fork,
                    rdzv_backend=args.rdzv_backend,
                    rdzv_endpoint=etcd.endpoint if etcd is not None else None))
            finally:
                if etcd is not None:
                    etcd.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    names = [e["event"] for e in runs[0]["events"]]
    keys = ("detect", "rendezvous", "worker_start", "restore", "first_step", "total")
    summary = {n: {k: round(statistics.median(r["events"][i][k] for r in runs), 3) for k in keys}
               for i, n in enumerate(names)}
    res: dict[str, Any] = {
        "claim": "recovery",
        "scenario": "examples/imagenet tinycnn 32px -j 0, 2 torchrun agents x 1 worker, "
                    f"{args.rdzv_backend}, last_call_timeout=1, monitor "
                    f"{args.monitor_interval} s, checkpoint every 5 steps, workers "
                    + ("forked from the agent (--start-method=fork --run-path)" if args.fork
                       else "started as new Python processes (torchrun's default)"),
        "monitor_interval_s": args.monitor_interval,
        "fork": args.fork,
        "rdzv_backend": args.rdzv_backend,
        "repeats": repeats,
        "median_s": summary,
        "goal_total_s": 10.0,
        "kill_worker_total_s": summary["kill_worker"]["total"],
        "all_events_under_goal": all(e["total"] < 10.0 for r in runs for e in r["events"]),
        "runs": [r["events"] for r in runs],
        "load_avg_1m_start": load0,
    }
    res.update(_common.machine())
    for n in names:
        s = summary[n]
        print(f"  {n:<12} total {s['total']:5.2f} s = detect {s['detect']:.2f} + rendezvous "
              f"{s['rendezvous']:.2f} + worker start {s['worker_start']:.2f} + restore "
              f"{s['restore']:.2f} + first step {s['first_step']:.2f}")
    if not args.no_plot:
        res["plot"] = plot(runs[0], "recovery_fork_cpu2_202611.png" if args.fork
                           else "recovery_cpu2_202611.png", fork=args.fork)
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
