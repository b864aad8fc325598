"""Goodput under a seeded trace of failures: the pytorch/elastic example's way, elastic_kit
with durable checkpoints only, and elastic_kit with in-memory snapshots.

Claim: with in-memory snapshots a torchrun job loses at most a step of work per worker
kill or node loss, so its goodput on a trace of failures is well above the
pytorch/elastic example's way (>= 1.5x), and above durable checkpoints alone.

Scenario (on ``examples/imagenet/main.py``, the scenario and log parsing of
``bench_recovery.py``): two torchrun agents ("nodes", 1 worker each) on 127.0.0.1,
c10d rendezvous, ``-a tinycnn --image-size 32 -j 0``, a fixed global batch of 24 (25
steps per epoch). A seeded trace replays, each a random number of steps (1 to an
epoch) after training resumed from the previous event plus a random fraction of a
step: SIGKILL a worker, lose a node (SIGKILL an agent and its workers), a node joins.
Every setup ends when step :data:`END_STEP` is logged.

Setups, run in the same script with the same trace:

- ``pytorch_elastic``: the pytorch/elastic ImageNet example's way: a checkpoint per
  epoch and torchrun's default rendezvous settings (30 s last call, keep-alive 5 s x 3);
- ``durable``: elastic_kit as the README launches it (``--rdzv-conf`` of
  ``bench_recovery.RDZV_CONF``), a durable checkpoint every :data:`DURABLE_EVERY` steps;
- ``snapshots``: the same with the library's default ``--snapshot-every auto`` (the
  state in ``/dev/shm`` as often as costs at most 1% of the training time; it
  survives the group restart);
- ``snapshots_every_step``: ``--snapshot-every 1``: a snapshot after every step,
  whatever it costs (the automatic interval trades redone steps for overhead: with
  this tiny model's ~5 ms steps it snapshots every few steps).

Reported: goodput (the uninterrupted run's time from its first step to step
:data:`END_STEP`, divided by the setup's time for the same span), redone steps per
event and recovery seconds per event (the event to the first step after the restore),
and the ratios between the setups; a plot of step over wall time for the three.
The uninterrupted reference is the cheapest run: the ``pytorch_elastic`` setup
(no periodic checkpoints) without events, at world size 2 throughout (started with
the fast rendezvous settings: start-up is outside the measured span).

Usage::

    .venv/bin/python benchmarks/bench_goodput.py            # the three events, 3 setups
    .venv/bin/python benchmarks/bench_goodput.py --smoke    # one worker kill, 2 setups (no
                                                            # measurement: 1 s last call)
"""

from __future__ import annotations

import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common
import bench_recovery as rec

DURABLE_EVERY = 50
END_STEP = 110
SMOKE_END_STEP = 20

SETUPS: dict[str, dict[str, Any]] = {
    "pytorch_elastic": {"rdzv_conf": "", "checkpoint_every": 10**6, "fork": False},
    "durable": {"rdzv_conf": rec.RDZV_CONF, "checkpoint_every": DURABLE_EVERY, "fork": False},
    "snapshots": {"rdzv_conf": rec.RDZV_CONF, "checkpoint_every": DURABLE_EVERY, "fork": False,
                  "snapshot_every": "auto"},
    "snapshots_every_step": {"rdzv_conf": rec.RDZV_CONF, "checkpoint_every": DURABLE_EVERY,
                             "fork": False, "snapshot_every": 1},
}
#: --smoke runs these (each setup is a torchrun job of its own)
SMOKE_SETUPS = ("pytorch_elastic", "snapshots")


def span(run: dict[str, Any], end_step: int) -> float:
    """Seconds from the first logged step to the first time ``end_step`` is logged."""
    tl = run["timeline"]
    t_first = tl[0][0]
    t_end = next(t for t, s, _ in tl if s >= end_step)
    return t_end - t_first


