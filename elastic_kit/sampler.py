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
of the world size ``W`` by cycling the epoch's permutation from its start (or cut down
to one when ``drop_last=True``), and rank ``r`` takes ``padded[r::W]``. Hence local
position ``j`` of rank ``r`` is padding exactly when ``r + j * W >= R``, and a global
batch of ``G`` samples (``G / W`` consecutive local indices per rank) is always the
contiguous chunk ``rem[k * G:(k + 1) * G]``, whatever ``W`` is. The padding is the
same whichever position a pass started at: a run resumed mid-epoch at the same world
size puts the same samples through its last step as the uninterrupted run (the padding
has zero weight, but a model that mixes a batch's samples, as BatchNorm does, sees it).

A *pass* is what one ``__iter__`` deals: this rank's share from the position current
when it starts (``pass_start``); ``len()`` stays that pass's length while the loop
advances through it, as a ``DataLoader`` and progress loggers expect.
"""

from __future__ import annotations

import hashlib
import logging
import numbers
import operator
from collections.abc import Iterator, Mapping, Sized
from typing import Any, SupportsIndex

import torch
from torch.utils.data import DistributedSampler

from elastic_kit._checks import check_bool as _check_bool
from elastic_kit._checks import check_int as _check_int
from elastic_kit._checks import is_bool as _is_bool
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


def _state_int(key: str, value: Any) -> int:
    """An int-valued sampler state entry, with the key named when it is not one.

    Integer-valued floats are accepted (a state that went through JSON, say); any
    other float, a string or a bool would be adopted silently and crash much later.
    """
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = value.item()
        if isinstance(value, numbers.Real) and float(value).is_integer():
            return int(value)
    raise TypeError(
        f"sampler state {key!r}={value!r}: expected an int (numpy/torch integers and "
        f"integral floats are accepted), got {type(value).__name__}"
    )


def _state_bool(key: str, value: Any) -> bool:
    """A bool-valued sampler state entry (``0`` and ``1`` are accepted too)."""
    if _is_bool(value):
        return bool(value)
    if not isinstance(value, (str, bytes)):
        try:
            as_int = operator.index(value)
        except TypeError:
            as_int = None
        if as_int in (0, 1):
            return bool(as_int)
    raise TypeError(
        f"sampler state {key!r}={value!r}: expected a bool, got {type(value).__name__}"
    )


class ElasticDistributedSampler(DistributedSampler[int]):
    """Shard a dataset over ranks so that an epoch resumes exactly at any world size.

    A drop-in for ``torch.utils.data.DistributedSampler`` and
    ``torch.distributed.elastic.utils.data.ElasticDistributedSampler``: the same
    positional arguments, the same attributes (``num_replicas``, ``rank``, ``epoch``,
    ``shuffle``, ``seed``, ``drop_last``, ``num_samples``, ``total_size``), and
    integer-like arguments (numpy or torch integers) wherever an int is expected.
    It is a subclass of ``DistributedSampler``, so a framework that keeps a loader's
    sampler only when it is one (Lightning's ``use_distributed_sampler``, the
    default) keeps it instead of wrapping it in a second sharding sampler, which
    would train each rank on ``1 / world_size`` of its share.
    ``ElasticDistributedSampler(dataset)`` takes the rank and world size from the
    initialized process group, else from the torchrun environment
    (``RANK``/``WORLD_SIZE``), else runs as rank 0 of 1.

    Each epoch has one permutation of the whole dataset, seeded by ``(seed, epoch)``
    and independent of the world size. :attr:`consumed` is the global position in
    it. The training loop calls :meth:`advance` with the number of samples every
    optimizer step consumed (over all ranks), and checkpoints :meth:`state_dict`. A
    worker group restarted with another world size loads that state and deals out
    exactly the samples not yet trained on. A sampler that is never advanced behaves
    like ``DistributedSampler``: every pass deals the whole epoch.

    With ``drop_last=False`` the last ranks' shares are padded (by cycling the
    epoch's permutation from its start, wherever the pass began) so all ranks take
    the same number of steps; the padded positions are reported by
    :meth:`local_padding_mask` so the loop can give them zero weight and every sample
    counts exactly once per epoch.

    ``len(sampler)``, :attr:`num_samples` and :attr:`total_size` describe the pass
    dealt by the latest ``__iter__`` (starting at :attr:`pass_start`) and stay
    constant while :meth:`advance` moves the position through it; before the first
    pass after construction, :meth:`set_epoch` to a new epoch or
    :meth:`load_state_dict`, they describe the pass an ``__iter__`` would deal now.

    Args:
        dataset: anything with ``__len__``; its length is fixed at construction and
            must be at least 1 (torch's sampler deals nothing from an empty dataset;
            this one refuses it with a ``ValueError``: an epoch with no sample to
            count is a mistake the resume arithmetic would carry on silently), and
            at least ``num_replicas``: a dataset smaller than the world size (a
            validation set after the job grew, say) is refused with a ``ValueError``
            naming both, where ``DistributedSampler`` would deal some ranks only
            padding (or, with ``drop_last``, every rank nothing, every epoch).
        num_replicas: world size; ``None`` reads it from the process group or the
            torchrun environment.
        rank: this worker's rank in ``[0, num_replicas)``; ``None`` as above.
        shuffle: permute the dataset each epoch (else the order is ``0..N-1``).
        seed: mixed with the epoch to seed the permutation; must be the same on
            every rank.
        drop_last: drop the tail of the epoch that does not fill one sample per rank
            instead of padding it.
        start_index: keyword-only (torch's elastic sampler takes it fourth, where
            ``DistributedSampler`` has ``shuffle``). Position in the epoch's
            *permutation* to start from (not an index into the dataset). It applies
            to the first epoch iterated: the current epoch (0), or the epoch given to
            the first :meth:`set_epoch` call, so ``start_index=k`` followed by
            ``set_epoch(e)`` starts epoch ``e`` at position ``k``.

    Example::

        sampler = ElasticDistributedSampler(dataset)   # rank/world from torchrun
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        start_epoch = 0
        if (loaded := load_checkpoint(None, url)) is not None:
            sampler.load_state_dict(loaded.state["sampler"])   # any world size
            start_epoch = sampler.epoch
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)    # same epoch as loaded: resumes mid-epoch
            for batch in loader:
                train_step(batch)
                sampler.advance(min(32 * sampler.num_replicas, sampler.remaining))
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

    .. warning::
        Call :meth:`set_epoch` at the start of every epoch. A script that never calls
        it (torchvision's reference calls it only when distributed) and iterates again
        after advancing to the end of an epoch would get an empty pass every epoch.
        Instead, on a sampler whose epochs :meth:`set_epoch` never named, the sampler
        logs a warning ("set_epoch() was not called ...; starting epoch e+1") once and
        starts the next epoch at position 0 with that epoch's fresh permutation, so
        each epoch is still seen exactly once. Once :meth:`set_epoch` was called, a
        pass after the epoch's end deals the epoch's share again and moves nothing
        (an evaluation over the training loader before the next ``set_epoch``), as
        ``DistributedSampler`` does. A pass that starts at the end of an epoch right
        after :meth:`load_state_dict` or :meth:`set_epoch` (a checkpoint saved after
        the epoch's last step) is legitimately empty: the loop goes on to its
        end-of-epoch work.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: SupportsIndex | None = None,
        rank: SupportsIndex | None = None,
        shuffle: bool = True,
        seed: SupportsIndex = 0,
        drop_last: bool = False,
        *,
        start_index: SupportsIndex = 0,
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
        # torch's elastic sampler takes start_index fourth; here that is shuffle.
        shuffle = _check_bool(
            "shuffle", shuffle,
            "; the fourth positional argument is shuffle, as in DistributedSampler "
            "(start_index is keyword-only: start_index=...)",
        )
        seed = _check_int("seed", seed)
        drop_last = _check_bool("drop_last", drop_last)
        start_index = _check_int("start_index", start_index)
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas} must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        if length < num_replicas:
            raise ValueError(
                f"dataset has {length} sample{'s' if length != 1 else ''}, fewer than "
                f"num_replicas={num_replicas}; every rank needs at least one sample of "
                f"each epoch: use a dataset of at least {num_replicas} samples or at most "
                f"{length} rank{'s' if length != 1 else ''}"
            )
        if not 0 <= start_index <= length:
            raise ValueError(
                f"start_index={start_index} is outside the epoch of a dataset of length "
                f"{length}; expected 0 <= start_index <= {length}"
            )
        self.dataset = dataset
        # A dataset that takes ``(epoch, index)`` keys (ek.SeededDataset) gets them: its
        # per-sample randomness then knows the epoch in any loader worker, persistent
        # or not, and a resumed epoch draws what the uninterrupted one drew.
        self._epoch_keys: bool = bool(getattr(dataset, "takes_epoch_keys", False))
        self.dataset_length: int = length
        self.num_replicas: int = num_replicas
        self.rank: int = rank
        self.shuffle: bool = shuffle
        self.seed: int = seed
        self.drop_last: bool = drop_last
        self.epoch: int = 0
        self.consumed: int = start_index
        # start_index belongs to the first epoch the user iterates, which a
        # torch-style loop names with set_epoch() right after construction.
        self._start_pending: bool = start_index > 0
        self._pass_start: int = start_index
        # True once __iter__ has dealt a pass since the position was last set from
        # outside (construction, set_epoch to a new epoch, load_state_dict): len()
        # then describes that pass, not the shrinking rest of the epoch.
        self._pass_dealt: bool = False
        # True when a pass of this sampler reached the end of the epoch (advance()
        # through it, or an empty pass dealt there) since the position was last set
        # from outside: iterating again then means set_epoch() was forgotten.
        self._end_reached: bool = False
        self._warned_rollover: bool = False
        self._warned_same_epoch: bool = False
        # True once set_epoch() named an epoch: the script (or the checkpointer) moves
        # epochs, so a pass after an epoch's end repeats it instead of starting the next.
        self._epochs_named: bool = False

    # -- position ---------------------------------------------------------------------

    def set_epoch(self, epoch: SupportsIndex) -> None:
        """Move to ``epoch``: position 0 if it is a new epoch, unchanged if the same.

        Keeping the position for the same epoch is what makes the usual
        "load state, then ``set_epoch(epoch)`` at the top of the epoch loop" resume in
        the middle of the epoch, and lets a state saved after the epoch's last step
        resume into an empty pass followed by the loop's end-of-epoch work.

        Args:
            epoch: the epoch number (mixed with ``seed`` to pick the permutation); a
                numpy or torch integer is fine.
        """
        epoch = _check_int("epoch", epoch)
        if epoch < 0:
            raise ValueError(f"epoch={epoch} must be >= 0")
        if epoch != self.epoch:
            if not self._start_pending:
                self.consumed = 0
            self.epoch = epoch
            self._pass_start = self.consumed
            self._pass_dealt = False
        elif self._pass_ran_to_end():
            if not self._warned_same_epoch:
                self._warned_same_epoch = True
                log.warning(
                    "set_epoch(%d) keeps the position of epoch %d, which this sampler "
                    "has already consumed to the end, so the next pass yields nothing; "
                    "pass the next epoch's number (set_epoch(%d)) to start it",
                    epoch, epoch, epoch + 1,
                )
        self._end_reached = False
        self._start_pending = False
        self._epochs_named = True

    def advance(self, n: SupportsIndex) -> None:
        """Record that ``n`` more samples of this epoch were consumed over all ranks.

        Does not change ``len()``: the pass being iterated keeps its length.

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
        if n > 0 and self._pass_dealt and self._local_length(self.consumed) == 0:
            self._end_reached = True

    @property
    def remaining(self) -> int:
        """Samples of the current epoch not yet consumed, over all ranks."""
        return self.dataset_length - self.consumed

    @property
    def pass_start(self) -> int:
        """Global position at which the pass dealt by the latest ``__iter__`` began.

        Before any pass since construction, :meth:`set_epoch` to a new epoch or
        :meth:`load_state_dict`, the position those set. This rank's index within
        the pass being iterated is ``(consumed - pass_start) // num_replicas``, and
        ``local_indices(position=pass_start)`` is what the pass yields.
        """
        return self._pass_start

    @property
    def pass_dealt(self) -> bool:
        """Whether ``__iter__`` dealt a pass since the position was last set from
        outside (construction, :meth:`set_epoch` to a new epoch, :meth:`load_state_dict`).

        While it is False nothing iterates this sampler: a training step advanced
        through it then trained on samples of some other order (a DataLoader given
        ``shuffle=True`` or another sampler), which :class:`~elastic_kit.Checkpointer`
        refuses.
        """
        return self._pass_dealt

    @property
    def pass_length(self) -> int:
        """This rank's share of the pass from :attr:`pass_start`, padding included:
        ``len()`` of the pass being iterated, however far it was advanced."""
        return self._local_length(self._pass_start)

    @property
    def num_samples(self) -> int:
        """Indices this rank yields in the current pass (``DistributedSampler``'s meaning)."""
        return len(self)

    @property
    def total_size(self) -> int:
        """``num_samples * num_replicas``: the current pass over all ranks, padding included."""
        return len(self) * self.num_replicas

    def _pass_ran_to_end(self) -> bool:
        """Whether a non-empty pass of this sampler was advanced to the end of the epoch."""
        return self._rollover_due() and self._local_length(self._pass_start) > 0

    def _rollover_due(self) -> bool:
        """Whether the next ``__iter__`` must start the next epoch (set_epoch forgotten).

        Only when a pass of this sampler reached the end of the epoch, never right
        after the position was set from outside (construction, :meth:`set_epoch`,
        :meth:`load_state_dict`).
        """
        return self._end_reached and self._local_length(self.consumed) == 0

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

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Validate a :meth:`state_dict` for this sampler without adopting it.

        Returns the entries as plain ints and bools. :meth:`load_state_dict` calls it
        first; :class:`~elastic_kit.TrainState` calls it before loading anything, so
        a checkpoint that does not fit leaves the model untouched too.

        Raises:
            as :meth:`load_state_dict`.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"sampler state of type {type(state_dict).__name__}: expected a mapping "
                f"with keys {list(_STATE_KEYS)}"
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"sampler state is missing keys {missing}; expected keys {list(_STATE_KEYS)}"
            )
        length = _state_int("dataset_length", state_dict["dataset_length"])
        epoch = _state_int("epoch", state_dict["epoch"])
        consumed = _state_int("consumed", state_dict["consumed"])
        seed = _state_int("seed", state_dict["seed"])
        shuffle = _state_bool("shuffle", state_dict["shuffle"])
        drop_last = _state_bool("drop_last", state_dict["drop_last"])
        if length != self.dataset_length:
            raise CheckpointMismatchError(
                f"sampler state was saved for a dataset of length {length}, but this "
                f"dataset has length {self.dataset_length}"
            )
        if epoch < 0:
            raise ValueError(f"sampler state 'epoch'={epoch}: expected >= 0")
        if not 0 <= consumed <= length:
            raise ValueError(
                f"sampler state 'consumed'={consumed}: expected 0 <= consumed <= {length}"
            )
        return {"dataset_length": length, "epoch": epoch, "consumed": consumed,
                "seed": seed, "shuffle": shuffle, "drop_last": drop_last}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a sampler of any world size.

        ``seed`` and ``shuffle`` are taken from the state, since they define the
        order the saved position refers to (a difference from the constructor is
        logged as a warning). ``drop_last`` is not: it is how *this* script consumes
        the data, not part of the position, so the constructor's value is kept and a
        difference is only logged. Every entry is checked before anything is
        adopted, so a bad state leaves the sampler as it was.

        Raises:
            CheckpointMismatchError: (a ``ValueError``) when the state comes from a
                dataset of another length.
            TypeError: when the state is not a mapping or an entry has the wrong type
                (a non-integral float, a string, a bool where an int belongs).
            ValueError: when keys are missing or the position is out of range.
        """
        v = self.check_state_dict(state_dict)
        seed, shuffle, drop_last = v["seed"], v["shuffle"], v["drop_last"]
        epoch, consumed = v["epoch"], v["consumed"]
        for key, value in (("seed", seed), ("shuffle", shuffle)):
            if value != getattr(self, key):
                log.warning(
                    "sampler state has %s=%r, constructor had %r: using the state's",
                    key, value, getattr(self, key),
                )
        if drop_last != self.drop_last:
            log.info(
                "sampler state has drop_last=%r, this sampler was built with %r: keeping "
                "%r (it describes how this script consumes the data, not the position)",
                drop_last, self.drop_last, self.drop_last,
            )
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = epoch
        self.consumed = consumed
        self._start_pending = False
        self._pass_start = consumed
        self._pass_dealt = False
        self._end_reached = False

    # -- the order --------------------------------------------------------------------

    def permutation(self, epoch: SupportsIndex | None = None) -> torch.Tensor:
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

    def _position(self, position: SupportsIndex | None) -> int:
        """``position`` checked against the epoch; ``None`` means :attr:`consumed`."""
        if position is None:
            return self.consumed
        position = _check_int("position", position)
        if not 0 <= position <= self.dataset_length:
            raise ValueError(
                f"position={position} is outside the epoch of a dataset of length "
                f"{self.dataset_length}; expected 0 <= position <= {self.dataset_length}"
            )
        return position

    def _local_length(self, position: int) -> int:
        r, w = self.dataset_length - position, self.num_replicas
        return r // w if self.drop_last else -(-r // w)

    def _local_real(self, position: int) -> int:
        if self.drop_last:
            return self._local_length(position)
        r = self.dataset_length - position
        return max(0, -(-(r - self.rank) // self.num_replicas))

    @property
    def num_local_real(self) -> int:
        """Non-padding indices in this rank's share from the current position."""
        return self._local_real(self.consumed)

    def local_padding_mask(self, *, position: SupportsIndex | None = None) -> torch.Tensor:
        """Bool mask over :meth:`local_indices`: True where the index is padding.

        Position ``j`` is padding when ``rank + j * num_replicas >= remaining``, so at
        most one position per rank, always the last. Needs no permutation.

        Args:
            position: the global position the share is dealt from (default:
                :attr:`consumed`); ``position=pass_start`` gives the mask of the pass
                being iterated.
        """
        start = self._position(position)
        return ~self.real_mask(0, self._local_length(start), position=start)

    def real_mask(self, first: SupportsIndex, stop: SupportsIndex, *,
                  position: SupportsIndex | None = None) -> torch.Tensor:
        """Bool mask over this rank's local positions ``first..stop-1``: True where real.

        The one place the padding test is written, so the loss weights, the sample
        audit and :meth:`local_padding_mask` cannot disagree about which samples a
        step really trained. Position ``j`` is real when ``rank + j * num_replicas <
        dataset_length - position``; positions past the share's end count as padding.

        Args:
            first, stop: local positions within the share dealt from ``position``.
            position: the global position the share is dealt from (default:
                :attr:`consumed`); ``position=pass_start`` gives positions within the
                pass being iterated.
        """
        start = self._position(position)
        positions = torch.arange(operator.index(first), operator.index(stop), dtype=torch.int64)
        real = positions * self.num_replicas + self.rank < self.dataset_length - start
        return real & (positions < self._local_length(start))

    def local_indices(self, *, position: SupportsIndex | None = None) -> torch.Tensor:
        """This rank's share of the rest of the epoch, padding included, as int64.

        Exactly what ``__iter__`` yields when it starts at ``position``. Holds the
        permutation once plus this rank's ``1/num_replicas`` of it: the share is a
        strided slice of the permutation and only the (at most one element) padded
        tail is built separately.

        Args:
            position: the global position the share is dealt from (default:
                :attr:`consumed`); ``position=pass_start`` gives the pass being
                iterated.
        """
        start = self._position(position)
        rem_len, w, rank = self.dataset_length - start, self.num_replicas, self.rank
        length = self._local_length(start)
        if length == 0:
            return torch.empty(0, dtype=torch.int64)
        perm = self.permutation()
        rem = perm[start:]
        n_real = self._local_real(start)
        real = rem[rank::w][:n_real]
        if n_real == length:
            # With one replica this is a view of the permutation itself: no copy.
            return real.contiguous()
        # Padding cycles the permutation from its start: padded[p] = perm[(p - R) % N],
        # the epoch's global position start + p less N, whatever ``start`` is (cycling
        # ``rem`` instead made a resumed pass pad with other samples).
        pad_pos = torch.arange(n_real, length, dtype=torch.int64).mul_(w).add_(rank)
        return torch.cat([real, perm[pad_pos.sub_(rem_len).remainder_(self.dataset_length)]])

    def __iter__(self) -> Iterator[int]:
        """Deal a pass: this rank's share from the current position.

        Indices, or ``(epoch, index)`` keys when the dataset has a true
        ``takes_epoch_keys`` attribute (:class:`~elastic_kit.SeededDataset`).

        Records the pass (:attr:`pass_start`, ``len()``). Iterating again at the end
        of an epoch this sampler consumed itself deals that epoch's whole share again
        (as ``DistributedSampler`` does: an evaluation over the training loader),
        position unchanged; on a sampler whose epochs :meth:`set_epoch` never named,
        it starts the next epoch instead (see the class warning).
        """
        if self._rollover_due() and self._epochs_named:
            # the epoch again, from its start: nothing to advance through (a step on
            # this pass moves past the epoch's end and is refused)
            log.debug("a pass after epoch %d was consumed: its share again", self.epoch)
            self._pass_start = 0
            self._pass_dealt = True
            return self._dealt(self.local_indices(position=0))
        if self._rollover_due():
            if not self._warned_rollover:
                self._warned_rollover = True
                log.warning(
                    "set_epoch() was not called after epoch %d was consumed to the end; "
                    "starting epoch %d at position 0 with its own permutation. Call "
                    "sampler.set_epoch(epoch) at the start of every epoch (this "
                    "warning is logged once)",
                    self.epoch, self.epoch + 1,
                )
            else:
                log.debug("set_epoch() not called: starting epoch %d", self.epoch + 1)
            self.epoch += 1
            self.consumed = 0
            self._end_reached = False
        self._start_pending = False
        self._pass_start = self.consumed
        self._pass_dealt = True
        indices = self.local_indices()
        if len(indices) == 0:
            # marked when the empty pass is run through, not when it is made: torch's
            # DataLoader (num_workers > 0, batch_size=None) calls iter() twice and
            # reads only the second iterator
            return self._empty_pass()
        return self._dealt(indices)

    def _empty_pass(self) -> Iterator[int]:
        self._end_reached = True
        return
        yield

    def _dealt(self, indices: torch.Tensor) -> Iterator[int]:
        """``indices`` as the pass yields them: ints, or ``(epoch, index)`` keys."""
        if self._epoch_keys:
            epoch = self.epoch
            return iter([(epoch, i) for i in indices.tolist()])  # type: ignore[misc]
        return iter(indices.tolist())

    def __len__(self) -> int:
        """Indices this rank yields in the current pass (padding included).

        Constant while the pass is iterated and advanced through, so that
        ``len(loader)`` stays the number of batches of the epoch being trained.
        """
        # Before the first pass, the pass an __iter__ would deal now (a rollover to
        # the next epoch needs a pass dealt, so it cannot be due here).
        return self._local_length(self._pass_start if self._pass_dealt else self.consumed)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dataset_length={self.dataset_length}, "
            f"num_replicas={self.num_replicas}, rank={self.rank}, epoch={self.epoch}, "
            f"consumed={self.consumed}, pass_start={self._pass_start}, "
            f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last})"
        )
