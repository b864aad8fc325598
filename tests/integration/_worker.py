"""A tiny elastic training script for the torchrun integration harness.

It stands in for ``examples/imagenet/main.py`` where the harness itself is tested (and
where a scenario needs a fault the example cannot be asked for, such as a crash in
the middle of a checkpoint write). It is deliberately self-contained: plain
``torch.distributed`` collectives, fsspec checkpoints with a manifest written last,
and the same summary JSON keys as the example, so scenarios assert the same things
on either script.

Training: a 2-layer MLP in float64 on a fixed regression set. Global batch ``k`` of an
epoch is always the same contiguous chunk of the epoch's permutation, each rank takes
a strided share of it, and the gradient is the all-reduced *sum* over the global batch
divided by its size: the trajectory is the same at any world size up to float
summation order, and bitwise the same at a fixed world size.

Launch::

    torchrun --nnodes=1:3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 \\
        tests/integration/_worker.py --checkpoint-dir /tmp/ck --summary-json /tmp/s.json
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import re
import signal
import sys
import time
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from torch import nn

from elastic_kit.distributed import all_reduce_max, broadcast_object, init_distributed

log = logging.getLogger("ek_worker")

_STEP_DIR = re.compile(r"step-(\d+)$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checkpoint-dir", required=True, help="fsspec URL or path")
    p.add_argument("--checkpoint-every", type=int, default=2, help="steps between saves")
    p.add_argument("--node-local-checkpoints", action="store_true",
                   help="each node writes its own dir, from $EK_NODE_CHECKPOINT_DIR")
    p.add_argument("--dataset-size", type=int, default=48)
    p.add_argument("--global-batch-size", type=int, default=6)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds to sleep per step, so a test can act mid-run")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--save-final", default=None, help="torch.save the final parameters here")
    p.add_argument("--crash-in-save-at-step", type=int, default=None,
                   help="rank 0 exits after the payload but before the manifest of this step")
    p.add_argument("--crash-marker", default=None,
                   help="local file created before the injected crash, so it happens once")
    return p.parse_args(argv)


class _Preempted:
    """SIGTERM sets a flag; the loop agrees on it across ranks at a step boundary."""

    def __init__(self) -> None:
        self.flag = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.flag = True


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, 1, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return x, y


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _final_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(((model(x) - y) ** 2).mean())


def param_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class Store:
    """``step-<N>/state.pt`` then ``step-<N>/manifest.json`` (the commit) on any fsspec URL."""

    def __init__(self, url: str) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.fs.makedirs(self.root, exist_ok=True)

    def steps(self) -> list[int]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            m = _STEP_DIR.search(e.rstrip("/"))
            if m and self.fs.exists(f"{self.root}/{m.group(0)}/manifest.json"):
                out.append(int(m.group(1)))
        return sorted(out)

    def save(self, state: dict[str, Any], step: int, *, crash_before_manifest: bool = False) -> None:
        d = f"{self.root}/step-{step:08d}"
        self.fs.makedirs(d, exist_ok=True)
        buf = io.BytesIO()
        torch.save(state, buf)
        payload = buf.getvalue()
        self.fs.pipe_file(f"{d}/state.pt", payload)
        if crash_before_manifest:
            log.error("EKW crash injected in save of step %d (payload written, no manifest)", step)
            logging.shutdown()
            os._exit(17)
        manifest = {"step": step, "size": len(payload),
                    "sha256": hashlib.sha256(payload).hexdigest(), "time": time.time()}
        self.fs.pipe_file(f"{d}/manifest.json", json.dumps(manifest).encode())

    def load(self, step: int) -> dict[str, Any]:
        d = f"{self.root}/step-{step:08d}"
        payload = self.fs.cat_file(f"{d}/state.pt")
        manifest = json.loads(self.fs.cat_file(f"{d}/manifest.json"))
        if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
            raise RuntimeError(f"checkpoint {d} does not match its manifest")
        return torch.load(io.BytesIO(payload), weights_only=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s: %(message)s")
    preempt = _Preempted()
    info = init_distributed(backend="gloo")
    rank, world = info.rank, info.world_size
    if args.global_batch_size % world:
        raise ValueError(f"--global-batch-size={args.global_batch_size} not divisible by "
                         f"world size {world}")

    url = args.checkpoint_dir
    if args.node_local_checkpoints:
        url = os.environ.get("EK_NODE_CHECKPOINT_DIR", url)
    store = Store(url)
    writer = info.is_local_main if args.node_local_checkpoints else info.is_main

    x, y = make_data(args.dataset_size, args.seed)
    model = make_model(args.seed)
    # Hand-written momentum SGD: constructing any torch.optim optimizer imports
    # torch._dynamo (2-5 s per worker start here), which every restart would pay.
    momentum = [torch.zeros_like(p) for p in model.parameters()]
    n, gb = args.dataset_size, args.global_batch_size
    steps_per_epoch = n // gb
    total_steps = steps_per_epoch * args.epochs

    # -- restore the newest state --------------------------------------------------
    state: dict[str, Any] | None = None
    if args.node_local_checkpoints:
        local = store.steps() if info.is_local_main else []
        mine = local[-1] if local else -1
        newest = all_reduce_max(mine)
        holder = -all_reduce_max(-rank if newest >= 0 and mine == newest else -(1 << 30))
        if newest >= 0:
            state = broadcast_object(store.load(newest) if rank == holder else None, src=holder)
            if writer and mine != newest:
                store.save(state, newest)
                log.info("EKW rank=%d copied step %d from rank %d to its node", rank, newest, holder)
            log.info("EKW rank=%d restored step %d from rank %d", rank, newest, holder)
    else:
        steps = store.steps() if rank == 0 else []
        newest = broadcast_object(steps[-1] if steps else -1, src=0)
        if newest >= 0:
            state = store.load(newest)
    if state is not None:
        model.load_state_dict(state["model"])
        for buf, saved in zip(momentum, state["momentum"]):
            buf.copy_(saved)
        step, counts = state["step"], state["counts"]
        audit, history = state["audit"], state["world_sizes"]
    else:
        step, counts, audit, history = 0, torch.zeros(n, dtype=torch.int64), [], []
    restored = step if state is not None else None
    history.append({"world_size": world, "step": step, "restart": info.restart_count,
                    "restored_step": restored})
    if rank == 0:
        log.info("EKW start world_size=%d restart=%d restored_step=%s", world,
                 info.restart_count, restored)

    def snapshot() -> dict[str, Any]:
        return {"model": model.state_dict(), "momentum": [b.clone() for b in momentum], "step": step,
                "counts": counts.clone(), "audit": list(audit), "world_sizes": list(history)}

    def save(crash: bool = False) -> None:
        if writer:
            store.save(snapshot(), step, crash_before_manifest=crash)
        dist.barrier()

    # -- train ----------------------------------------------------------------------
    while step < total_steps:
        epoch, pos = divmod(step, steps_per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        batch = perm[pos * gb:(pos + 1) * gb]
        mine_idx = batch[rank::world]
        model.zero_grad(set_to_none=False)
        loss = ((model(x[mine_idx]) - y[mine_idx]) ** 2).sum()
        loss.backward()
        local_counts = torch.zeros(n, dtype=torch.float64)
        local_counts[mine_idx] = 1.0
        flat = torch.cat([*(p.grad.reshape(-1) for p in model.parameters()), local_counts,
                          torch.tensor([1.0 if preempt.flag else 0.0], dtype=torch.float64)])
        dist.all_reduce(flat)
        off = 0
        for p in model.parameters():
            p.grad.copy_(flat[off:off + p.numel()].view_as(p) / gb)
            off += p.numel()
        counts += flat[off:off + n].round().long()
        stop = bool(flat[-1] > 0)
        with torch.no_grad():
            for p, buf in zip(model.parameters(), momentum):
                buf.mul_(0.9).add_(p.grad)
                p.sub_(args.lr * buf)
        step += 1
        if step % steps_per_epoch == 0:
            ok = bool((counts == 1).all())
            audit.append({"epoch": epoch, "count": int(counts.sum()), "expected": n, "ok": ok})
            if rank == 0:
                log.info("EKW audit epoch=%d count=%d ok=%s", epoch, int(counts.sum()), ok)
            counts = torch.zeros(n, dtype=torch.int64)
        if rank == 0:
            log.info("EKW step=%d world_size=%d loss=%.6f", step, world, loss.item())
        crash = (args.crash_in_save_at_step == step and rank == 0 and args.crash_marker
                 and not os.path.exists(args.crash_marker))
        if crash:
            open(args.crash_marker, "w").close()
        if stop or step % args.checkpoint_every == 0 or step == total_steps or crash:
            save(crash=bool(crash))
        if stop:
            if rank == 0:
                log.info("EKW preempted: saved step %d", step)
            if preempt.flag:
                log.info("EKW rank=%d exits on SIGTERM after saving step %d", rank, step)
                return 0
            preempt.flag = False
        if args.step_delay:
            time.sleep(args.step_delay)

    if rank == 0:
        sha = param_sha256(model)
        if args.save_final:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.save_final)
        summary = {
            "steps": step, "epochs": args.epochs, "world_sizes": history,
            "restarts": info.restart_count,
            "restored_steps": [h["restored_step"] for h in history if h["restored_step"] is not None],
            "audit": audit, "param_sha256": sha, "global_batch_size": gb, "dataset_size": n,
            "final_loss": _final_loss(model, x, y),
        }
        if args.summary_json:
            tmp = args.summary_json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=1)
            os.replace(tmp, args.summary_json)
        log.info("EKW done steps=%d sha=%s", step, sha)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
