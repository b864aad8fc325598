"""Sending a loaded state from the rank that holds it to every other rank.

The pytorch/elastic example pickles the whole state into one blob and broadcasts
it, which holds the state about twice in memory on every rank. Here the state is
split into a *skeleton* (the nested structure with every dense tensor replaced by a
small :class:`TensorSpec`), sent with ``broadcast_object``, and the tensors, sent
one collective per tensor with ``broadcast_tensors`` into buffers the receivers
allocate from the specs. Peak memory is the state once plus one tensor of staging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import torch.distributed as dist

from elastic_kit.distributed import (
    all_reduce_, broadcast_object, broadcast_tensors, collective_device,
)
from elastic_kit.store._tree import leaves, map_tree

__all__ = ["TensorSpec", "split_tensors", "fill_tensors", "broadcast_state", "agree_on_holder",
           "target_device"]


@dataclass(frozen=True)
class TensorSpec:
    """Placeholder for tensor ``index`` in a skeleton: what a receiver must allocate."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _is_dense(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_quantized and t.numel() > 0


def split_tensors(state: Any, out: list[torch.Tensor]) -> Any:
    """The skeleton of ``state``; its dense tensors are appended to ``out`` in order.

    Sparse, quantized and empty tensors stay in the skeleton (they are small or rare).
    """
    def leaf(_: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and _is_dense(value):
            out.append(value)
            return TensorSpec(len(out) - 1, tuple(value.shape), value.dtype)
        return value

    return map_tree(state, leaf)


def fill_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`split_tensors`: put ``tensors`` back in place of the specs."""
    return map_tree(skeleton, lambda _, v: tensors[v.index] if isinstance(v, TensorSpec) else v)


def _specs(skeleton: Any) -> list[TensorSpec]:
    return [v for _, v in leaves(skeleton) if isinstance(v, TensorSpec)]


def target_device(map_location: Any) -> torch.device:
    """The one device received tensors go to, from a ``torch.load``-style map_location.

    Checkpoints store CPU tensors, so a dict map_location is looked up under ``"cpu"``,
    and a callable (``lambda storage, loc: storage``, ``... storage.cuda(rank)``) is
    asked once where a CPU storage goes: a broadcast load, or a snapshot read from a
    mapped file, deserializes nothing it could be applied to storage by storage.

    Raises:
        TypeError: a callable whose answer is not a storage (or None, as torch.load
            takes it: the CPU), or another type.
    """
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get("cpu", "cpu"))
    if callable(map_location):
        where = map_location(torch.UntypedStorage(0), "cpu")
        if where is None:
            return torch.device("cpu")
        device = getattr(where, "device", None)
        if isinstance(device, torch.device):
            return device
        raise TypeError(f"map_location={map_location!r} returned {where!r} for a CPU "
                        "storage; expected a storage (or None)")
    raise TypeError(f"map_location={map_location!r}: expected a device, a device string, "
                    "a dict (keyed by 'cpu') or a callable (storage, location)")


def _reduce_device() -> torch.device:
    return collective_device()  # this rank's GPU under NCCL, else the CPU


def agree_on_holder(local_step: int | None, rank: int, world_size: int, *,
                    failed: bool = False) -> tuple[int | None, int, int]:
    """Every rank learns the newest step any rank holds and the lowest rank holding it.

    Collective: every rank must call it. ``failed`` says this rank could not read its
    storage: every rank learns that some rank failed (third value: the lowest failed
    rank, or -1) in the same all-reduce, so no rank is left waiting in a collective
    that a failed peer never joins. Returns ``(step, src, failed_rank)``;
    ``(None, -1, ...)`` when no rank holds any checkpoint.
    """
    dev = _reduce_device()
    t = torch.tensor([-1 if local_step is None else local_step,
                      -rank if failed else -world_size], dtype=torch.int64, device=dev)
    all_reduce_(t, dist.ReduceOp.MAX)
    newest, failed_rank = int(t[0]), -int(t[1])
    failed_rank = -1 if failed_rank == world_size else failed_rank
    if newest < 0 or failed_rank >= 0:
        return (None if newest < 0 else newest), -1, failed_rank
    # max of -rank over the holders is minus the lowest holding rank.
    t = torch.tensor([-rank if local_step == newest else -world_size], dtype=torch.int64,
                     device=dev)
    all_reduce_(t, dist.ReduceOp.MAX)
    return newest, -int(t[0]), -1


def broadcast_state(state: Any, *, src: int, rank: int, device: torch.device) -> Any:
    """Send ``state`` from ``src`` to every rank; each rank returns its copy.

    Collective: every rank must call it; ``state`` is only read on ``src``. Receivers
    allocate their tensors on ``device``; ``broadcast_tensors`` stages each through
    the collective device (CUDA for NCCL) one at a time.
    """
    tensors: list[torch.Tensor] = []
    skeleton = split_tensors(state, tensors) if rank == src else None
    skeleton = broadcast_object(skeleton, src=src)
    if rank != src:
        tensors = [torch.empty(s.shape, dtype=s.dtype, device=device)
                   for s in sorted(_specs(skeleton), key=lambda s: s.index)]
    broadcast_tensors(tensors, src=src)
    return fill_tensors(skeleton, tensors)
