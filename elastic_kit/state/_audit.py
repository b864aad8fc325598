"""Sample audit: prove that every sample of an epoch reached a gradient exactly once.

For each epoch the loop keeps three integers over the ids of the samples that
contributed to a completed optimizer step: their count, ``sum(h1(i)) mod P`` and
``sum(h2(i)^2) mod P`` with two independent 64-bit mixing hashes and the prime
``P = 2^31 - 1``. The digest is order-independent and additive, so each rank sums
its own share, the ranks' shares are summed with one ``all_reduce`` and the running
totals are saved in every checkpoint together with the model state they belong to.
At the end of the epoch the totals must equal the digest of ``range(len(dataset))``:
a missed sample lowers the count, a repeated one raises it, and one missed plus one
repeated sample leaves the count but changes both sums (with probability
``1 - 2^-62``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["EpochAudit", "SampleAudit", "AuditSum", "sample_digest", "expected_digest", "PRIME"]

log = logging.getLogger(__name__)

#: Modulus of the digest sums; values stay below 2^31 so sums over many ranks and
#: squares fit comfortably in int64.
PRIME = (1 << 31) - 1
_SALT1 = np.uint64(0x243F6A8885A308D3)
_SALT2 = np.uint64(0x13198A2E03707344)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sample_digest(ids: torch.Tensor | np.ndarray | list[int]) -> torch.Tensor:
    """``[count, sum h1 mod P, sum h2^2 mod P]`` of ``ids`` as an int64 tensor.

    Additive: the digest of a union of disjoint multisets is the element-wise sum of
    their digests (reduce the sums mod :data:`PRIME` with :func:`normalize`).
    """
    if isinstance(ids, torch.Tensor):
        arr = ids.detach().cpu().numpy()
    else:
        arr = np.asarray(ids)
    arr = arr.astype(np.int64, copy=False).reshape(-1)
    if arr.size and arr.min() < 0:
        raise ValueError(f"sample ids must be >= 0, got {int(arr.min())}")
    x = arr.astype(np.uint64)
    with np.errstate(over="ignore"):
        h1 = (_splitmix64(x ^ _SALT1) % np.uint64(PRIME)).astype(np.int64)
        h2 = (_splitmix64(x ^ _SALT2) % np.uint64(PRIME)).astype(np.int64)
    s1 = int(h1.sum()) % PRIME if arr.size else 0
    s2 = int(((h2 * h2) % PRIME).sum()) % PRIME if arr.size else 0
    return torch.tensor([arr.size, s1, s2], dtype=torch.int64)


def normalize(digest: torch.Tensor) -> torch.Tensor:
    """Reduce the two sums of a (summed) digest modulo :data:`PRIME`."""
    out = digest.clone().to(torch.int64)
    out[1:] = out[1:] % PRIME
    return out


_EXPECTED_CACHE: dict[int, torch.Tensor] = {}


def expected_digest(dataset_length: int) -> torch.Tensor:
    """The digest of every id in ``range(dataset_length)`` exactly once (cached)."""
    if dataset_length not in _EXPECTED_CACHE:
        total = torch.zeros(3, dtype=torch.int64)
        step = 1 << 20
        for start in range(0, dataset_length, step):
            total += sample_digest(np.arange(start, min(start + step, dataset_length)))
        _EXPECTED_CACHE[dataset_length] = normalize(total)
    return _EXPECTED_CACHE[dataset_length].clone()


@dataclass
class EpochAudit:
    """The audit of one epoch: what contributed, and whether it matched the dataset.

    Attributes:
        epoch: the epoch.
        count: samples that contributed to a gradient (summed over ranks and restarts).
        digest: ``sum h1 mod P`` of their ids.
        digest_sq: ``sum h2^2 mod P`` of their ids.
        expected_count: the dataset length.
        ok: ``None`` while the epoch runs; after :meth:`finish`, whether count and both
            sums equal those of every sample exactly once.
    """

    epoch: int
    count: int = 0
    digest: int = 0
    digest_sq: int = 0
    expected_count: int = 0
    ok: bool | None = None
    message: str = ""

    def add(self, digest: torch.Tensor) -> None:
        """Add a (rank-summed) :func:`sample_digest`."""
        d = digest.to(torch.int64).tolist()
        self.count += int(d[0])
        self.digest = (self.digest + int(d[1])) % PRIME
        self.digest_sq = (self.digest_sq + int(d[2])) % PRIME

    def finish(self, dataset_length: int) -> bool:
        """Compare with every sample of ``range(dataset_length)`` once; sets :attr:`ok`."""
        exp = expected_digest(dataset_length).tolist()
        self.expected_count = dataset_length
        self.ok = [self.count, self.digest, self.digest_sq] == exp
        if self.ok:
            self.message = f"epoch {self.epoch}: all {dataset_length} samples exactly once"
        elif self.count < dataset_length:
            self.message = (
                f"epoch {self.epoch}: {self.count} of {dataset_length} samples contributed "
                f"to a gradient: at least {dataset_length - self.count} missed")
        elif self.count > dataset_length:
            self.message = (
                f"epoch {self.epoch}: {self.count} sample contributions for a dataset of "
                f"{dataset_length}: at least {self.count - dataset_length} repeated")
        else:
            self.message = (
                f"epoch {self.epoch}: {self.count} contributions, as many as samples, but "
                f"the id digest differs: some samples were missed and others repeated")
        return self.ok

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (loadable with ``torch.load(weights_only=True)``)."""
        return {"epoch": self.epoch, "count": self.count, "digest": self.digest,
                "digest_sq": self.digest_sq, "expected_count": self.expected_count,
                "ok": self.ok, "message": self.message}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpochAudit:
        return cls(**{k: d[k] for k in ("epoch", "count", "digest", "digest_sq",
                                          "expected_count", "ok", "message") if k in d})


