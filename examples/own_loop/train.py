"""Image classification with its own training loop, made elastic with ek.Checkpointer.

``plain_train.py`` made resumable: checkpoints every ``--checkpoint-every`` steps and
at every epoch end, a restart (a lost worker, a SIGTERM, a node joining or leaving)
resumes the newest one mid-epoch at any world size, and every sample of every epoch
is trained on exactly once. ``diff -u plain_train.py train.py`` is the whole change.

One process (CPU or one GPU), synthetic data; run it again to resume::

    python examples/own_loop/train.py --synthetic 2000 --epochs 3 -j 0 \\
        --checkpoint-dir /tmp/own-loop

One node, 2 workers (gloo on CPU, nccl on GPUs), restarted up to 3 times on a failure::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nnodes=1 \\
        --nproc-per-node=2 --max-restarts=3 examples/own_loop/train.py \\
        --synthetic 2000 --epochs 3 -j 0 --checkpoint-dir /tmp/own-loop-2 \\
        --checkpoint-every 20 --audit

Elastic, 1 to 4 nodes (run on every node; nodes may join or leave)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:4 --nproc-per-node=1 \\
        --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 --rdzv-id=own-loop-3 \\
        --rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        examples/own_loop/train.py /data/imagenet --arch resnet50 \\
        --checkpoint-dir /mnt/nfs/own-loop-3 --checkpoint-every 500

An ImageNet-style folder (``DIR/train/<class>/*.jpg`` and ``DIR/val/<class>/*.jpg``)::

    python -m elastic_kit.testing.make_imagefolder /tmp/tiny-imagenet --classes 10 \\
        --per-class 64 --size 64
    torchrun --standalone --nnodes=1 --nproc-per-node=2 examples/own_loop/train.py \\
        /tmp/tiny-imagenet --arch resnet18 --epochs 5 --checkpoint-dir /tmp/own-loop-4
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import elastic_kit as ek


def _steps(text: str, auto: bool = True) -> int | str:
    """A number of steps >= 0 on the command line (0: off), or ``auto`` where allowed."""
    if not (text.isascii() and text.isdigit() or auto and text == "auto"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of steps >= 0"
                                         + (" or 'auto'" if auto else ""))
    return text if text == "auto" else int(text)


def _positive(text: str) -> int:
    """An argparse type: an int >= 1 (refused at parse time, naming the value)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Image classification, own training loop")
    p.add_argument("data", nargs="?", metavar="DIR",
                   help="ImageFolder root with train/ and val/ (or use --synthetic)")
    p.add_argument("--synthetic", type=int, default=0, metavar="N",
                   help="train on N deterministic in-memory images of 10 classes instead of DIR")
    p.add_argument("--arch", default="tinycnn",
                   help="tinycnn (no batch norm: bitwise reproducible on CPU) or any "
                        "torchvision model name")
    p.add_argument("--image-size", type=int, default=32, metavar="PX")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("-b", "--batch-size", type=_positive, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay")
    p.add_argument("--warmup-steps", type=int, default=20, help="linear LR warm-up, in steps")
    p.add_argument("--clip-grad-norm", type=float, default=1.0, help="0 to turn off")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.99)
    p.add_argument("--checkpoint-dir", default=None, metavar="URL",
                   help="checkpoint store: a directory or fsspec URL (s3://, gs://, ...)")
    p.add_argument("--checkpoint-every", type=lambda t: _steps(t, auto=False), default=100,
                   metavar="STEPS",
                   help="durable checkpoints every STEPS steps (0: only at epoch ends)")
    p.add_argument("--snapshot-every", type=_steps, default="auto", metavar="STEPS",
                   help="in-memory snapshots that survive a restart, every STEPS steps "
                        "('auto': within 1%% of the training time; 0: off)")
    p.add_argument("--audit", action=argparse.BooleanOptionalAction, default=False,
                   help="check at every epoch end that each sample was trained on once")
    p.add_argument("--seed", type=int, default=0, help="model init and shuffling")
    p.add_argument("-j", "--workers", type=int, default=4, help="data-loader processes per worker")
    p.add_argument("-p", "--print-freq", type=int, default=10, metavar="N",
                   help="print every N batches (0: never)")
    p.add_argument("--summary-json", default=None, metavar="PATH",
                   help="rank 0 writes steps, accuracy and parameter digests here at the end")
    return p


