"""Recovery under torchrun after SIGKILL, node loss and a join: the documented fast
settings vs torchrun's defaults with the pytorch/elastic example's per-epoch checkpoints.

Claim (claim 4): after a worker is SIGKILLed, training is running again (first
optimizer step after the restore) in under 10 s on this machine, with the launch
settings the README documents; the time splits into detection, rendezvous, worker
start, restore; and fewer steps are redone than with per-epoch checkpoints.

Scenario (on ``examples/imagenet/main.py``): two torchrun agents ("nodes", 1 worker
each) on 127.0.0.1 form one elastic job (c10d rendezvous, ``--nnodes=1:3``,
``--max-restarts=5``, via :class:`elastic_kit.testing.LocalCluster`), training
``-a tinycnn --image-size 32 -j 0`` on a small synthetic image folder (25 steps per
epoch). Then, each at a random moment (a seeded random number of steps, 1 to an epoch,
after training resumed from the previous event, plus a random fraction of a step):

1. ``kill_worker``: SIGKILL agent 1's worker; torchrun restarts the group at W=2;
2. ``kill_node``: SIGKILL agent 1 and everything below it (a lost node); W=2 -> 1;
3. ``add_node``: start a new agent (a node joins); W=1 -> 2.

Departures (``--events preempt_node,add_node,freeze_node``; each acts on the newest
agent but the first, which hosts the rendezvous):

4. ``preempt_node``: that agent's own fake GCE metadata server
   (:class:`elastic_kit.testing.FakeMetadataServer`) announces a preemption 30 s
   ahead; 30 s later the agent and its workers are SIGKILLed if still there (the VM
   goes); ``leave_s``: announcement -> the agent gone; ``after_leave_s``: agent gone
   -> the survivors' first step; ``steps_redone`` counts from the last step before
   the agent was gone (training goes on during the notice);
5. ``freeze_node``: SIGSTOP that agent and its workers (a frozen VM, a kernel hang,
   a partition: sockets stay open).

Variants, interleaved (each repeat runs every variant with the same random moments):

- ``ours``: exactly the README's launch settings, ``--rdzv-conf=`` :data:`RDZV_CONF`
  (a 1 s last call, keep-alive every 1 s with 3 attempts), a checkpoint every
  :data:`CHECKPOINT_EVERY` steps and the example's default in-memory snapshots
  (``--snapshot-every auto``);
- ``ours_fork``: the same, launched the README's fast-restart way: ``python -m
  elastic_kit.run --preload torchvision ... --start-method=fork --run-path`` (workers
  forked from the agent, which has torch, ``torch._dynamo`` and torchvision imported);
- ``ours_launcher``: ``ours`` launched by ``python -m elastic_kit.run`` (torchrun's
  options unchanged, workers started as new processes): its agents read the
  rendezvous state every 0.1 s instead of torch's second (``--rdzv-poll`` sets it for
  launcher variants; ``--rdzv-poll 1`` is torch's poll);
- ``ours_launcher_torch_poll``: ``ours_launcher`` with torch's poll (``--rdzv-poll
  1``): what the poll alone changes;
- ``ours_no_departures``: ``ours`` without heartbeats or preemption notices
  (``ELASTIC_KIT_HEARTBEAT_TIMEOUT=0``, ``ELASTIC_KIT_CLOUD=none``): the library before
  it handled departures, the baseline of events 4 and 5;
- ``baseline``: what a user would otherwise run: torchrun's default rendezvous
  settings (30 s last call, keep-alive 5 s x 3, no ``--rdzv-conf``) and a checkpoint
  at the end of each epoch only (the pytorch/elastic example's frequency, no
  snapshots; the
  example script still saves on SIGTERM, which only helps the baseline).

Everything else (monitor interval 0.1 s, torchrun's default, the script, data, seeds)
is the same. The workers train on the CPU with gloo on any machine: the "nodes" share
one host, and ``LocalCluster`` hides its GPUs from them (NCCL would need a GPU per
rank); the forked variant's workers could use CUDA too (``elastic_kit.run`` keeps its
agent from poisoning forks). A thread tails every agent's log every 20 ms and timestamps each line;
the phases of each event come from those lines:

- ``detect``: event -> the first "Worker group FAILED" / "Detected N new nodes"
  line of a surviving agent;
- ``rendezvous``: -> the last agent's "Rendezvous complete";
- ``worker_start``: -> the example's first line of the new group ("world size W
  (restart r"): process start, Python and torch imports, process-group init;
- ``restore``: -> the loop's "restored checkpoint step N" (or "no checkpoint");
- ``first_step``: -> the first "step N" line after it (one optimizer step);
- ``total``: event -> that first step; ``steps_redone``: the last step logged before
  the event minus the restored step; ``regain``: event -> the first step beyond the
  one logged before the event (recovery plus redoing lost work).

Headline ratios (baseline / ours, > 1: ours recovers faster), per event:
``ratio_total_baseline_vs_ours`` and ``ratio_regain_baseline_vs_ours``; and
``ratio_total_ours_vs_ours_fork`` for the forked start,
``ratio_total_ours_vs_ours_launcher`` for the launcher's, and
``ratio_rendezvous_torch_poll_vs_launcher`` for its rendezvous poll alone. The kill-and-grow timeline is
plotted to ``benchmarks/results/recovery_cpu2_202611.png``.

On a GPU (``--device cuda``): one agent with one worker on GPU 0 (``--nnodes=1:1``, as
``torchrun --standalone --nproc-per-node=1``), the reference run's setting: ResNet-50 at
224 px, 64 images per step on synthetic data (``--dummy``), the example's default
checkpoint interval (every 100 steps) and ``--snapshot-every auto``; the event is
``kill_worker`` (its worker SIGKILLed, restarted at W=1) repeated :data:`GPU_KILLS`
times, the first after :data:`GPU_WARMUP_STEPS` steps (the one-off making of the
snapshot files is not what a kill costs). No survivor writes the last step there: the
steps redone are the snapshot interval's. The baseline checkpoints at epoch ends only
(200 steps). Goals: kill -> first step < 8 s (``ours``), < 4 s (``ours_fork``), and at
most one step redone on average. A machine without bytecode caches for torch (one
that sets ``PYTHONDONTWRITEBYTECODE=1``) compiles torch's sources in every new worker:
run there with ``env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc`` and
once before timing, as a user's machine has the caches.

Usage::

    .venv/bin/python benchmarks/bench_recovery.py            # 3 variants x 3 events, twice
    python3 benchmarks/bench_recovery.py --device cuda --quick --variants ours,ours_fork,baseline
    .venv/bin/python benchmarks/bench_recovery.py --quick    # 3 variants x 3 events, once
    .venv/bin/python benchmarks/bench_recovery.py --smoke    # ours + baseline, kill_worker only
    .venv/bin/python benchmarks/bench_recovery.py --quick --variants ours,ours_no_departures \
        --events preempt_node,add_node,freeze_node              # departures vs before
"""

