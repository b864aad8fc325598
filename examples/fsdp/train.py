"""A small transformer language model sharded with FSDP2, its own loop, made elastic.

Every block and the root are ``fully_shard``-ed, so parameters and AdamW's moments are
DTensors split over the ranks. ``ek.TrainState`` + ``ek.Checkpointer`` save them shard
by shard (each rank writes only its own shards; one manifest commits them) and a
restart at another world size reads back only the byte ranges each rank now owns,
checked against a digest of every tensor's global content. Under torchrun every rank
also keeps its shards in its node's memory (snapshots, streamed to the next node): a
restart after a lost node takes each range from whichever surviving node holds it. The data position and the
sample audit resume as for DDP; the global batch stays ``--global-batch`` at any world
size (``ckpt.sample_weights`` weights each real sample ``1/n`` of the step).

The data is generated: token sequences of a fixed random Markov chain, the same on
every rank and run, so the loss falls quickly and a run needs no download.

One process (CPU; run again to resume)::

    python examples/fsdp/train.py --epochs 1 --checkpoint-dir /tmp/fsdp-lm

Two workers, restarted on a failure (gloo on the CPU, nccl on GPUs)::

    torchrun --standalone --nproc-per-node=2 --max-restarts=3 examples/fsdp/train.py \\
        --epochs 2 --checkpoint-dir /tmp/fsdp-lm-2 --checkpoint-every 5 --audit

Elastic, 1 to 3 nodes (run on every node; nodes may join or leave)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:3 --nproc-per-node=1 \\
        --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29400 --rdzv-id=lm \\
        --rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3 \\
        examples/fsdp/train.py --checkpoint-dir /mnt/nfs/fsdp-lm --audit
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

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
    p = argparse.ArgumentParser(description="A small transformer LM with FSDP2, own loop")
    p.add_argument("--samples", type=int, default=480, help="generated sequences per epoch")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=_positive, default=24,
                   help="sequences per optimizer step over all workers (a multiple of the "
                        "world size)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--checkpoint-dir", default=None, metavar="URL",
                   help="checkpoint store: a directory or fsspec URL (shared by every node)")
    p.add_argument("--checkpoint-every", type=lambda t: _steps(t, auto=False), default=10,
                   metavar="STEPS",
                   help="durable checkpoints every STEPS steps (0: only at epoch ends)")
    p.add_argument("--snapshot-every", default="auto", metavar="STEPS", type=_steps,
                   help="in-memory snapshots of every rank's shards in /dev/shm every STEPS "
                        "steps, streamed to the next node ('auto': within 1%% of training "
                        "time under torchrun; 0: off)")
    p.add_argument("--audit", action=argparse.BooleanOptionalAction, default=False,
                   help="check at every epoch end that each sample was trained on once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-freq", type=int, default=5, metavar="N",
                   help="print every N steps (0: never)")
    p.add_argument("--summary-json", default=None, metavar="PATH",
                   help="rank 0 writes the run report here at the end")
    p.add_argument("--final-state", default=None, metavar="PATH",
                   help="rank 0 torch.saves the gathered full model state here at the end")
    return p


class MarkovTokens(Dataset):
    """``n`` token sequences of one random Markov chain (its own generator, ``seed``):
    sample ``i`` is the same on every rank, worker and run."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        # each token has four likely successors: learnable, not trivial
        successors = torch.randint(vocab, (vocab, 4), generator=g)
        tokens = torch.empty(n, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
        for t in range(seq_len):
            pick = torch.randint(4, (n,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.tokens[i]
        return seq[:-1], seq[1:]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP (no dropout: runs are reproducible)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no projection biases: the key bias cannot change the attention (softmax is
        # shift-invariant), so its gradient is rounding noise that AdamW would turn
        # into steps of the full learning rate
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), 1)
        x = self.embed(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def shard(model: LM) -> LM:
    """FSDP2: one ``fully_shard`` per block, then the root (embedding, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gathered model state (on rank 0; empty elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


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
    world, device = info.world_size, info.device
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of the "
                         f"world size {world}")
    if not dist.is_initialized():  # FSDP2 needs a process group, even of one
        # (on a GPU its collectives run on CUDA tensors: nccl, which gloo cannot take)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = shard(LM(args.vocab, args.dim, args.layers, args.heads, args.seq_len).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = MarkovTokens(args.samples, args.seq_len, args.vocab, seed=args.seed)
    sampler = ek.ElasticDistributedSampler(data, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler)
    state = ek.TrainState(model, optimizer, sampler=sampler)
    ckpt = ek.Checkpointer(state, args.checkpoint_dir,
                           every_steps=args.checkpoint_every or None,  # 0: at epoch ends
                           audit=args.audit, snapshot_every=args.snapshot_every)
    criterion = nn.CrossEntropyLoss(reduction="none")

    for epoch in range(ckpt.restore(), args.epochs):  # the newest checkpoint, if any
        sampler.set_epoch(epoch)  # keeps a restored position inside the epoch
        for i, (tokens, target) in enumerate(loader):
            tokens, target = tokens.to(device), target.to(device)
            w = ckpt.sample_weights(len(tokens), device=device)  # 1/n real, 0 padding
            logits = model(tokens)
            per_seq = criterion(logits.transpose(1, 2), target).mean(1)
            loss = (per_seq * w).sum()  # FSDP averages gradients over the ranks
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ckpt.step(len(tokens))  # saves when due; after a SIGTERM saves and exits
            if info.is_main and args.print_freq and i % args.print_freq == 0:
                print(f"Epoch: [{epoch}] [{i}/{len(loader)}] step {state.step} loss "
                      f"{per_seq.mean().item():.4f} (uniform {math.log(args.vocab):.2f})",
                      flush=True)
        ckpt.end_epoch()  # checks the audit, saves
    ckpt.close()

    final = full_state(model)
    if info.is_main:
        if args.final_state:
            Path(args.final_state).parent.mkdir(parents=True, exist_ok=True)
            torch.save(final, args.final_state)
        if args.summary_json:
            write_json_atomically(args.summary_json, state.run_report())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
