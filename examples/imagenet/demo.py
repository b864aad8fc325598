"""The elastic_kit demo: one training job that loses a node and gains one, on one machine.

Run it with ``scripts/demo`` (sets up .venv first) or ``python examples/imagenet/demo.py``.

What happens, on 127.0.0.1 with every torchrun agent playing one "node":

1. a small ImageNet-style JPEG data set is generated (10 classes, 32x32);
2. two torchrun agents start ``examples/imagenet/main.py`` as one elastic job
   (``--nnodes=1:3``, c10d rendezvous, ``--max-restarts=5``);
3. after the first epoch a third agent joins: torchrun restarts the worker group at
   world size 3 and the script resumes from its newest checkpoint;
4. a while later the second agent is SIGKILLed with its whole process tree (a lost
   node; the first agent hosts the c10d store, so it is spared): the survivors fail,
   torchrun restarts them at world size 2 from the newest committed checkpoint;
5. the job finishes and the demo prints what happened from the run summary: world
   size over time, restarts, restore points, images/s, accuracy, and whether the
   per-epoch audit saw every image exactly once.

The global batch (48) divides by 2 and 3, so every step is the same 48 images at
either world size. Exit status: 0 when the job finished and every epoch's audit
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_kit.testing import LocalCluster, make_imagefolder, wait_for  # the launcher's harness

log = logging.getLogger("demo")

HERE = Path(__file__).resolve().parent


def newest_checkpoint(ckpt: Path) -> dict[str, Any] | None:
    """The manifest of the newest committed checkpoint in ``ckpt`` (None if none yet)."""
    manifests = sorted(ckpt.glob("step-*/manifest.json"))
    for m in reversed(manifests):
        try:
            return json.loads(m.read_text())
        except (OSError, ValueError):  # deleted by retention or being written: try older
            continue
    return None


def wait_for_checkpoint(ckpt: Path, cluster: LocalCluster, *, min_step: int,
                        world_size: int | None, timeout: float) -> dict[str, Any]:
    """Block until a checkpoint at ``min_step`` or later (saved at ``world_size``) exists."""
    found: dict[str, Any] = {}

    def ready() -> bool:
        m = newest_checkpoint(ckpt)
        if m and m["step"] >= min_step and world_size in (None, m.get("world_size")):
            found.update(m)
            return True
        return False

    wait_for(ready, timeout, what=f"a checkpoint at step >= {min_step} (world size "
             f"{world_size or 'any'})", abort_if=cluster.all_exited)
    return found


def print_report(summary: dict[str, Any], events: list[tuple[float, str]], seconds: float,
                 epochs: int, ok_exit: bool) -> bool:
    """Print what happened; True when the audit passed for every epoch."""
    audit = summary["audit"]
    audit_ok = len(audit) == epochs and all(
        a["ok"] and a["count"] == a["expected"] == summary["dataset_size"] for a in audit)
    print()
    print("=" * 72)
    print(f"elastic_kit demo: {summary['arch']}, {summary['dataset_size']} training images, "
          f"global batch {summary['global_batch_size']}, {summary['epochs']} epochs, "
          f"{summary['steps']} steps")
    print("-" * 72)
    print("what the demo did:")
    for t, what in events:
        print(f"  t={t:6.1f}s  {what}")
    print("world size over time (one line per start of the worker group):")
    for h in summary["world_sizes"]:
        src = (f"restored checkpoint step {h['restored_step']}" if h["restored_step"] is not None
               else "fresh start")
        print(f"  from step {h['step']:4d}: world size {h['world_size']}  "
              f"(torchrun restart #{h['restart']}, {src})")
    print(f"restarts of the worker group: {summary['restarts']}")
    print(f"restore points (checkpoint steps): {summary['restored_steps']}")
    print(f"training throughput: {summary['images_per_sec']:.1f} images/s (all workers)")
    print(f"final accuracy: top-1 {summary['final_top1']:.2f}%  top-5 {summary['final_top5']:.2f}%"
          f"  (best top-1 {summary['best_acc1']:.2f}%, chance 10%)")
    for a in audit:
        print(f"  epoch {a['epoch']}: {a['count']}/{a['expected']} images trained on, "
              f"{'each exactly once' if a['ok'] else 'AUDIT FAILED'}")
    print(f"sample audit: {'PASSED' if audit_ok else 'FAILED'}")
    print(f"parameters sha256: {summary['param_sha256']}")
    print(f"job: {'finished' if ok_exit else 'FAILED'} in {seconds:.0f}s")
    print("=" * 72)
    return audit_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None,
                        help="data, checkpoints and logs go here (default: a new temp dir)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--arch", default="tinycnn")
    parser.add_argument("--timeout", type=float, default=540.0,
                        help="give up (and fail) after this many seconds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s demo: %(message)s",
                        datefmt="%H:%M:%S")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="elastic_kit_demo-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, summary_path = work / "checkpoints", work / "summary.json"
    t0 = time.monotonic()
    events: list[tuple[float, str]] = []

    def event(what: str) -> None:
        events.append((time.monotonic() - t0, what))
        log.info(what)

    data = make_imagefolder(work / "data", classes=10, per_class=64, val_per_class=16,
                            size=32, seed=0)
    event(f"generated the data set in {data}")
    script = [
        str(HERE / "main.py"), "-a", args.arch, "--image-size", "32", "-j", "0",
        "--epochs", str(args.epochs), "-b", "16", "--global-batch-size", "48",
        "--lr", "0.02", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
        "-p", "10", "--summary-json", str(summary_path), str(data),
    ]
    steps_per_epoch = -(-640 // 48)
    deadline = t0 + args.timeout
    ok_exit = False
    with LocalCluster(script, nnodes="1:3", nproc_per_node=1, rdzv_backend="c10d",
                      max_restarts=5, rdzv_conf="last_call_timeout=1,join_timeout=60",
                      env={"OMP_NUM_THREADS": "1"}, log_dir=work / "logs") as cluster:
        try:
            cluster.add_agent()
            cluster.add_agent()
            event("started 2 torchrun agents (nodes 0 and 1), --nnodes=1:3, c10d")
            m = wait_for_checkpoint(ckpt, cluster, min_step=steps_per_epoch, world_size=None,
                                    timeout=deadline - time.monotonic())
            event(f"checkpoint step {m['step']} (world size {m['world_size']}) exists")
            cluster.add_agent()
            event("a third agent (node 2) joins: scale-up to world size 3")
            m = wait_for_checkpoint(ckpt, cluster, min_step=m["step"] + 1, world_size=3,
                                    timeout=deadline - time.monotonic())
            event(f"world size 3 is training (checkpoint step {m['step']})")
            m = wait_for_checkpoint(ckpt, cluster, min_step=m["step"] + 10, world_size=3,
                                    timeout=deadline - time.monotonic())
            event(f"checkpoint step {m['step']} saved at world size 3")
            cluster.kill_agent(cluster.agents[1])
            event("SIGKILLed agent 1 with all its workers (a lost node)")
            codes = cluster.wait(max(deadline - time.monotonic(), 1.0))
            # (agent 1's own status is not reported: it was killed, and reaped by the kill)
            event(f"agents 0 and 2 exited with status {codes[0]} and {codes[2]}")
            ok_exit = codes[0] == 0 and codes[2] == 0 and summary_path.exists()
        except (TimeoutError, RuntimeError) as e:
            event(f"demo failed: {e}")
        if not ok_exit:
            print(cluster.logs()[-8000:], file=sys.stderr)
    seconds = time.monotonic() - t0
    if not summary_path.exists():
        print(f"no run summary at {summary_path}; logs are in {work / 'logs'}", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    audit_ok = print_report(summary, events, seconds, args.epochs, ok_exit)
    print(f"logs: {work / 'logs'}   checkpoints: {ckpt}")
    return 0 if ok_exit and audit_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