class AuditSum:
    """The ranks' summed shares of one epoch, on their way (:meth:`SampleAudit.sync_async`).

    A snapshot needs the audit as it is at its step, but waiting for the all-reduce on
    the training thread costs a round trip between the ranks (and, with NCCL, a wait
    for the device) at every snapshot. The sum is started at the snapshot's step and
    read where its value is needed: by the snapshot's writer thread
    (:meth:`state_dict`) and by the audit itself before it is next used.
    """

    def __init__(self, epoch: int, base: list[dict[str, Any]],
                 result: Callable[[float | None], torch.Tensor]) -> None:
        self.epoch = epoch
        self._base = base  # the totals before this sum (plain types, a copy)
        self._result = result
        self._total: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._given_up = threading.Event()

    @property
    def base(self) -> list[dict[str, Any]]:
        """The audit's state dict before this sum (a copy)."""
        return [dict(d) for d in self._base]

    def total(self, timeout: float | None = None) -> torch.Tensor:
        """The summed digest (waits for the all-reduce, at most ``timeout`` seconds,
        then :class:`TimeoutError`; any thread, several at once). Raises
        :class:`RuntimeError` once the sum was given up (:meth:`give_up`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._total is not None:
                    return self._total
            if self._given_up.is_set():
                raise RuntimeError(f"the audit's sum of epoch {self.epoch} was given up "
                                   "(a peer never joined it)")
            left = _POLL_S if deadline is None else min(
                _POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                total = normalize(self._result(left))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            with self._lock:
                if self._total is None:
                    self._total = total
                return self._total

    def give_up(self) -> None:
        """Stop waiting for the sum, on every thread (a rank that exits alone: a peer
        may never join it)."""
        self._given_up.set()

    def state_dict(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """What :meth:`SampleAudit.state_dict` returns once this sum is folded in
        (waits for it as :meth:`total` does; any thread; the audit is not changed)."""
        epochs = {int(d["epoch"]): EpochAudit.from_dict(d) for d in self._base}
        _fold(epochs, self.epoch, self.total(timeout))
        return [epochs[e].to_dict() for e in sorted(epochs)]


#: Seconds between checks, while waiting for a sum, of whether it was given up.
_POLL_S = 0.05


def _fold(epochs: dict[int, EpochAudit], epoch: int, total: torch.Tensor) -> None:
    """Add a rank-summed share of ``epoch`` (an epoch with nothing yet stays absent)."""
    if epoch in epochs or bool(total.any()):
        if epoch not in epochs:
            epochs[epoch] = EpochAudit(epoch)
        epochs[epoch].add(total)


@dataclass
class SampleAudit:
    """Per-epoch audits plus the local, not yet all-reduced, contributions.

    The loop calls :meth:`record` with the ids of the real samples of each completed
    optimizer step, and :meth:`sync` (collective) before every checkpoint and at the
    end of each epoch, which folds every rank's pending share into :attr:`epochs`.
    Only synced totals are saved, so after a restart the audit matches the restored
    model exactly. A snapshot starts the sum instead (:meth:`sync_async`); it is
    folded into :attr:`epochs` by the next :meth:`sync`, :meth:`sync_async`,
    :meth:`epoch` or :meth:`settle`.
    """

    epochs: dict[int, EpochAudit] = field(default_factory=dict)
    _pending: dict[int, torch.Tensor] = field(default_factory=dict)
    _inflight: AuditSum | None = field(default=None, repr=False)

    def record(self, epoch: int, ids: torch.Tensor) -> None:
        """Add this rank's contributing sample ids of one step (local, no collective)."""
        d = sample_digest(ids)
        prev = self._pending.get(epoch)
        self._pending[epoch] = normalize(d if prev is None else prev + d)

    def sync(self, epoch: int) -> None:
        """Sum every rank's pending share of ``epoch`` into its total (collective).

        Every rank must call it at the same point with the same ``epoch``; ranks with
        nothing pending contribute zeros.
        """
        from elastic_kit.distributed import all_reduce_sum

        self.settle()
        total = normalize(all_reduce_sum(self._take_pending(epoch)))
        _fold(self.epochs, epoch, total)

    def sync_async(self, epoch: int) -> AuditSum:
        """Start summing every rank's pending share of ``epoch`` (collective, like
        :meth:`sync`, but not waited for): the returned sum gives the audit's state
        with it folded in, on any thread; the audit folds it in when next used."""
        from elastic_kit.distributed import all_reduce_sum_async

        base = self.state_dict()  # settles the previous sum
        result = all_reduce_sum_async(self._take_pending(epoch))
        self._inflight = AuditSum(epoch, base, result)
        return self._inflight

    def settle(self) -> None:
        """Fold in the sum :meth:`sync_async` started, if any (waits for it)."""
        pending, self._inflight = self._inflight, None
        if pending is not None:
            _fold(self.epochs, pending.epoch, pending.total())

    def abandon_in_flight(self) -> None:
        """Drop the sum :meth:`sync_async` started without waiting for it: for a rank
        that exits alone (a peer may never add its share)."""
        self._inflight = None

    def _take_pending(self, epoch: int) -> torch.Tensor:
        local = self._pending.pop(epoch, torch.zeros(3, dtype=torch.int64))
        if self._pending:
            raise AssertionError(f"unsynced audit for epochs {sorted(self._pending)}")
        return local

    def epoch(self, epoch: int) -> EpochAudit:
        """The (created on demand) audit of ``epoch``."""
        self.settle()
        if epoch not in self.epochs:
            self.epochs[epoch] = EpochAudit(epoch)
        return self.epochs[epoch]

    def state_dict(self) -> list[dict[str, Any]]:
        # Only synced totals: a save syncs right before it takes the state; a snapshot
        # takes it first and writes its AuditSum's view.
        self.settle()
        return [self.epochs[e].to_dict() for e in sorted(self.epochs)]

    def load_state_dict(self, sd: list[dict[str, Any]]) -> None:
        self.epochs = {int(d["epoch"]): EpochAudit.from_dict(d) for d in sd}
        self._pending.clear()
        self._inflight = None