from __future__ import annotations

import random
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
from typing import Any, Callable

import _common

EXAMPLE = _common.ROOT / "examples" / "imagenet" / "main.py"

# The README's, the example README's and the k8s manifests' --rdzv-conf
# (tests/tooling/test_k8s_manifests.py checks that they are the same).
RDZV_CONF = "join_timeout=300,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
CHECKPOINT_EVERY = 5
EPOCH_STEPS = 25  # 4 classes x 150 images / global batch 24
GOAL_S = 10.0
GPU_GOAL_S = 8.0  # kill -> first step, the default start; forked: 4 s
GPU_KILLS = 3
GPU_WARMUP_STEPS = 40
GPU_MAX_OFFSET = 30  # steps after training resumed before the next kill

VARIANTS: dict[str, dict[str, Any]] = {
    "ours": {"rdzv_conf": RDZV_CONF, "checkpoint_every": CHECKPOINT_EVERY, "fork": False,
             "snapshot_every": "auto", "departures": True},
    "ours_fork": {"rdzv_conf": RDZV_CONF, "checkpoint_every": CHECKPOINT_EVERY, "fork": True,
                  "snapshot_every": "auto", "departures": True, "launcher": True},
    "ours_launcher": {"rdzv_conf": RDZV_CONF, "checkpoint_every": CHECKPOINT_EVERY,
                      "fork": False, "snapshot_every": "auto", "departures": True,
                      "launcher": True},
    "ours_launcher_torch_poll": {"rdzv_conf": RDZV_CONF, "checkpoint_every": CHECKPOINT_EVERY,
                                 "fork": False, "snapshot_every": "auto", "departures": True,
                                 "launcher": True, "rdzv_poll": 1.0},
    "ours_no_departures": {"rdzv_conf": RDZV_CONF, "checkpoint_every": CHECKPOINT_EVERY,
                           "fork": False, "snapshot_every": "auto", "departures": False},
    # torchrun's defaults; only the epoch-end checkpoint (a period longer than an epoch)
    "baseline": {"rdzv_conf": "", "checkpoint_every": 10**6, "fork": False,
                 "departures": False},
}
EVENTS = ("kill_worker", "kill_node", "add_node")
DEPARTURES = ("preempt_node", "freeze_node")
NOTICE_S = 30.0  # GCE Spot's notice

