"""Elastic ImageNet training with elastic_kit, run under torchrun.

The pytorch/elastic ImageNet example, made exactly resumable: step-level crash-safe
checkpoints on any fsspec URL, a sampler whose epoch order does not depend on the
world size, a global batch kept constant across world-size changes, per-sample
seeded augmentation and a per-epoch audit that every image was trained on once.

Make a small CPU-sized ImageNet-style data set first (or pass a real ImageNet root)::

    python -m elastic_kit.testing.make_imagefolder /tmp/tiny-imagenet --classes 10 \\
        --per-class 64 --size 64

Single node, 2 workers (``--standalone`` runs its own c10d rendezvous)::

    torchrun --standalone --nnodes=1 --nproc-per-node=2 examples/imagenet/main.py \\
        -a tinycnn --image-size 32 --epochs 3 -b 16 --global-batch-size 64 -j 0 \\
        --checkpoint-dir /tmp/ek-imagenet /tmp/tiny-imagenet

Fault tolerant, 2 nodes: run on each node; a failed worker restarts the group (up to
3 times) from the newest checkpoint::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 --nproc-per-node=1 \\
        --max-restarts=3 --rdzv-id=imagenet-1 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29400 \\
        --rdzv-conf=join_timeout=300,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        examples/imagenet/main.py -a resnet18 --checkpoint-dir s3://bucket/imagenet-1 \\
        --global-batch-size 256 -b 64 /data/imagenet

Elastic, 1 to 4 nodes (nodes may join or leave; ``--global-batch-size`` must divide by
every world size the job can take, here 1..4 x nproc)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:4 --nproc-per-node=1 \\
        --max-restarts=3 --rdzv-id=imagenet-2 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29400 \\
        --rdzv-conf=join_timeout=300,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        examples/imagenet/main.py -a resnet50 --global-batch-size 384 -b 64 \\
        --checkpoint-dir s3://bucket/imagenet-2 --checkpoint-every 500 /data/imagenet

etcd-v2 rendezvous (any node may die, including the first)::

    etcd --enable-v2=true --listen-client-urls http://0.0.0.0:2379 \\
        --advertise-client-urls http://ETCD_HOST:2379
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:4 --nproc-per-node=1 \\
        --max-restarts=3 --rdzv-id=imagenet-3 --rdzv-backend=etcd-v2 \\
        --rdzv-endpoint=ETCD_HOST:2379 \\
        --rdzv-conf=join_timeout=300,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        examples/imagenet/main.py -a resnet50 --batch-policy linear_lr -b 64 \\
        --checkpoint-dir /mnt/nfs/imagenet-3 /data/imagenet

``--rdzv-conf`` restarts fast: a 1 s last call (a node joining a little later waits for
the next round) and a lost node dropped after 3 keep-alives 1 s apart (so is an agent
stalled longer). ``--dummy`` trains on synthetic tensors instead of a data directory. ``-a tinycnn``
(no batch norm) makes CPU runs fast and, at one or two ranks, bitwise reproducible:
killed and restarted at the same world size, ``param_sha256`` in ``--summary-json``
equals an uninterrupted run's (at three or more, DDP's first step after a restart sums
the gradients in another order: equal to float rounding).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

import torch.distributed as dist

import elastic_kit as ek

log = logging.getLogger("imagenet")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _steps(text: str, auto: bool = True) -> int | str:
    """A number of steps >= 0 on the command line (0: off), or ``auto`` where allowed."""
    if not (text.isascii() and text.isdigit() or auto and text == "auto"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of steps >= 0"
                                         + (" or 'auto'" if auto else ""))
    return text if text == "auto" else int(text)


def _count(minimum: int) -> Any:
    """An argparse type: an int >= ``minimum``, refused at parse time (before any
    process group starts) with the flag's value named, not by a traceback later."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {minimum}")
        return value

    parse.__name__ = f"int>={minimum}"  # what argparse names in "invalid ... value"
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command line (the flags of the pytorch/elastic ImageNet example, plus ours)."""
    arch_names = ["tinycnn"] + sorted(torchvision.models.list_models(module=torchvision.models))
    p = argparse.ArgumentParser(description="Elastic ImageNet training (elastic_kit + torchrun)")
    p.add_argument("data", metavar="DIR", nargs="?", default=None,
                   help="dataset root with train/ and val/ (ImageFolder); not needed with --dummy")
    p.add_argument("-a", "--arch", metavar="ARCH", default="resnet18", choices=arch_names,
                   help="tinycnn (tiny, no batch norm: fast exact CPU runs) or any torchvision "
                        "model name (default: resnet18)")
    p.add_argument("-j", "--workers", default=4, type=_count(0), metavar="N",
                   help="data loading worker processes per rank (default: 4)")
    p.add_argument("--epochs", default=90, type=_count(0), metavar="N", help="epochs to run")
    p.add_argument("-b", "--batch-size", default=32, type=_count(1), metavar="N",
                   help="per-worker micro-batch (fixed_global) or per-worker batch (linear_lr)")
    p.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR",
                   dest="lr", help="initial learning rate (decays 10x every 30 epochs)")
    p.add_argument("--momentum", default=0.9, type=float, metavar="M")
    p.add_argument("--wd", "--weight-decay", default=1e-4, type=float, metavar="W",
                   dest="weight_decay")
    p.add_argument("-p", "--print-freq", default=10, type=_count(0), metavar="N",
                   help="log every N optimizer steps")
    p.add_argument("--dist-backend", default=None, choices=["nccl", "gloo"],
                   help="default: nccl with CUDA, gloo otherwise")
    p.add_argument("--checkpoint-file", default=None, metavar="PATH",
                   help="pytorch/elastic compatibility: the store is the directory PATH.d "
                        "(one per file name)")
    p.add_argument("--checkpoint-dir", default=None, metavar="URL",
                   help="checkpoint store: any fsspec URL (local, NFS, s3://, gs://, az://); "
                        "wins over --checkpoint-file; default "
                        "~/.cache/elastic_kit/imagenet/<TORCHELASTIC_RUN_ID>")
    p.add_argument("--checkpoint-every", default=100, type=lambda t: _steps(t, auto=False),
                   metavar="STEPS",
                   help="checkpoint every STEPS optimizer steps (and at every epoch end; "
                        "0: only there)")
    p.add_argument("--snapshot-every", default="auto", type=_steps, metavar="STEPS",
                   help="in-memory snapshots in /dev/shm every STEPS steps, which survive a "
                        "worker-group restart ('auto': within 1%% of training time; 0: off)")
    p.add_argument("--global-batch-size", default=256, type=_count(1), metavar="N",
                   help="samples per optimizer step over all workers (fixed_global); must "
                        "divide by every world size the job runs at")
    p.add_argument("--batch-policy", default="fixed_global", choices=["fixed_global", "linear_lr"],
                   help="fixed_global: same global batch and trajectory at any world size; "
                        "linear_lr: keep -b per worker, scale the LR with the world size")
    p.add_argument("--node-local-checkpoints", action="store_true",
                   help="every node writes its own disk; the newest is broadcast on restore")
    p.add_argument("--seed", default=0, type=int, help="model init, shuffling, augmentation")
    p.add_argument("--max-steps", default=None, type=_count(0), metavar="N",
                   help="stop after N global optimizer steps (checkpointed)")
    p.add_argument("--dummy", action="store_true", help="synthetic data instead of DIR")
    p.add_argument("--dummy-size", default=1281167, type=_count(1), metavar="N",
                   help="training samples with --dummy (validation: N/25)")
    p.add_argument("--image-size", default=224, type=_count(4), metavar="PX",
                   help="training crop side; validation resizes to PX*256/224 then crops PX")
    p.add_argument("--summary-json", default=None, metavar="PATH",
                   help="rank 0 writes a JSON run summary here at the end")
    return p


class TinyCNN(nn.Module):
    """Three conv layers, no batch norm: fast on a CPU and exactly reproducible."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def build_model(arch: str, num_classes: int) -> nn.Module:
    """``tinycnn`` or a randomly initialised torchvision model (no download)."""
    if arch == "tinycnn":
        return TinyCNN(num_classes)
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)


