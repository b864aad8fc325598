"""Batch policies: what a world-size change does to the batch and the learning rate.

``fixed_global`` (:class:`FixedGlobalBatch`, the default) keeps the global batch
``G`` constant: each of the ``W`` ranks processes ``G / W`` samples per step in
micro-batches of at most ``micro_batch_size`` with gradient accumulation, and every
real sample's loss is weighted ``W / n_real`` (DDP averages gradients over ``W``), so
the update is the mean over the same ``n_real`` samples whatever ``W`` is.

``linear_lr`` (:class:`LinearLRScaling`) keeps the per-worker batch ``b``, so the
global batch is ``b * W``, and scales the learning rate by ``W / W0`` where ``W0`` is
the world size the run started with (stored in the :class:`TrainState`). The scale
is applied relative to the scale already baked into the restored optimizer and
scheduler state, so it never compounds across restarts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer

from elastic_kit._checks import check_int
from elastic_kit.errors import BatchPolicyError

__all__ = ["BatchPlan", "BatchPolicy", "FixedGlobalBatch", "LinearLRScaling", "make_policy"]


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is split at a given world size.

    Attributes:
        world_size: ``W``.
        global_batch: ``G``: samples (over all ranks) per full optimizer step.
        per_rank: ``G / W``: samples each rank processes per step (incl. padding).
        micro_batch: largest micro-batch a rank feeds the model at once.
        lr_scale: factor on the base learning rate for this world size.
    """

    world_size: int
    global_batch: int
    per_rank: int
    micro_batch: int
    lr_scale: float = 1.0

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per full step: ``ceil(per_rank / micro_batch)``."""
        return math.ceil(self.per_rank / self.micro_batch)


class BatchPolicy:
    """Base class: maps a world size (and the initial one) to a :class:`BatchPlan`."""

    name = "base"

    def plan(self, world_size: int, initial_world_size: int) -> BatchPlan:
        """The plan for ``world_size``; raises :class:`BatchPolicyError` if impossible."""
        raise NotImplementedError


def _positive(name: str, value: Any) -> int:
    """``value`` as an int >= 1: ``TypeError`` for what is no int (numpy and torch
    integers are ints), :class:`BatchPolicyError` (a ``ValueError``) below 1."""
    try:
        return check_int(name, value, minimum=1)
    except ValueError as e:
        raise BatchPolicyError(f"{name}={value!r} must be a positive int") from e


@dataclass(frozen=True)
class FixedGlobalBatch(BatchPolicy):
    """Keep the global batch ``global_batch_size`` at every world size.

    Args:
        global_batch_size: ``G``, samples per optimizer step over all ranks.
        micro_batch_size: ``m``, the most samples one rank feeds the model at once
            (its memory limit); a rank runs ``ceil((G / W) / m)`` micro-batches.

    Raises:
        BatchPolicyError: when ``G`` is not a multiple of the world size.
    """

    global_batch_size: int
    micro_batch_size: int
    name = "fixed_global"

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_batch_size",
                           _positive("global_batch_size", self.global_batch_size))
        object.__setattr__(self, "micro_batch_size",
                           _positive("micro_batch_size", self.micro_batch_size))

    def valid_world_sizes(self, limit: int | None = None) -> list[int]:
        """The world sizes that divide ``global_batch_size`` (up to ``limit``)."""
        g = self.global_batch_size
        return [w for w in range(1, (limit or g) + 1) if g % w == 0]

    def plan(self, world_size: int, initial_world_size: int) -> BatchPlan:
        g = self.global_batch_size
        world_size = check_int("world_size", world_size)  # a numpy or torch int too
        if world_size < 1 or g % world_size:
            raise BatchPolicyError(
                f"global_batch_size={g} is not divisible by world size {world_size}; "
                f"fixed_global needs a world size in {self.valid_world_sizes()} "
                f"(or choose a global batch size that is a multiple of {world_size}, "
                f"or the linear_lr policy)"
            )
        per_rank = g // world_size
        return BatchPlan(world_size, g, per_rank, min(self.micro_batch_size, per_rank), 1.0)


@dataclass(frozen=True)
class LinearLRScaling(BatchPolicy):
    """Keep the per-worker batch; scale the learning rate by ``W / W0``.

    Args:
        batch_size: samples per rank per optimizer step.
        micro_batch_size: micro-batch for gradient accumulation (default: ``batch_size``).
    """

    batch_size: int
    micro_batch_size: int | None = None
    name = "linear_lr"

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_size", _positive("batch_size", self.batch_size))
        if self.micro_batch_size is not None:
            object.__setattr__(self, "micro_batch_size",
                               _positive("micro_batch_size", self.micro_batch_size))

    def plan(self, world_size: int, initial_world_size: int) -> BatchPlan:
        world_size = _positive("world_size", world_size)
        initial_world_size = _positive("initial_world_size", initial_world_size)
        m = min(self.micro_batch_size or self.batch_size, self.batch_size)
        return BatchPlan(world_size, self.batch_size * world_size, self.batch_size, m,
                         world_size / initial_world_size)


def make_policy(name: str, *, global_batch_size: int | None, micro_batch_size: int,
                batch_size: int | None = None) -> BatchPolicy:
    """Build the policy called ``name`` (``"fixed_global"`` or ``"linear_lr"``)."""
    if name == "fixed_global":
        if global_batch_size is None:
            raise BatchPolicyError("batch_policy='fixed_global' needs global_batch_size")
        return FixedGlobalBatch(global_batch_size, micro_batch_size)
    if name == "linear_lr":
        return LinearLRScaling(batch_size or micro_batch_size, micro_batch_size)
    raise BatchPolicyError(
        f"batch_policy={name!r} is not one of 'fixed_global', 'linear_lr'")