class AuditSpan:
    """Audited steps not yet folded into a :class:`SampleAudit`.

    Digesting ids costs a hash per sample; done per optimizer step it would sit on
    the critical path of short steps. Consecutive steps of one pass extend one span
    of local positions instead, digested in one vectorised call when the audit is
    next needed (a save, a snapshot, the epoch's end).
    """

    def __init__(self) -> None:
        self._epoch = -1
        self._indices: torch.Tensor | None = None  # the pass's local indices
        self._real: torch.Tensor | None = None  # which of them are not padding
        self._start = self._end = 0

    def note(self, audit: SampleAudit, epoch: int, indices: torch.Tensor,
             real: torch.Tensor, start: int, end: int) -> None:
        """Record that local positions ``start..end-1`` of a pass were trained.

        ``indices`` and ``real`` are the pass's local indices and its real-sample
        mask; a step that continues the pending span extends it, any other step
        first digests the pending span into ``audit``.
        """
        if (self._indices is not None and self._epoch == epoch
                and self._indices is indices and self._end == start):
            self._end = end
            return
        self.digest(audit)
        self._epoch, self._indices, self._real = epoch, indices, real
        self._start, self._end = start, end

    def digest(self, audit: SampleAudit) -> None:
        """Fold the pending span's real samples into this rank's share of ``audit``."""
        indices, real, self._indices, self._real = self._indices, self._real, None, None
        if indices is None or real is None:
            return
        a, b = self._start, self._end
        audit.record(self._epoch, indices[a:b][real[a:b]])
