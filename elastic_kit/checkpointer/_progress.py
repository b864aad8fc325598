"""Where the epoch stands and what it trained: the sampler's position, advanced per
step, the loss weights of a step, and the sample audit fed with each step.

How the position is kept: the :class:`~elastic_kit.ElasticDistributedSampler` deals
each rank a strided share of the rest of the epoch's permutation, padded to equal
length, so every rank's ``k``-th batch of ``n`` samples is the contiguous global chunk
``rem[k*n*W:(k+1)*n*W]`` and only the epoch's very last step holds padding. A
step therefore consumed ``min(n * W, samples left in the pass)`` real samples
globally, which every rank computes alone: advancing the sampler needs no
collective. The audit digests the steps' ids lazily, in spans.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from elastic_kit._console import say
from elastic_kit.errors import SampleAuditError
from elastic_kit.state import AuditSpan, AuditSum, EpochAudit

if TYPE_CHECKING:
    from elastic_kit.sampler import ElasticDistributedSampler
    from elastic_kit.state import TrainState

__all__ = ["Progress"]

log = logging.getLogger(__name__)


class Progress:
    """The sampler position and the sample audit of one :class:`TrainState`."""

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self._pass_key: tuple[int, ...] | None = None
        self._pass: tuple[torch.Tensor, torch.Tensor] | None = None  # indices, real mask
        self._span = AuditSpan()  # audited steps not yet digested

    def _position(self, sampler: ElasticDistributedSampler, n: int) -> tuple[int, int, int]:
        """``(j0, n_real, W)``: this rank's local offset in the pass, the real samples
        over all ranks of a step of ``n`` per rank from there, and the world size."""
        w, r0 = sampler.num_replicas, sampler.dataset_length - sampler.pass_start
        j0 = (sampler.consumed - sampler.pass_start) // w
        return j0, max(0, min(r0 - j0 * w, n * w)), w

    def weights(self, n: int, *, device: Any, dtype: torch.dtype) -> torch.Tensor:
        """``W / n_real`` for the next ``n`` local samples that are real, 0 for padding."""
        sampler = self.state.sampler
        if sampler is None:
            return torch.full((n,), 1.0 / max(n, 1), dtype=dtype, device=device)
        j0, n_real, w = self._position(sampler, n)
        real = sampler.real_mask(j0, j0 + n, position=sampler.pass_start)
        return real.to(device=device, dtype=dtype).mul_(w / max(n_real, 1))

    def advance(self, n: int, *, audited: bool) -> None:
        """A step of ``n`` samples per rank: advance the sampler by its real samples
        over all ranks and, when ``audited``, note them for the audit."""
        state, sampler = self.state, self.state.sampler
        if sampler is None:
            return
        j0, n_real, _ = self._position(sampler, n)
        if audited and n_real:
            indices, real = self._pass_indices(sampler)
            self._span.note(state.audit, sampler.epoch, indices, real, j0, j0 + n)
        sampler.advance(n_real)
        state.epoch = sampler.epoch

    def _pass_indices(self, s: ElasticDistributedSampler) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's local indices and their real-sample mask, built once per pass."""
        key = (s.epoch, s.pass_start, s.num_replicas, s.rank, s.seed, int(s.shuffle))
        if key != self._pass_key or self._pass is None:
            indices = s.local_indices(position=s.pass_start)
            self._pass_key = key
            self._pass = indices, s.real_mask(0, len(indices), position=s.pass_start)
        return self._pass

    def next_epoch(self) -> None:
        """Move the state and the sampler to the next epoch, position 0."""
        state, sampler = self.state, self.state.sampler
        epoch = sampler.epoch if sampler is not None else state.epoch
        state.epoch = epoch + 1
        if sampler is not None:
            sampler.set_epoch(epoch + 1)

    def sync_audit(self, mode: str) -> None:
        """Fold every rank's audit share in (collective; nothing when ``mode`` is
        off), so a saved audit matches exactly the samples behind the saved state."""
        if mode == "off":
            return
        self._span.digest(self.state.audit)
        self.state.audit.sync(self.state.epoch)

    def sync_audit_async(self, mode: str) -> AuditSum | None:
        """Start folding every rank's audit share in (collective, not waited for; None
        when ``mode`` is off): what a snapshot writes, see :meth:`SampleAudit.sync_async`."""
        if mode == "off":
            return None
        self._span.digest(self.state.audit)
        return self.state.audit.sync_async(self.state.epoch)

    def finish_audit(self, mode: str, *, is_main: bool) -> EpochAudit | None:
        """Check the current epoch's audit (collective); None when ``mode`` is off."""
        state, sampler = self.state, self.state.sampler
        if mode == "off" or sampler is None:
            return None
        epoch = sampler.epoch
        self._span.digest(state.audit)
        audit = state.audit.epoch(epoch)
        if audit.ok is not None and audit.expected_count == sampler.dataset_length:
            return audit
        state.audit.sync(epoch)
        if not audit.finish(sampler.dataset_length):
            if is_main:
                log.error("SAMPLE AUDIT FAILED: %s", audit.message)
            if mode == "error":
                raise SampleAuditError(audit.message)
        elif is_main:
            say(log, "sample audit: %s", audit.message)
        return audit
