"""How the loop feeds data: the scheduled indices in, collated micro-batches out.

The loop schedules the micro-batches of the rest of an epoch in the main process
(:class:`ScheduleBatchSampler`). A :class:`~elastic_kit.SeededDataset` (any dataset
whose ``takes_epoch_keys`` is true, as the sampler reads it) gets ``(epoch, index)`` keys, so data-loader workers, persistent or not, never hold a
stale epoch; any other dataset gets plain indices, exactly as under a ``DataLoader``
with a batch sampler. The audit counts samples from the schedule itself, so nothing
per sample travels with the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from elastic_kit.loop._seeded import SeededDataset

__all__ = ["EpochKeyed", "ScheduleBatchSampler", "loader_dataset", "to_device"]


class EpochKeyed(Dataset):
    """``ds[(epoch, i)] -> dataset[(epoch, i)]`` for a :class:`SeededDataset`: the
    epoch travels with the index to loader workers (and the sample is what the
    dataset returns for it: ``(index, sample)`` with ``return_index``)."""

    def __init__(self, dataset: SeededDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.dataset[key]


def loader_dataset(dataset: Any) -> tuple[Any, bool]:
    """The dataset the loop's ``DataLoader`` reads, and whether it takes epoch keys.

    Raises:
        ValueError: a :class:`SeededDataset` inside another dataset (a ``Subset``, a
            ``ConcatDataset``): it would get plain indices, and with them the epoch it
            was built with, so every epoch would augment as the first did.
    """
    if getattr(dataset, "takes_epoch_keys", False):
        return EpochKeyed(dataset), True
    inner = _nested_seeded(dataset)
    if inner is not None:
        raise ValueError(
            f"dataset={type(dataset).__name__} holds a SeededDataset "
            f"({type(inner).__name__}) inside it: the loop gives the epoch only to an "
            f"outermost SeededDataset, so wrap it outermost, e.g. "
            f"SeededDataset(Subset(data, indices), transform=...)")
    return dataset, False


def _nested_seeded(dataset: Any, depth: int = 0) -> Any:
    """A dataset taking epoch keys among those ``dataset`` wraps (``.dataset``,
    ``.datasets``: torch's ``Subset`` and ``ConcatDataset``), or None."""
    if depth > 8:
        return None
    inner = getattr(dataset, "datasets", None)
    children = list(inner) if isinstance(inner, (list, tuple)) else []
    if isinstance(getattr(dataset, "dataset", None), Dataset):
        children.append(dataset.dataset)
    for child in children:
        if getattr(child, "takes_epoch_keys", False):
            return child
        found = _nested_seeded(child, depth + 1)
        if found is not None:
            return found
    return None


class ScheduleBatchSampler:
    """Yields the micro-batches the loop scheduled (runs in the main process).

    :meth:`set` gives it this rank's local indices of the rest of an epoch and the
    ``(start, end)`` ranges of the micro-batches; a micro-batch is made only when the
    loader asks for it, so an ImageNet-sized epoch costs one index tensor, not a
    million Python objects.

    Args:
        keyed: yield ``(epoch, index)`` keys (for :class:`EpochKeyed`) instead of
            plain indices.
    """

    def __init__(self, keyed: bool = False) -> None:
        self.keyed = keyed
        self.epoch = 0
        self.indices = torch.zeros(0, dtype=torch.int64)
        self.ranges: list[tuple[int, int]] = []

    def set(self, epoch: int, indices: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        self.epoch, self.indices, self.ranges = epoch, indices, ranges

    def __iter__(self) -> Iterator[list[Any]]:
        epoch, indices = self.epoch, self.indices
        if self.keyed:
            for a, b in self.ranges:
                yield [(epoch, i) for i in indices[a:b].tolist()]
        else:
            for a, b in self.ranges:
                yield indices[a:b].tolist()

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