def plot(runs: dict[str, dict[str, Any]], reference: dict[str, Any], png: str) -> str:
    plt = _common.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    t0 = reference["timeline"][0][0]
    ax.plot([t - t0 for t, _, _ in reference["timeline"]],
            [s for _, s, _ in reference["timeline"]], ".", ms=2, color="0.6",
            label="uninterrupted")
    for i, (name, run) in enumerate(runs.items()):
        t0 = run["timeline"][0][0]
        ax.plot([t - t0 for t, _, _ in run["timeline"]], [s for _, s, _ in run["timeline"]],
                ".", ms=2, color=f"C{i}", label=name)
        for ev in run["events"]:
            ax.axvline(ev["t_event"] - t0, color=f"C{i}", lw=0.6, ls=":")
    ax.set_xlabel("wall time (s) since the first step")
    ax.set_ylabel("global step (rank 0 log)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("examples/imagenet under torchrun, a seeded trace of failures")
    fig.tight_layout()
    return _common.save_plot(fig, png)


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random event moments")
    ap.add_argument("--events", default=None,
                    help=f"comma-separated, in order, of {','.join(rec.EVENTS)} (default all; "
                         "smoke: kill_worker)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    events = tuple((args.events or ("kill_worker" if args.smoke else ",".join(rec.EVENTS)))
                   .split(","))
    for e in events:
        if e not in rec.EVENTS:
            ap.error(f"--events: {e!r} is not one of {', '.join(rec.EVENTS)}")
    max_offset = 5 if args.smoke else rec.EPOCH_STEPS
    rng = random.Random(args.seed)
    offsets = [(rng.randint(1, max_offset), rng.random()) for _ in events]
    # every event happens before the end: it waits for at most its offset past the
    # highest step seen so far
    end_step = max(SMOKE_END_STEP if args.smoke else END_STEP,
                   2 + sum(n for n, _ in offsets) + 5)
    load0 = _common.load_avg()
    base = Path(tempfile.mkdtemp(prefix="ek-bench-goodput-"))
    runs: dict[str, dict[str, Any]] = {}
    try:
        data = base / "data"
        subprocess.run([sys.executable, "-m", "elastic_kit.testing.make_imagefolder", str(data),
                        "--classes", "4", "--per-class", "150", "--val-per-class", "4",
                        "--size", "32", "--seed", "0"], check=True, capture_output=True)
        # the rendezvous settings only change start-up, which the span leaves out
        ref_setup = {**SETUPS["pytorch_elastic"], "rdzv_conf": rec.RDZV_CONF}
        reference = rec.run_once(base / "reference", data,
                                 variant=rec.smoke_variant(ref_setup) if args.smoke else ref_setup,
                                 events=(), offsets=[], log_dir=base / "reference" / "logs",
                                 until_step=end_step)
        for name, setup in SETUPS.items():
            if args.smoke and name not in SMOKE_SETUPS:
                continue
            work = base / name
            runs[name] = rec.run_once(work, data, variant=rec.smoke_variant(setup)
                                      if args.smoke else setup, events=events,
                                      offsets=offsets, log_dir=work / "logs",
                                      until_step=end_step)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    t_ref = span(reference, end_step)
    per_setup: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        evs = run["events"]
        per_setup[name] = {
            "seconds_to_end": round(span(run, end_step), 2),
            "goodput": round(t_ref / span(run, end_step), 3),
            "redone_steps_per_event": round(statistics.mean(e["steps_redone"] for e in evs), 2),
            "recovery_s_per_event": round(statistics.mean(e["total"] for e in evs), 2),
            "events": [{k: e[k] for k in ("event", "step_at_event", "restored_step",
                                          "steps_redone", "total", "regain")} for e in evs],
        }

    def ratio(a: str, b: str, key: str) -> float | None:
        if a not in per_setup or b not in per_setup:  # not run (--smoke)
            return None
        x, y = per_setup[a][key], per_setup[b][key]
        return round(x / y, 3) if y else None

    res: dict[str, Any] = {
        "claim": "goodput",
        "baseline": "the pytorch/elastic example's way (a checkpoint per epoch, torchrun's "
                    "default rendezvous settings), same script, data and event trace; "
                    "goodput against an uninterrupted run of the same span",
        "events": list(events), "offsets": offsets, "end_step": end_step,
        "uninterrupted_seconds": round(t_ref, 2),
        "setups": per_setup,
        "ratio_goodput_snapshots_vs_pytorch_elastic": ratio("snapshots", "pytorch_elastic",
                                                             "goodput"),
        "ratio_goodput_snapshots_vs_durable": ratio("snapshots", "durable", "goodput"),
        "ratio_goodput_durable_vs_pytorch_elastic": ratio("durable", "pytorch_elastic",
                                                           "goodput"),
        "ratio_goodput_snapshots_every_step_vs_pytorch_elastic": ratio(
            "snapshots_every_step", "pytorch_elastic", "goodput"),
        "goal_goodput_ratio_vs_pytorch_elastic": 1.5,
        "goal_redone_steps_per_event": 1,
        "load_avg_1m_start": load0,
    }
    res.update(_common.machine())
    for name, s in per_setup.items():
        print(f"{name:<16} goodput {s['goodput']:.3f}  redone/event "
              f"{s['redone_steps_per_event']:.1f}  recovery/event {s['recovery_s_per_event']:.1f} s")
    if not args.no_plot and not args.smoke:
        res["plot"] = plot(runs, reference, "goodput_cpu2_202611.png")
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