def build_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset, int]:
    """(train, val, num_classes); train's random augmentation runs unseeded here and
    is made a function of (seed, epoch, index) by the SeededDataset around it."""
    size = args.image_size
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([
        transforms.Resize(int(math.ceil(size * 256 / 224))), transforms.CenterCrop(size),
        transforms.ToTensor(), normalize])
    if args.dummy:
        n_val = max(args.dummy_size // 25, 1)
        train = torchvision.datasets.FakeData(args.dummy_size, (3, size, size), 1000,
                                              transform=transforms.ToTensor())
        val = torchvision.datasets.FakeData(n_val, (3, size, size), 1000,
                                            transform=transforms.ToTensor(),
                                            random_offset=args.dummy_size)
        return train, val, 1000
    root = Path(args.data)
    train = torchvision.datasets.ImageFolder(str(root / "train"), transform=train_tf)
    val = torchvision.datasets.ImageFolder(str(root / "val"), transform=val_tf)
    if train.classes != val.classes:
        raise ValueError(f"{root}/train and {root}/val have different classes: "
                         f"{len(train.classes)} vs {len(val.classes)}")
    return train, val, len(train.classes)


@torch.no_grad()
def validate(model: nn.Module, val_set: Dataset, *, batch_size: int, workers: int,
             device: torch.device) -> tuple[float, float]:
    """Top-1 / top-5 accuracy (%) over the whole validation set, sharded over ranks.

    Each rank evaluates its strided share; the sampler pads the shares to equal
    length, and padded positions are masked out, so every image counts exactly once
    whatever the world size; correct counts are summed over ranks.

    The counts live on ``device``, the worker's device: NCCL reduces only CUDA tensors,
    and counting there needs no device-to-host copy (a sync) per batch.
    """
    sampler = ek.ElasticDistributedSampler(val_set, shuffle=False)
    padding = sampler.local_padding_mask()
    cuda = device.type == "cuda"
    loader = DataLoader(val_set, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=cuda)
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # top1, top5, images
    pos = 0
    for images, target in loader:
        real = (~padding[pos:pos + len(target)]).to(device, non_blocking=cuda)
        pos += len(target)
        output = model(images.to(device, non_blocking=cuda))
        k = min(5, output.shape[1])
        hit = output.topk(k, dim=1).indices == target.to(device, non_blocking=cuda).view(-1, 1)
        counts[0] += (hit[:, :1].any(dim=1) & real).sum()
        counts[1] += (hit.any(dim=1) & real).sum()
        counts[2] += real.sum()
    model.train()
    if dist.is_initialized():
        dist.all_reduce(counts)
    counts = counts.cpu()
    total = max(float(counts[2]), 1.0)
    return 100.0 * float(counts[0]) / total, 100.0 * float(counts[1]) / total


def param_sha256(model: nn.Module) -> str:
    """SHA-256 over the raw bytes of every parameter and buffer, in state_dict order."""
    h = hashlib.sha256()
    for t in ek.unwrap_model(model).state_dict().values():
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checkpoint_url(args: argparse.Namespace, run_id: str) -> str:
    """Where the store lives: --checkpoint-dir, else ``<--checkpoint-file>.d`` (a store
    per file name: two experiments naming two files in one directory stay apart, and
    pytorch/elastic's ``/tmp/checkpoint.pth.tar`` does not make ``/tmp`` itself the
    store), else a directory per torchelastic run id (stable across restarts of one
    job) in this user's cache: not in /tmp, where another user could make the
    directory first and plant a checkpoint that the next run resumes from."""
    if args.checkpoint_dir:
        return args.checkpoint_dir
    if args.checkpoint_file:
        return os.path.abspath(args.checkpoint_file) + ".d"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "elastic_kit", "imagenet", run_id)


