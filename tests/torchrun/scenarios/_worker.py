"""A small training script built on elastic_kit, for the torchrun integration scenarios.

Everything that makes it elastic is the library's, exactly as a user would wire it:

- :func:`elastic_kit.init_distributed` (gloo) and :func:`elastic_kit.wrap_ddp`;
- :class:`elastic_kit.TrainState` (model, ``torch.optim.SGD`` with momentum, sampler,
  step/epoch, history, sample audit, RNG states);
- :class:`elastic_kit.ElasticLoop` with a ``fixed_global`` :class:`LoopConfig`: the
  loop's :class:`~elastic_kit.ElasticDistributedSampler` deals each global batch of
  the epoch's permutation to however many ranks there are, with micro-batch gradient
  accumulation, zero-weighted padding on the epoch's short last step, periodic and
  epoch-end checkpoints (non-blocking unless ``--blocking-saves``), the SIGTERM
  checkpoint + exit 143, and the per-epoch sample audit (``audit="error"``);
- :class:`elastic_kit.CheckpointStore` on any fsspec URL (``s3://`` with
  ``--storage-options``), or node-local (``--node-local-checkpoints``: every node's
  local rank 0 writes its own directory, ``$EK_NODE_CHECKPOINT_DIR`` of its torchrun
  agent or a ``--checkpoint-dir`` containing ``{node_rank}``; on restore the newest
  step is broadcast from its holder and copied to the nodes that lack it).

The script adds only test plumbing: a tiny float64 MLP on a fixed synthetic regression
set, a 30 s collective timeout (``init_distributed`` recommends a short one: it is how
long survivors wait on a lost peer), an ``on_step_end`` hook that logs ``EKW step=...``
lines (for people reading the logs), sleeps ``--step-delay`` and calls the test's hold
point (``_hold.py``: every rank waits at the end of a chosen step until the test
releases it), ``--events`` (every rank appends one JSON line when its group starts
training, with the step it restored, and one when ``ElasticLoop.run`` exits, with
the step reached and the exit code: what the scenarios check instead of log
wording), ``--save-final``, the summary JSON rank 0 writes at the end (the same keys
as ``examples/imagenet/main.py``), and a test-only fault: ``--crash-in-save-at-step N --crash-marker PATH`` wraps
:meth:`Manifest.to_json` (``elastic_kit.store._manifest``), which the real checkpoint
writer calls after the payload is written and right before the manifest (the commit),
so the writer process dies with ``os._exit(1)`` inside the store's write of step N
(once: the marker file records that it happened).

Launch::

    torchrun --nnodes=1:3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 \\
        tests/torchrun/scenarios/_worker.py --checkpoint-dir /tmp/ck --summary-json /tmp/s.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic_kit as ek
from elastic_kit.store import CheckpointStore
from elastic_kit.checkpointer import CheckpointerConfig
from elastic_kit.loop import ElasticLoop, LoopConfig, StepInfo, TrainState

from _hold import hold_point  # this script's directory is on sys.path

log = logging.getLogger("ek_worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True,
                   help="fsspec URL or path of the CheckpointStore ({node_rank} allowed)")
    p.add_argument("--checkpoint-every", type=int, default=2, help="steps between saves")
    p.add_argument("--no-epoch-checkpoints", action="store_true",
                   help="no checkpoint at the end of each epoch (LoopConfig)")
    p.add_argument("--blocking-saves", action="store_true",
                   help="synchronous periodic checkpoints (default: background writes)")
    p.add_argument("--keep-last", type=int, default=0,
                   help="CheckpointStore keep_last (0: keep every checkpoint)")
    p.add_argument("--storage-options", default=None,
                   help="JSON dict of fsspec storage_options (s3 endpoint, credentials)")
    p.add_argument("--node-local-checkpoints", action="store_true",
                   help="CheckpointStore(node_local=True); the directory is "
                        "$EK_NODE_CHECKPOINT_DIR when set, else --checkpoint-dir")
    p.add_argument("--snapshot-every", default="auto",
                   help="in-memory snapshots (CheckpointerConfig.snapshot_every; the library's "
                        "default 'auto', or a number of steps, 0: off)")
    p.add_argument("--dataset-size", type=int, default=50)
    p.add_argument("--global-batch-size", type=int, default=6)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--collective-timeout", type=float, default=30.0,
                   help="init_distributed timeout (s): how long survivors can block on a "
                        "lost peer before failing so that torchrun restarts the group")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds to sleep after each step, so a test can act mid-run")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--events", default=None,
                   help="append JSON lines here: every rank's start and exit of ElasticLoop.run")
    p.add_argument("--save-final", default=None, help="torch.save the final parameters here")
    p.add_argument("--crash-in-save-at-step", type=int, default=None,
                   help="the checkpoint writer exits after the payload but before the "
                        "manifest of this step")
    p.add_argument("--crash-marker", default=None,
                   help="file created before the injected crash, so it happens once")
    return p.parse_args(argv)


def make_dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, 1, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, y)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # identical initial weights on every rank and every restart
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def param_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(ek.unwrap_model(model).state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def install_crash_in_save(step: int, marker: str) -> None:
    """Test-only fault: die inside the real CheckpointStore write of ``step``.

    ``write_checkpoint`` serializes the manifest (``Manifest.to_json``) only once the
    payload is fully written (uploaded, on an object store) and right before it
    writes the manifest, so exiting there leaves ``step-<n>/state.pt`` without a
    commit. Only a process that writes checkpoints ever calls it.
    """
    import importlib

    try:  # the module defining Manifest (private since the checkpoint package split)
        manifest_mod = importlib.import_module("elastic_kit.store._manifest")
    except ImportError:
        manifest_mod = importlib.import_module("elastic_kit.store.manifest")
    original = manifest_mod.Manifest.to_json

    def to_json(self: Any) -> str:
        if self.step == step and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(f"{os.getpid()}\n")
            log.error("EKW crash injected in save of step %d (payload written, no manifest)",
                      step)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return original(self)

    manifest_mod.Manifest.to_json = to_json  # type: ignore[method-assign]


def write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def append_event(path: str | None, **event: Any) -> None:
    """One JSON line, appended in a single write (the ranks share the file)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s: %(message)s")
    if args.crash_in_save_at_step is not None:
        if not args.crash_marker:
            raise SystemExit("--crash-in-save-at-step needs --crash-marker")
        install_crash_in_save(args.crash_in_save_at_step, args.crash_marker)

    info = ek.init_distributed(backend="gloo",
                               timeout=timedelta(seconds=args.collective_timeout))
    model = ek.wrap_ddp(make_model(args.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = TrainState(model, optimizer)
    dataset = make_dataset(args.dataset_size, args.seed)

    url = args.checkpoint_dir
    if args.node_local_checkpoints:
        url = os.environ.get("EK_NODE_CHECKPOINT_DIR", url)
    store = CheckpointStore(
        url, keep_last=args.keep_last or None, node_local=args.node_local_checkpoints,
        storage_options=json.loads(args.storage_options) if args.storage_options else None)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).sum(dim=1)  # one loss per sample

    started = {"logged": False}

    def log_restored() -> None:
        # Every rank says which step the store gave it (the node-local scenario checks
        # that all ranks restored the same, newest step). At the first step end the
        # loop's SIGTERM handling is installed, so a test may restart the group now.
        if not started["logged"]:
            started["logged"] = True
            log.info("EKW rank=%d world_size=%d restored step=%s", info.rank,
                     info.world_size, loop.restored_step)
            append_event(args.events, event="start", rank=info.rank,
                         world_size=info.world_size, restart=info.restart_count,
                         restored_step=loop.restored_step, pid=os.getpid())

    def on_step_end(state: TrainState, step: StepInfo) -> None:
        log_restored()
        if info.is_main:
            log.info("EKW step=%d world_size=%d loss=%.6f", step.step, step.world_size,
                     step.loss)
        if args.step_delay:
            time.sleep(args.step_delay)
        hold_point(step.step, step.world_size, info.rank)

    loop = ElasticLoop(
        state, dataset, loss_fn=loss_fn, store=store, on_step_end=on_step_end,
        config=LoopConfig(
            epochs=args.epochs, global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size, batch_policy="fixed_global",
            checkpoint=CheckpointerConfig(
                every_steps=args.checkpoint_every,
                save_at_epoch_end=not args.no_epoch_checkpoints,
                blocking=args.blocking_saves, audit="error",
                snapshot_every=(args.snapshot_every if args.snapshot_every == "auto"
                                else int(args.snapshot_every))),
            seed=args.seed, log_every=0, progress_bar=False))
    try:
        loop.run()  # SIGTERM: checkpoint, then SystemExit(143) so torchrun restarts the group
    except SystemExit as e:
        append_event(args.events, event="exit", rank=info.rank, world_size=info.world_size,
                     restart=info.restart_count, step=state.step, code=e.code,
                     pid=os.getpid())
        raise
    log_restored()
    append_event(args.events, event="exit", rank=info.rank, world_size=info.world_size,
                 restart=info.restart_count, step=state.step, code=0, pid=os.getpid())

    sha = param_sha256(model)
    if info.is_main:
        plain = ek.unwrap_model(model)
        if args.save_final:
            torch.save({k: v.detach().clone() for k, v in plain.state_dict().items()},
                       args.save_final)
        x, y = dataset.tensors
        with torch.no_grad():
            final_loss = float(((plain(x) - y) ** 2).mean())
        summary = {
            **state.run_report(),
            "param_sha256": sha,
            "global_batch_size": args.global_batch_size,
            "dataset_size": args.dataset_size,
            "final_loss": final_loss,
        }
        if args.summary_json:
            write_json_atomically(args.summary_json, summary)
        log.info("EKW done steps=%d sha=%s", state.step, sha)
    store.close()
    ek.destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