class TinyCNN(nn.Module):
    """Two conv layers and no batch norm: fast on a CPU and bitwise reproducible."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def build_model(arch: str, num_classes: int) -> nn.Module:
    if arch == "tinycnn":
        return TinyCNN(num_classes)
    import torchvision  # only here: importing it costs seconds per worker

    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)


def synthetic_datasets(n: int, size: int, classes: int = 10) -> tuple[Dataset, Dataset]:
    """``n`` training and ``n // 4`` validation images: a colour and a pattern per class,
    plus noise. The same on every rank and every run (its own generator, seed 0)."""
    g = torch.Generator().manual_seed(0)
    patterns = (torch.randn(classes, 3, 1, 1, generator=g)
                + 0.5 * torch.randn(classes, 3, size, size, generator=g))

    def draw(count: int) -> TensorDataset:
        labels = torch.randint(classes, (count,), generator=g)
        images = patterns[labels] + torch.randn(count, 3, size, size, generator=g)
        return TensorDataset(images, labels)

    return draw(n), draw(max(n // 4, 1))


def build_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset, int]:
    if args.synthetic:
        train_set, val_set = synthetic_datasets(args.synthetic, args.image_size)
        return train_set, val_set, 10
    if not args.data:
        raise SystemExit("give an image folder DIR or --synthetic N")
    from torchvision import datasets, transforms

    normalize = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(args.image_size * 8 // 7), transforms.CenterCrop(args.image_size),
        transforms.ToTensor(), normalize]))
    return train_set, val_set, len(train_set.classes)


@torch.no_grad()
def evaluate(model: nn.Module, val_set: Dataset, args: argparse.Namespace,
             device: torch.device, rank: int, world_size: int) -> float:
    """Top-1 accuracy (%) on the validation set, each rank taking a share; every
    image counts once."""
    sampler = ek.ElasticDistributedSampler(val_set, num_replicas=world_size, rank=rank,
                                           shuffle=False)
    padding = sampler.local_padding_mask().to(device)  # repeats that even out the shares
    loader = DataLoader(val_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers)
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, images
    for i, (images, target) in enumerate(loader):
        images, target = images.to(device), target.to(device)
        real = ~padding[i * args.batch_size:i * args.batch_size + len(target)]
        correct = (model(images).argmax(1) == target) & real
        counts[0] += correct.sum()
        counts[1] += real.sum()
    if dist.is_initialized():
        dist.all_reduce(counts)
    return 100.0 * counts[0].item() / max(counts[1].item(), 1.0)


def param_sha256(model: nn.Module) -> str:
    """SHA-256 over the raw bytes of the state_dict tensors, in order."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    info = ek.init_distributed()  # torchrun's environment; world size 1 without it
    rank, world_size, device = info.rank, info.world_size, info.device
    is_main = info.is_main  # the one process that prints
    if is_main:
        print(f"world size {world_size} on {device}: {vars(args)}", flush=True)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    train_set, val_set, num_classes = build_datasets(args)
    # evaluate() shards the validation set: one smaller than the world size fails here
    ek.ElasticDistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_set = ek.SeededDataset(train_set, seed=args.seed)  # resumes draw the same augmentation
    model = ek.wrap_ddp(build_model(args.arch, num_classes))  # to device, DDP if distributed
    model_without_ddp = ek.unwrap_model(model)
    ema = AveragedModel(model_without_ddp, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay),
                        use_buffers=True)
    sampler = ek.ElasticDistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                           shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers, pin_memory=device.type == "cuda")
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing, reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    warmup = max(args.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(  # stepped per batch
        optimizer, lambda step: min(1.0, (step + 1) / warmup))
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
    state = ek.TrainState(model, optimizer, scheduler=scheduler, scaler=scaler, sampler=sampler,
                          extras={"ema": ema, "best_acc1": 0.0})
    ckpt = ek.Checkpointer(state, args.checkpoint_dir,
                           every_steps=args.checkpoint_every or None,  # 0: at epoch ends
                           audit=args.audit, snapshot_every=args.snapshot_every)

    for epoch in range(ckpt.restore(), args.epochs):  # the newest checkpoint, if any
        sampler.set_epoch(epoch)  # keeps a restored position inside the epoch
        model.train()
        tic, seen = time.perf_counter(), 0
        for i, (images, target) in enumerate(loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            w = ckpt.sample_weights(len(images), device=device)  # W/n real samples, 0 padding
            with torch.autocast(device.type, enabled=scaler.is_enabled()):
                output = model(images)
                losses = criterion(output, target)
                loss = (losses * w).sum()  # DDP averages: the mean over the step's samples
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if args.clip_grad_norm > 0:
                scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            ema.update_parameters(model_without_ddp)
            ckpt.step(len(images))  # saves when due; after a SIGTERM saves and exits
            seen += len(images) * world_size
            if is_main and args.print_freq and i % args.print_freq == 0:
                toc = time.perf_counter()
                acc1 = 100.0 * (output.argmax(1) == target).float().mean().item()
                print(f"Epoch: [{epoch}] [{i}/{len(loader)}] loss {losses.mean().item():.4f} "
                      f"acc1 {acc1:.2f} lr {optimizer.param_groups[0]['lr']:.5f} "
                      f"samples/s {seen / (toc - tic):.1f}", flush=True)
                tic, seen = toc, 0

        acc1 = evaluate(model_without_ddp, val_set, args, device, rank, world_size)
        ema_acc1 = evaluate(ema.module, val_set, args, device, rank, world_size)
        best_acc1 = state.extras["best_acc1"] = max(state.extras["best_acc1"], acc1)
        if is_main:
            print(f"Epoch: [{epoch}] done: step {state.step}, Acc@1 {acc1:.2f} "
                  f"(EMA {ema_acc1:.2f}, best {best_acc1:.2f})", flush=True)
        ckpt.end_epoch()  # the epoch is done: checks the audit, saves
    ckpt.close()

    if is_main and args.summary_json:
        write_json_atomically(args.summary_json, {
            **state.run_report(), "best_acc1": state.extras["best_acc1"],
            "param_sha256": param_sha256(model_without_ddp),
            "ema_sha256": param_sha256(ema.module)})
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
