"""A distributed sampler whose epoch order does not depend on the world size.

torch's ``DistributedSampler`` shuffles the dataset and deals it out round-robin to
the ranks. That is fine while the world size is fixed, but an elastic job restarts
with a different number of workers in the middle of an epoch, and then it matters
*what* the position saved in a checkpoint means. torch's own
``torch.distributed.elastic.utils.data.ElasticDistributedSampler`` stores a
``start_index`` into the *unshuffled* dataset order and draws a fresh permutation of
the rest, so a resumed epoch repeats some samples and never shows others.

:class:`ElasticDistributedSampler` instead fixes one permutation of the whole dataset
per epoch (seeded by ``(seed, epoch)``, the same on every rank and for every world
size) and keeps one number, the *global* position in it: how many samples of the
epoch have been consumed by all ranks together. Whatever the world size after a
restart, the ranks deal out the rest of that same permutation, so every sample of
the epoch is trained on exactly once.

The remaining order ``rem = perm[consumed:]`` (length ``R``) is padded to a multiple
of the world size ``W`` by cycling ``rem`` from its start (or cut down to one when
``drop_last=True``), and rank ``r`` takes ``padded[r::W]``. Hence local position
``j`` of rank ``r`` is padding exactly when ``r + j * W >= R``, and a global batch of
``G`` samples (``G / W`` consecutive local indices per rank) is always the contiguous
chunk ``rem[k * G:(k + 1) * G]``, whatever ``W`` is.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from elastic_kit.distributed import get_dist_info
from elastic_kit.errors import CheckpointMismatchError

__all__ = ["ElasticDistributedSampler"]

log = logging.getLogger(__name__)

_STATE_KEYS = ("epoch", "consumed", "seed", "dataset_length", "shuffle", "drop_last")


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 64-bit generator seed that mixes ``seed`` and ``epoch``.

    torch's ``DistributedSampler`` seeds with ``seed + epoch``, so run ``seed=1``
    replays run ``seed=0`` shifted by one epoch. Hashing the pair makes every
    ``(seed, epoch)`` an unrelated stream.
    """
    digest = hashlib.blake2b(f"elastic_kit.sampler:{seed}:{epoch}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def _check_int(name: str, value: Any) -> int:
    # bool is an int subclass, but `rank=True` is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    return value


class ElasticDistributedSampler(Sampler[int]):
    """Shard a dataset over ranks so that an epoch resumes exactly at any world size.

    A drop-in for ``torch.distributed.elastic.utils.data.ElasticDistributedSampler``
    and ``torch.utils.data.DistributedSampler``: ``ElasticDistributedSampler(dataset)``
    takes the rank and world size from the initialized process group, else from the
    torchrun environment (``RANK``/``WORLD_SIZE``), else runs as rank 0 of 1.

    Each epoch has one permutation of the whole dataset, seeded by ``(seed, epoch)``
    and independent of the world size. :attr:`consumed` is the global position in
    it. The training loop calls :meth:`advance` with the number of samples every
    optimizer step consumed (over all ranks), and checkpoints :meth:`state_dict`. A
    worker group restarted with another world size loads that state and deals out
    exactly the samples not yet trained on.

    With ``drop_last=False`` the last ranks' shares are padded (by cycling the
    remaining order) so all ranks take the same number of steps; the padded
    positions are reported by :meth:`local_padding_mask` so the loop can give them
    zero weight and every sample counts exactly once per epoch.

    Args:
        dataset: anything with ``__len__``; its length is fixed at construction.
        num_replicas: world size; ``None`` reads it from the process group or the
            torchrun environment.
        rank: this worker's rank in ``[0, num_replicas)``; ``None`` as above.
        shuffle: permute the dataset each epoch (else the order is ``0..N-1``).
        seed: mixed with the epoch to seed the permutation; must be the same on
            every rank.
        drop_last: drop the tail of the epoch that does not fill one sample per rank
            instead of padding it.
        start_index: position in the epoch's *permutation* to start from (not an
            index into the dataset). It applies to the first epoch iterated: the
            current epoch (0), or the epoch given to the first :meth:`set_epoch`
            call, so ``start_index=k`` followed by ``set_epoch(e)`` starts epoch
            ``e`` at position ``k``.

    Example::

        sampler = ElasticDistributedSampler(dataset)   # rank/world from torchrun
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        start_epoch = 0
        if (state := load_checkpoint(...)) is not None:
            sampler.load_state_dict(state["sampler"])   # any world size
            start_epoch = sampler.epoch
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)    # same epoch as loaded: resumes mid-epoch
            for batch in loader:
                train_step(batch)
                sampler.advance(32 * sampler.num_replicas)   # after optimizer.step()
                maybe_save({"sampler": sampler.state_dict(), ...})

    .. warning::
        Call :meth:`advance` only for samples whose gradient reached an optimizer
        step, never when a batch is merely fetched: a ``DataLoader`` prefetches
        batches ahead of the training step, and counting those would skip them on a
        resume. Advance by the *real* samples of the step (the last global batch of
        an epoch may be partly padding; :attr:`remaining` caps it).

    .. warning::
        ``__iter__`` deals from the position current when iteration *starts*: the
        loader's iterator does not see :meth:`advance` calls made while it runs,
        which is what a training loop wants. Create a new iterator after
        :meth:`load_state_dict`.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        start_index: int = 0,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(
                f"dataset of type {type(dataset).__name__} has no __len__; "
                "ElasticDistributedSampler needs a map-style dataset of known length"
            )
        length = len(dataset)
        if length < 1:
            raise ValueError(
                f"dataset has length {length}; ElasticDistributedSampler needs at least 1 sample"
            )
        if num_replicas is None or rank is None:
            info = get_dist_info()
            num_replicas = info.world_size if num_replicas is None else num_replicas
            rank = info.rank if rank is None else rank
        num_replicas = _check_int("num_replicas", num_replicas)
        rank = _check_int("rank", rank)
        seed = _check_int("seed", seed)
        start_index = _check_int("start_index", start_index)
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        if not 0 <= start_index <= length:
            raise ValueError(
                f"start_index={start_index} is outside the epoch of a dataset of length "
                f"{length}; expected 0 <= start_index <= {length}"
            )
        self.dataset = dataset
        self.dataset_length: int = length
        self.num_replicas: int = num_replicas
        self.rank: int = rank
        self.shuffle: bool = bool(shuffle)
        self.seed: int = seed
        self.drop_last: bool = bool(drop_last)
        self.epoch: int = 0
        self.consumed: int = start_index
        # start_index belongs to the first epoch the user iterates, which a
        # torch-style loop names with set_epoch() right after construction.
        self._start_pending: bool = start_index > 0

    # -- position ---------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``: position 0 if it is a new epoch, unchanged if the same.

        Keeping the position for the same epoch is what makes the usual
        "load state, then ``set_epoch(epoch)`` at the top of the epoch loop" resume in
        the middle of the epoch.

        Args:
            epoch: the epoch number (mixed with ``seed`` to pick the permutation).
        """
        epoch = _check_int("epoch", epoch)
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be >= 0")
        if epoch != self.epoch:
            if not self._start_pending:
                self.consumed = 0
            self.epoch = epoch
        self._start_pending = False

    def advance(self, n: int) -> None:
        """Record that ``n`` more samples of this epoch were consumed over all ranks.

        Args:
            n: real (non-padding) samples that reached an optimizer step since the
                last call, summed over every rank.

        Raises:
            ValueError: when ``n`` is negative or would move past the end of the epoch.
        """
        n = _check_int("n", n)
        if n < 0:
            raise ValueError(f"advance(n={n}): n must be >= 0")
        if self.consumed + n > self.dataset_length:
            raise ValueError(
                f"advance(n={n}) moves past the end of the epoch: {self.consumed} of "
                f"{self.dataset_length} samples already consumed, {self.remaining} remain"
            )
        self.consumed += n
        self._start_pending = False

    @property
    def remaining(self) -> int:
        """Samples of the current epoch not yet consumed, over all ranks."""
        return self.dataset_length - self.consumed

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self) -> dict[str, int | bool]:
        """The position as plain Python ints and bools (safe for ``weights_only`` loads).

        The world size and rank are deliberately absent: the state means the same
        thing at any world size.
        """
        return {
            "epoch": int(self.epoch),
            "consumed": int(self.consumed),
            "seed": int(self.seed),
            "dataset_length": int(self.dataset_length),
            "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a sampler of any world size.

        ``seed`` and ``shuffle`` are taken from the state, since they define the
        order the saved position refers to; so is ``drop_last``. A difference from
        the constructor arguments is logged.

        Raises:
            CheckpointMismatchError: (a ``ValueError``) when the state comes from a
                dataset of another length.
            ValueError: when keys are missing or the position is out of range.
        """
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"sampler state is missing keys {missing}; expected keys {list(_STATE_KEYS)}"
            )
        length = int(state_dict["dataset_length"])
        if length != self.dataset_length:
            raise CheckpointMismatchError(
                f"sampler state was saved for a dataset of length {length}, but this "
                f"dataset has length {self.dataset_length}"
            )
        epoch, consumed = int(state_dict["epoch"]), int(state_dict["consumed"])
        if epoch < 0:
            raise ValueError(f"sampler state has epoch={epoch}; expected >= 0")
        if not 0 <= consumed <= length:
            raise ValueError(
                f"sampler state has consumed={consumed}; expected 0 <= consumed <= {length}"
            )
        for key in ("seed", "shuffle", "drop_last"):
            if state_dict[key] != getattr(self, key):
                log.warning(
                    "sampler state has %s=%r, constructor had %r: using the state's",
                    key, state_dict[key], getattr(self, key),
                )
        self.seed = int(state_dict["seed"])
        self.shuffle = bool(state_dict["shuffle"])
        self.drop_last = bool(state_dict["drop_last"])
        self.epoch = epoch
        self.consumed = consumed
        self._start_pending = False

    # -- the order --------------------------------------------------------------------

    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The global order of ``epoch`` (default: the current one), as int64.

        Identical on every rank and for every world size; ``arange`` when
        ``shuffle=False``.
        """
        epoch = self.epoch if epoch is None else _check_int("epoch", epoch)
        if not self.shuffle:
            return torch.arange(self.dataset_length, dtype=torch.int64)
        g = torch.Generator()
        g.manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(self.dataset_length, generator=g, dtype=torch.int64)

    def _local_length(self) -> int:
        r, w = self.remaining, self.num_replicas
        return r // w if self.drop_last else -(-r // w)

    @property
    def num_local_real(self) -> int:
        """Non-padding indices in this rank's share from the current position."""
        if self.drop_last:
            return self._local_length()
        r = self.remaining
        return max(0, -(-(r - self.rank) // self.num_replicas))

    def local_padding_mask(self) -> torch.Tensor:
        """Bool mask over :meth:`local_indices`: True where the index is padding.

        Position ``j`` is padding when ``rank + j * num_replicas >= remaining``, so at
        most one position per rank, always the last. Needs no permutation.
        """
        positions = torch.arange(self._local_length(), dtype=torch.int64)
        return positions.mul_(self.num_replicas).add_(self.rank) >= self.remaining

    def local_indices(self) -> torch.Tensor:
        """This rank's share of the rest of the epoch, padding included, as int64.

        Exactly what ``__iter__`` yields. Holds the permutation once plus this rank's
        ``1/num_replicas`` of it: the share is a strided slice of the permutation and
        only the (at most one element) padded tail is built separately.
        """
        rem_len, w, rank = self.remaining, self.num_replicas, self.rank
        length = self._local_length()
        if length == 0:
            return torch.empty(0, dtype=torch.int64)
        rem = self.permutation()[self.consumed:]
        n_real = self.num_local_real
        real = rem[rank::w][:n_real]
        if n_real == length:
            # With one replica this is a view of the permutation itself: no copy.
            return real.contiguous()
        # Padding cycles `rem` from its start: padded[p] = rem[p % R].
        pad_pos = torch.arange(n_real, length, dtype=torch.int64).mul_(w).add_(rank)
        return torch.cat([real, rem[pad_pos.remainder_(rem_len)]])

    def __iter__(self) -> Iterator[int]:
        return iter(self.local_indices().tolist())

    def __len__(self) -> int:
        """Indices this rank yields from the current position (padding included)."""
        return self._local_length()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dataset_length={self.dataset_length}, "
            f"num_replicas={self.num_replicas}, rank={self.rank}, epoch={self.epoch}, "
            f"consumed={self.consumed}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last})"
        )
