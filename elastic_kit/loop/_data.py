"""How the loop feeds data: ``(epoch, index)`` keys in, ``(ids, batch)`` out.

The loop schedules the micro-batches of the rest of an epoch in the main process
(:class:`ScheduleBatchSampler`); each key carries its epoch, so data-loader workers,
persistent or not, never hold a stale epoch, and every batch comes back with the
sample ids the audit needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from elastic_kit.loop._seeded import SeededDataset

__all__ = ["KeyedDataset", "CollateWithIds", "ScheduleBatchSampler", "to_device"]


class KeyedDataset(Dataset):
    """``ds[(epoch, i)] -> (i, sample)``: the epoch travels with the index to workers."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, Any]:
        epoch, index = key
        if isinstance(self.dataset, SeededDataset):
            return index, self.dataset.get(epoch, index)
        return index, self.dataset[index]


class CollateWithIds:
    """Collate ``(id, sample)`` pairs into ``(int64 ids, collate_fn(samples))``."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.collate_fn = collate_fn or default_collate

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[torch.Tensor, Any]:
        ids = torch.tensor([i for i, _ in items], dtype=torch.int64)
        return ids, self.collate_fn([s for _, s in items])


class ScheduleBatchSampler:
    """Yields the micro-batches of keys the loop scheduled (runs in the main process).

    :meth:`set` gives it this rank's local indices of the rest of an epoch and the
    ``(start, end)`` ranges of the micro-batches; the keys are made lazily, so an
    ImageNet-sized epoch costs one index tensor, not a million tuples.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.indices = torch.zeros(0, dtype=torch.int64)
        self.ranges: list[tuple[int, int]] = []

    def set(self, epoch: int, indices: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        self.epoch, self.indices, self.ranges = epoch, indices, ranges

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, indices = self.epoch, self.indices
        for a, b in self.ranges:
            yield [(epoch, i) for i in indices[a:b].tolist()]

    def __len__(self) -> int:
        return len(self.ranges)


def to_device(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    """Move every tensor in nested dicts/lists/tuples/namedtuples to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    return obj