def write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    """Write then rename: a reader never sees half a file. The temporary file is
    created afresh under a random name (``O_EXCL``): in a directory other users can
    write (``/tmp``) nobody can plant a link there for this write to follow."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as open() would have made it (mkstemp: 0600)
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags, build data/model/optimizer, run the elastic loop, report on rank 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.data is None and not args.dummy:
        parser.error("the dataset directory DIR is required unless --dummy is given")
    info = ek.init_distributed(backend=args.dist_backend)
    logging.basicConfig(
        level=logging.INFO if info.is_main else logging.WARNING,
        format=f"%(asctime)s [rank {info.rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    if info.is_main:
        log.info("world size %d (restart %d, run %s) on %s, backend %s: %s", info.world_size,
                 info.restart_count, info.run_id, info.device, info.backend or "none",
                 vars(args))

    torch.manual_seed(args.seed)  # identical initial weights on every rank and restart
    train_set, val_set, num_classes = build_datasets(args)
    # Validation shards the set over the ranks: one smaller than the world size is
    # refused now (ValueError naming both), not after an epoch of training.
    ek.ElasticDistributedSampler(val_set, shuffle=False)
    model = ek.wrap_ddp(build_model(args.arch, num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    state = ek.TrainState(model, optimizer, scheduler=scheduler,
                       extras={"best_acc1": 0.0, "train_images": 0, "train_seconds": 0.0})

    url = checkpoint_url(args, info.run_id)
    if (info.is_main and not args.checkpoint_dir and not args.checkpoint_file
            and "TORCHELASTIC_RUN_ID" not in os.environ):
        log.warning("not under torchrun: checkpoints go to %s, which every run without "
                    "torchrun and --checkpoint-dir shares (this one resumes the last one's "
                    "state); pass --checkpoint-dir for a run of its own", url)
    store = ek.CheckpointStore(url, keep_last=3, node_local=args.node_local_checkpoints)
    # The best model goes to its own one-slot store: committed by manifest like any
    # checkpoint, so a crash while saving it never leaves a half-written "best".
    best_store = ek.CheckpointStore(url.rstrip("/") + "/best", keep_last=1,
                                 node_local=args.node_local_checkpoints)
    # The best top-1 the best store holds: a validation after the run's last
    # checkpoint (a --max-steps stop) raised it there, not in the checkpoint's extras.
    kept_best = max((float(i.metadata.get("acc1", 0.0)) for i in best_store.list()),
                    default=0.0)
    criterion = nn.CrossEntropyLoss(reduction="none")
    evals: dict[str, Any] = {"step": None, "top1": 0.0, "top5": 0.0}
    clock: dict[str, float | None] = {"t": None}

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        images, target = batch
        return criterion(model(images), target)

    def evaluate_and_keep_best(state: ek.TrainState) -> None:
        top1, top5 = validate(state.model, val_set, batch_size=args.batch_size,
                              workers=args.workers, device=info.device)
        evals.update(step=state.step, top1=top1, top5=top5)
        if info.is_main:
            log.info("validation at step %d: Acc@1 %.3f  Acc@5 %.3f", state.step, top1, top5)
        state.extras["best_acc1"] = max(state.extras["best_acc1"], kept_best)
        if top1 > state.extras["best_acc1"]:
            state.extras["best_acc1"] = top1
            best_store.save({"model": ek.unwrap_model(state.model).state_dict(),
                             "arch": args.arch, "acc1": top1, "acc5": top5},
                            step=state.step, metadata={"acc1": top1, "epoch": state.epoch})

    def on_step_end(state: ek.TrainState, step: ek.StepInfo) -> None:
        # Training throughput across restarts; the first step after a (re)start or an
        # epoch end is not timed, so restore and validation time are left out.
        now = time.monotonic()
        if clock["t"] is not None:
            state.extras["train_seconds"] += now - clock["t"]
            state.extras["train_images"] += step.samples
        clock["t"] = now

    def on_epoch_end(state: ek.TrainState, summary: ek.EpochSummary) -> None:
        evaluate_and_keep_best(state)
        clock["t"] = None

    loop = ek.ElasticLoop(
        state, ek.SeededDataset(train_set, seed=args.seed), loss_fn=loss_fn, store=store,
        config=ek.LoopConfig(
            epochs=args.epochs,
            global_batch_size=(args.global_batch_size if args.batch_policy == "fixed_global"
                               else None),
            micro_batch_size=args.batch_size, batch_policy=args.batch_policy,
            max_steps=args.max_steps,
            checkpoint=ek.CheckpointerConfig(every_steps=args.checkpoint_every or None,
                                             snapshot_every=args.snapshot_every),
            log_every=args.print_freq, seed=args.seed, num_workers=args.workers,
            persistent_workers=args.workers > 0, progress_bar=False,
            pin_memory=info.device.type == "cuda"),
        on_epoch_end=on_epoch_end, on_step_end=on_step_end)
    loop.run()

    # The run ended mid-epoch (max_steps), or restored a checkpoint taken after the end.
    if evals["step"] != state.step:
        evaluate_and_keep_best(state)
    digest = param_sha256(state.model)
    if info.is_main:
        secs, imgs = state.extras["train_seconds"], state.extras["train_images"]
        summary = {
            **state.run_report(),
            "final_top1": evals["top1"],
            "final_top5": evals["top5"],
            "best_acc1": state.extras["best_acc1"],
            "param_sha256": digest,
            "images_per_sec": imgs / secs if secs > 0 else loop.samples_per_second,
            "arch": args.arch,
            "global_batch_size": loop.plan.global_batch if loop.plan else args.global_batch_size,
            "dataset_size": len(train_set),
        }
        log.info("done: step %d, epoch %d, Acc@1 %.3f (best %.3f), %.1f images/s, params %s",
                 state.step, state.epoch, evals["top1"], state.extras["best_acc1"],
                 summary["images_per_sec"], digest[:16])
        if args.summary_json:
            write_json_atomically(args.summary_json, summary)
    store.close()
    best_store.close()
    ek.destroy_distributed()


if __name__ == "__main__":
    main()