PAT = {
    "failed": re.compile(r"Worker group FAILED|Detected \d+ new nodes"),
    "rdzv_start": re.compile(r"Rendezvous'ing worker group"),
    "rdzv_done": re.compile(r"Rendezvous complete for workers"),
    "start_group": re.compile(r"Starting worker group"),
    "worker_up": re.compile(r"world size (\d+) \(restart (\d+)"),
    "restored": re.compile(r"restored checkpoint step (\d+)|no checkpoint to restore: "
                           r"starting at step (\d+)"),
    "step": re.compile(r"\bstep (\d+) epoch (\d+) rank-0 loss .*\(W=(\d+)\)"),
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


def phases(events: list[tuple[float, int, str, tuple[str, ...]]], t_event: float,
           survivors: set[int]) -> dict[str, float]:
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


def _restored_step(groups: tuple[str | None, ...]) -> int:
    return int(next(g for g in groups if g is not None))


def run_once(work: Path, data: Path, *, variant: dict[str, Any], events: tuple[str, ...],
             offsets: list[tuple[int, float]], log_dir: Path, keep_logs: Path | None = None,
             monitor_interval: float = 0.1, rdzv_backend: str = "c10d",
             rdzv_endpoint: str | None = None, until_step: int | None = None,
             settle_steps: int = 3, cuda: bool = False) -> dict[str, Any]:
    """One scenario run of one variant; ``offsets[i]`` = (steps, fraction of a step)
    to wait after training resumed before event ``i``. The run ends ``settle_steps``
    past the last event, or at ``until_step`` when given (the time it is logged is
    ``t_end``). ``cuda``: the GPU scenario (one agent, one worker on GPU 0)."""
    from elastic_kit.testing import FakeMetadataServer, LocalCluster

    ckpt = work / "ckpt"
    if cuda:
        every = variant["checkpoint_every"] if variant["checkpoint_every"] > 10**5 else 100
        setting = ["--dummy", "--dummy-size", str(200 * 64), "-a", "resnet50",
                   "--image-size", "224", "-j", "4", "-b", "64", "--global-batch-size", "64",
                   "--checkpoint-every", str(every)]
    else:
        setting = [str(data), "-a", "tinycnn", "--image-size", "32", "-j", "0", "-b", "12",
                   "--global-batch-size", "24",
                   "--checkpoint-every", str(variant["checkpoint_every"])]
    argv = [str(EXAMPLE), *setting, "--epochs", "1000", "--seed", "0", "-p", "1",
            "--snapshot-every", str(variant.get("snapshot_every", 0)),
            "--checkpoint-dir", str(ckpt), "--summary-json", str(work / "summary.json")]
    fork = variant["fork"]
    launcher = bool(variant.get("launcher"))
    launcher_args = (["--preload", "torchvision"] if fork else []) + (
        ["--rdzv-poll", str(variant["rdzv_poll"])] if variant.get("rdzv_poll") else [])
    t0 = time.monotonic()
    watcher = LogWatcher(log_dir, t0)
    watcher.start()
    marks: list[dict[str, Any]] = []
    # The run is stopped, not finished, so its snapshots are not removed by the job:
    # keep them in a shared-memory directory of this run's own, removed below.
    shm = tempfile.mkdtemp(prefix="ek-bench-shm-",
                           dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    cluster = LocalCluster(argv, nnodes="1:1" if cuda else "1:3",
                           max_restarts=GPU_KILLS + 2 if cuda else 5, log_dir=log_dir,
                           env={"OMP_NUM_THREADS": "1", "ELASTIC_KIT_SNAPSHOT_DIR": shm,
                                **({"CUDA_VISIBLE_DEVICES": "0"} if cuda else {})},
                           cuda=cuda,
                           monitor_interval=monitor_interval,
                           rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint,
                           rdzv_conf=variant["rdzv_conf"],
                           torchrun_args=["--start-method=fork", "--run-path"] if fork else (),
                           launcher="elastic_kit.run" if launcher else "torch.distributed.run",
                           launcher_args=launcher_args if launcher else ())
    servers: dict[int, Any] = {}  # agent index -> its own metadata server

    def add_agent() -> Any:
        server = FakeMetadataServer("gce").start()
        env = {"ELASTIC_KIT_CLOUD": "gce", "ELASTIC_KIT_METADATA_URL": server.url}
        if not variant.get("departures", True):
            env = {"ELASTIC_KIT_CLOUD": "none", "ELASTIC_KIT_HEARTBEAT_TIMEOUT": "0"}
        agent = cluster.add_agent(env=env)
        servers[agent.index] = server
        return agent

    def newest() -> Any:  # the newest agent alive but the first (the rendezvous host)
        return max((a for a in cluster.alive_agents() if a.index != 0), key=lambda a: a.index)

    gone: dict[int, float] = {}

    def preempt() -> None:
        agent = newest()
        servers[agent.index].announce(NOTICE_S)

        def vm_goes() -> None:  # the agent leaves, or the VM goes at the notice's end
            try:
                agent.proc.wait(timeout=NOTICE_S)
            except subprocess.TimeoutExpired:
                cluster.kill_agent(agent)
            gone[agent.index] = time.monotonic() - t0
        threading.Thread(target=vm_goes, daemon=True).start()

    try:
        add_agent()
        if cuda:
            _wait(lambda: watcher.last_step() >= GPU_WARMUP_STEPS, 600,
                  f"{GPU_WARMUP_STEPS} steps on the GPU", cluster)
        else:
            add_agent()
            _wait(lambda: watcher.world_size() == 2 and watcher.last_step() >= 2, 240,
                  "a 2-worker group training", cluster)

        def event(i: int, name: str, action: Callable[[], Any], survivors: set[int],
                  w_after: int) -> None:
            steps, frac = offsets[i]
            target = watcher.last_step() + steps
            _wait(lambda: watcher.last_step() >= target, 240, f"step {target}", cluster)
            time.sleep(frac * 0.05)  # a random point inside the step (~50 ms here)
            step_at = watcher.last_step()
            t = time.monotonic() - t0
            action()
            _wait(lambda: any(k == "step" and e >= t and int(g[2]) == w_after
                              for e, _, k, g in watcher.snapshot()
                              if any(k2 == "restored" and e2 >= t
                                     for e2, _, k2, _ in watcher.snapshot())),
                  240, f"training at W={w_after} after {name}", cluster)
            marks.append({"event": name, "t": t, "step_at_event": step_at,
                          "survivors": survivors, "w_after": w_after,
                          "agent": max(gone, default=None) if name == "preempt_node" else None})

        a1 = cluster.agents[0 if cuda else 1]
        actions = {
            "kill_worker": (lambda: cluster.kill_worker(a1, sig=signal.SIGKILL),
                            {0} if cuda else {0, 1}, 1 if cuda else 2),
            "kill_node": (lambda: cluster.kill_agent(a1), {0}, 1),
            "add_node": (add_agent, {0}, 2),
            "preempt_node": (preempt, {0}, 1),
            "freeze_node": (lambda: cluster.kill_agent(newest(), signal.SIGSTOP), {0}, 1),
        }
        for i, name in enumerate(events):
            action, survivors, w_after = actions[name]
            event(i, name, action, survivors, w_after)
        # the steps redone after the last event, and a few more for the plot
        end = until_step if until_step is not None else (
            marks[-1]["step_at_event"] + settle_steps)
        # also a step past the last event's, trained after its restore (a fast restart
        # can otherwise reach ``until_step`` with redone steps only)
        _wait(lambda: watcher.last_step() >= end and (
            not marks or _regain(watcher.snapshot(), marks[-1]) is not None),
            600, f"step {end}", cluster)
    finally:
        cluster.close()
        watcher.stop()
        for server in servers.values():
            server.close()
        shutil.rmtree(shm, ignore_errors=True)
        if keep_logs is not None:
            shutil.copytree(log_dir, keep_logs, dirs_exist_ok=True)
    evs = watcher.snapshot()
    out = []
    for m in marks:
        extra: dict[str, Any] = {}
        if m["event"] == "preempt_node" and m["agent"] is not None:
            # training goes on during the notice: what is redone is counted from the
            # last step before the node was gone, not from the announcement
            t_gone = gone[m["agent"]]
            m["step_at_event"] = max((int(g[0]) for t, _, k, g in evs
                                      if k == "step" and m["t"] <= t < t_gone),
                                     default=m["step_at_event"])
            extra = {"leave_s": round(t_gone - m["t"], 3), "step_at_leave": m["step_at_event"]}
        ph = phases(evs, m["t"], m["survivors"])
        regain = _regain(evs, m)
        assert regain is not None, f"no step past {m['step_at_event']} after {m['event']}"
        restored, t_regain = regain
        if "leave_s" in extra:
            extra["after_leave_s"] = round(m["t"] + ph["total"] - t_gone, 3)
        out.append({"event": m["event"], "w_after": m["w_after"], **extra,
                    "step_at_event": m["step_at_event"], "restored_step": restored,
                    "steps_redone": max(m["step_at_event"] - restored, 0),
                    **{k: round(v, 3) for k, v in ph.items()},
                    "regain": round(t_regain - m["t"], 3), "t_event": round(m["t"], 3)})
    timeline = [(round(t, 3), int(g[0]), int(g[2])) for t, _, k, g in evs if k == "step"]
    return {"events": out, "timeline": timeline}


def _regain(evs: list[Any], mark: dict[str, Any]) -> tuple[int, float] | None:
    """``(restored step, time of the first step past the event's)`` after ``mark``'s
    restore, or None while training has not got past it."""
    restored = next(((t, g) for t, _, k, g in evs if k == "restored" and t >= mark["t"]), None)
    if restored is None:
        return None
    t_restored, g = restored
    t_regain = next((t for t, _, k, g2 in evs if k == "step" and t >= t_restored
                     and int(g2[0]) > mark["step_at_event"]), None)
    return None if t_regain is None else (_restored_step(g), t_regain)


def smoke_variant(variant: dict[str, Any]) -> dict[str, Any]:
    """``--smoke`` only checks that a scenario runs and reports: torchrun's default 30 s
    last call (the baseline's) would double its time, so it waits 1 s there too, and
    the workers are forked from the agent (no torch import per restart). No smoke
    figure is a measurement."""
    return {**variant, "rdzv_conf": variant["rdzv_conf"] or "last_call_timeout=1",
            "fork": True}


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
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated, of {','.join(VARIANTS)} (default all; smoke: "
                         "ours,baseline)")
    ap.add_argument("--events", default=None,
                    help=f"comma-separated, in order, of {','.join(EVENTS)} (default all; "
                         "smoke: kill_worker)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random kill moments")
    ap.add_argument("--keep-logs", default=None, metavar="DIR", help="copy agent logs here")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--monitor-interval", type=float, default=0.1,
                    help="torchrun --monitor-interval (default 0.1, torchrun's own default)")
    ap.add_argument("--rdzv-backend", default="c10d", choices=["c10d", "etcd-v2"],
                    help="etcd-v2 starts a local etcd server (needs the etcd binary)")
    ap.add_argument("--rdzv-poll", type=float, default=None, metavar="S",
                    help="elastic_kit.run's --rdzv-poll for the launcher variants that do "
                         "not set their own (default: the launcher's choice)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: the GPU scenario (one worker on GPU 0, ResNet-50 224 px, "
                         f"kill_worker x {GPU_KILLS}; see the module)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: CUDA is not available")
    # A time limit's SIGTERM runs the clean-up below (the agents, their workers), as
    # Ctrl-C does: left alone, a worker went on training until the machine was gone.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if cuda and args.events not in (None, "kill_worker"):
        ap.error("--device cuda: the only event is kill_worker (one agent)")
    repeats = args.repeats or (1 if args.quick or args.smoke else 2)
    variants = (args.variants or ("ours,baseline" if args.smoke else ",".join(VARIANTS))).split(",")
    events = tuple((args.events or ("kill_worker" if args.smoke else ",".join(EVENTS))).split(","))
    if cuda:
        events = ("kill_worker",) * (1 if args.smoke else GPU_KILLS)
    known = EVENTS + DEPARTURES
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if "ours" not in variants or not {"baseline", "ours_no_departures"} & set(variants):
        ap.error("--variants must include ours and baseline or ours_no_departures "
                 "(the ratios compare them)")
    for e in events:
        if e not in known:
            ap.error(f"--events: {e!r} is not one of {', '.join(known)}")
    max_offset = CHECKPOINT_EVERY if args.smoke else GPU_MAX_OFFSET if cuda else EPOCH_STEPS
    load0 = _common.load_avg()
    base = Path(tempfile.mkdtemp(prefix="ek-bench-recovery-"))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        data = base / "data"
        if not cuda:  # the GPU scenario trains on --dummy data
            subprocess.run([sys.executable, "-m", "elastic_kit.testing.make_imagefolder",
                            str(data), "--classes", "4", "--per-class", "150",
                            "--val-per-class", "4", "--size", "32", "--seed", "0"],
                           check=True, capture_output=True)
        for i in range(repeats):
            rng = random.Random(args.seed * 1000 + i)
            offsets = [(rng.randint(1, max_offset), rng.random()) for _ in events]
            order = variants if i % 2 == 0 else variants[::-1]  # interleaved
            for v in order:
                etcd = None
                if args.rdzv_backend == "etcd-v2":
                    from elastic_kit.testing import EtcdServer

                    etcd = EtcdServer(log_path=base / f"etcd-{v}{i}.log").start()
                try:
                    work = base / f"{v}{i}"
                    variant = dict(VARIANTS[v])
                    if variant.get("launcher") and args.rdzv_poll and not variant.get("rdzv_poll"):
                        variant["rdzv_poll"] = args.rdzv_poll
                    runs[v].append(run_once(
                        work, data, variant=smoke_variant(variant) if args.smoke
                        else variant, events=events, offsets=offsets,
                        log_dir=work / "logs",
                        keep_logs=Path(args.keep_logs) / f"{v}{i}" if args.keep_logs else None,
                        monitor_interval=args.monitor_interval, rdzv_backend=args.rdzv_backend,
                        rdzv_endpoint=etcd.endpoint if etcd is not None else None, cuda=cuda))
                finally:
                    if etcd is not None:
                        etcd.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    keys = ("detect", "rendezvous", "worker_start", "restore", "first_step", "total",
            "steps_redone", "regain")
    names = list(dict.fromkeys(events))  # an event repeated (the GPU's kills): one entry

    def of(v: str, e: str) -> list[dict[str, Any]]:
        return [ev for r in runs[v] for ev in r["events"] if ev["event"] == e]

    summary = {v: {e: {k: round(statistics.median(ev[k] for ev in of(v, e)), 3)
                       for k in keys + ("leave_s", "after_leave_s")
                       if all(k in ev for ev in of(v, e))}
                   for e in names} for v in variants}
    redone_mean = {v: {e: round(statistics.mean(ev["steps_redone"] for ev in of(v, e)), 3)
                       for e in names} for v in variants}

    def ratio(num: str, den: str, key: str) -> dict[str, float | None]:
        if num not in summary or den not in summary:
            return {e: None for e in names}
        return {e: (round(summary[num][e][key] / summary[den][e][key], 3)
                    if summary[den][e][key] else None) for e in names}

    res: dict[str, Any] = {
        "claim": "recovery",
        "baseline": "torchrun's default rendezvous settings (no --rdzv-conf) and a checkpoint "
                    "per epoch (the pytorch/elastic example), same script, data, kill moments",
        "scenario": (f"examples/imagenet resnet50 224px --dummy -j 4, batch 64, one torchrun "
                     f"agent x 1 worker on GPU 0, --nnodes=1:1, {GPU_KILLS} worker SIGKILLs at "
                     f"random steps (seed {args.seed}), the first after {GPU_WARMUP_STEPS}"
                     if cuda else
                     "examples/imagenet tinycnn 32px -j 0, 2 torchrun agents x 1 worker, "
                     f"{args.rdzv_backend}, --nnodes=1:3, monitor {args.monitor_interval} s, "
                     f"{EPOCH_STEPS} steps per epoch, kills at random steps (seed {args.seed})"),
        "device": args.device,
        "rdzv_conf_ours": RDZV_CONF,
        "checkpoint_every_ours": 100 if cuda else CHECKPOINT_EVERY,
        "variants": variants, "events": list(events),
        "monitor_interval_s": args.monitor_interval,
        "rdzv_backend": args.rdzv_backend,
        "repeats": repeats,
        "median": summary,
        "steps_redone_mean": redone_mean,
        "ratio_total_baseline_vs_ours": ratio("baseline", "ours", "total"),
        "ratio_regain_baseline_vs_ours": ratio("baseline", "ours", "regain"),
        "ratio_total_ours_vs_ours_fork": ratio("ours", "ours_fork", "total"),
        "ratio_total_ours_vs_ours_launcher": ratio("ours", "ours_launcher", "total"),
        "ratio_rendezvous_torch_poll_vs_launcher": ratio(
            "ours_launcher_torch_poll", "ours_launcher", "rendezvous"),
        "ratio_total_before_vs_ours": ratio("ours_no_departures", "ours", "total"),
        "ratio_regain_before_vs_ours": ratio("ours_no_departures", "ours", "regain"),
        "goal_total_s": GPU_GOAL_S if cuda else GOAL_S,
        "kill_worker_total_s": summary["ours"].get("kill_worker", {}).get("total"),
        "kill_worker_under_goal": all(e["total"] < (GPU_GOAL_S if cuda else GOAL_S)
                                      for e in of("ours", "kill_worker")),
        "runs": {v: [r["events"] for r in rs] for v, rs in runs.items()},
        "load_avg_1m_start": load0,
    }
    res.update(_common.machine())
    for v in variants:
        print(f"{v}:")
        for e in names:
            s = summary[v][e]
            print(f"  {e:<12} total {s['total']:6.2f} s = detect {s['detect']:.2f} + rendezvous "
                  f"{s['rendezvous']:.2f} + worker start {s['worker_start']:.2f} + restore "
                  f"{s['restore']:.2f} + first step {s['first_step']:.2f}; "
                  f"{s['steps_redone']:.0f} steps redone, regained in {s['regain']:.2f} s")
    if not args.no_plot and not args.smoke and not cuda:
        res["plot"] = plot(runs["ours"][0], "recovery_cpu2_202611.png")
        if "ours_fork" in runs:
            res["plot_fork"] = plot(runs["ours_fork"][0], "recovery_fork_cpu2_202611.png",
                                    fork=True)
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
