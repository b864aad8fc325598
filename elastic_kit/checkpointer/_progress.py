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
from elastic_kit.state import AuditSpan, AuditSum, EpochAudit, normalize, sample_digest

if TYPE_CHECKING:
    from elastic_kit.sampler import ElasticDistributedSampler
    from elastic_kit.state import TrainState

__all__ = ["Progress", "check_dealt"]

log = logging.getLogger(__name__)

_UNSTEPPED_CAUSE = ("a DataLoader with drop_last=True drops the epoch's last partial "
                    "batch: give it drop_last=False, sample_weights() weights the short "
                    "step; step(n) given fewer samples than the batch held, such as len() "
                    "of an (x, y) pair or of a dict, undercounts every step; a loop that "
                    "leaves the epoch early leaves the rest")


def check_dealt(sampler: ElasticDistributedSampler, n: int) -> None:
    """Refuse a step of a script's own loop when nothing iterated the sampler since
    its position was set: the loader then dealt samples of some other order, and the
    resume position, loss weights and audit would describe samples not trained. (The
    loop schedules its steps from the sampler's indices, and does not iterate it.)"""
    if not sampler.pass_dealt:
        raise RuntimeError(
            f"step(n={n}): state.sampler dealt no samples since epoch {sampler.epoch} was "
            f"set at position {sampler.consumed}: the DataLoader must iterate it "
            f"(DataLoader(dataset, sampler=state.sampler, ...), not shuffle=True or "
            f"another sampler), and its iterator must be made after restore() and "
            f"set_epoch() (a loader with workers deals its first batches when the "
            f"iterator is made). An IterableDataset that iterates it in loader workers "
            f"iterates copies: call iter(state.sampler) at each epoch's start too")


def _overrun(sampler: ElasticDistributedSampler, n: int) -> ValueError:
    """A step that starts past the end of the pass the sampler dealt (``step()`` twice
    per step, or the global batch for ``n``: the extra steps would count as padding, at
    zero weight, unseen by the audit). The last step may ask for more than is left
    (``step(batch_size)``): its overshoot is padding, and is not refused. Training
    a pass dealt after the epoch's end (the epoch again: ``end_epoch()`` forgotten)
    is refused the same way."""
    return ValueError(
        f"step(n={n}) starts past the end of the pass state.sampler dealt: this "
        f"rank's share of epoch {sampler.epoch} from position {sampler.pass_start} "
        f"has {sampler.pass_length} samples, and earlier steps took them all. Call "
        f"step() once per optimizer step with this rank's batch size (len(x), not "
        f"the global batch), iterate state.sampler in the DataLoader, and call "
        f"end_epoch() after each epoch (a pass after the epoch's end deals the "
        f"epoch again)")


class Progress:
    """The sampler position and the sample audit of one :class:`TrainState`."""

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self._pass_key: tuple[int, ...] | None = None
        self._pass: tuple[torch.Tensor, torch.Tensor] | None = None  # indices, real mask
        self._span = AuditSpan()  # audited steps not yet digested
        # (epoch, position): where the audit's folded totals end; the sum in flight,
        # with where its totals will end
        self._covered: tuple[int, int] = (-1, 0)
        self._sum: tuple[AuditSum, tuple[int, int]] | None = None
        # (offset, n) of every weights() call since the last step
        self._weighed: list[tuple[int, int]] = []

    def _position(self, sampler: ElasticDistributedSampler, n: int,
                  offset: int = 0) -> tuple[int, int, int]:
        """``(j0, n_real, W)``: this rank's local offset in the pass (``offset`` local
        samples into the next step), the real samples over all ranks of ``n`` per rank
        from there, and the world size."""
        w, r0 = sampler.num_replicas, sampler.dataset_length - sampler.pass_start
        j0 = (sampler.consumed - sampler.pass_start) // w + offset
        return j0, max(0, min(r0 - j0 * w, n * w)), w

    def weights(self, n: int, *, offset: int = 0, step_n: int | None = None, device: Any,
                dtype: torch.dtype) -> torch.Tensor:
        """``W / n_real`` for the ``n`` local samples from ``offset`` into the next
        step that are real, 0 for padding; ``n_real`` counts the real samples of these
        ``n`` per rank, or with ``step_n`` of the whole step's ``step_n`` per rank."""
        self._weighed.append((offset, n))
        sampler = self.state.sampler
        if sampler is None:
            return torch.full((n,), 1.0 / max(step_n or n, 1), dtype=dtype, device=device)
        j0, n_real, w = self._position(sampler, n, offset)
        if step_n is not None:
            n_real = self._position(sampler, step_n)[1]
        real = sampler.real_mask(j0, j0 + n, position=sampler.pass_start)
        return real.to(device=device, dtype=dtype).mul_(w / max(n_real, 1))

    def _check_weighed(self, n: int) -> None:
        """Refuse a step whose micro-batches were all weighed as its first: the later
        ones got the first one's padding mask (a padding sample of the epoch's last
        step trained at full weight)."""
        weighed, self._weighed = self._weighed, []
        if len(weighed) > 1 and all(o == 0 for o, _ in weighed) and sum(
                m for _, m in weighed) == n:
            sizes = [m for _, m in weighed]
            raise ValueError(
                f"step(n={n}): sample_weights() was called for {len(weighed)} micro-batches "
                f"of this step ({sizes} samples), each at offset 0, so every one got the "
                f"first micro-batch's weights; pass each one's position in the step: "
                f"sample_weights(len(x), offset=samples of the step's earlier "
                f"micro-batches)")

    def advance(self, n: int, *, audited: bool) -> None:
        """A step of ``n`` samples per rank: advance the sampler by its real samples
        over all ranks and, when ``audited``, note them for the audit."""
        state, sampler = self.state, self.state.sampler
        self._check_weighed(n)
        if sampler is None:
            return
        if sampler.epoch != state.epoch:
            raise RuntimeError(
                f"step(): state.sampler is at epoch {sampler.epoch}, but the checkpointer's "
                f"epoch is {state.epoch}: call end_epoch() after every epoch, and start the "
                f"loop at the epoch restore() returns (for epoch in range(ckpt.restore(), "
                f"epochs): sampler.set_epoch(epoch))")
        j0, n_real, _ = self._position(sampler, n)
        if n > 0 and j0 >= sampler.pass_length:
            raise _overrun(sampler, n)
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

    def unstepped(self) -> int:
        """Samples of the current epoch the sampler would still deal: none once its
        last step was taken (with the sampler's own ``drop_last``, the tail of fewer
        than ``num_replicas`` samples it drops is not counted)."""
        sampler = self.state.sampler
        if sampler is None:
            return 0
        left = sampler.remaining
        return left - left % sampler.num_replicas if sampler.drop_last else left

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
        self._covered, self._sum = self._position_now(), None

    def _position_now(self) -> tuple[int, int]:
        sampler = self.state.sampler
        return (int(sampler.epoch), int(sampler.consumed)) if sampler is not None else (-1, 0)

    def restored(self) -> None:
        """The state was restored (or starts): its audit covers its position."""
        self._covered, self._sum = self._position_now(), None

    def give_up_audit_sum(self, grace: float) -> None:
        """Wait at most ``grace`` seconds for the audit's sum in flight, then stop
        waiting for it everywhere (the snapshot writer too): for a rank that exits
        alone, whose peers may never join it."""
        if self._sum is None:
            return
        pending = self._sum[0]
        try:
            pending.total(timeout=grace)
        except Exception as e:  # a peer that never added its share
            log.debug("the audit's sum in flight did not arrive: %r", e)
        pending.give_up()

    def audit_at_step_end(self, timeout: float) -> tuple[list[dict[str, Any]], list[int]]:
        """The audit as of the sampler's position, summed over all ranks, without a
        collective (for a rank that exits alone): the folded totals, the sum in flight
        if it arrives within ``timeout`` seconds, and for the epoch's positions neither
        covers, the samples the sampler put there. Returns the audit's state dict and
        ``[epoch, first, end]``, the positions derived from the sampler."""
        audit, sampler = self.state.audit, self.state.sampler
        covered, view = self._covered, None
        if self._sum is not None:
            pending, ends_at = self._sum
            try:
                view, covered = pending.state_dict(timeout=timeout), ends_at
            except Exception as e:  # a peer that never added its share
                log.debug("the audit's sum in flight did not arrive: %r", e)
                view = pending.base
            audit.abandon_in_flight()
        if view is None:
            view = audit.state_dict()
        epoch, end = self._position_now()
        first = covered[1] if covered[0] == epoch else 0
        if sampler is not None and end > first:
            totals = {int(d["epoch"]): EpochAudit.from_dict(d) for d in view}
            totals.setdefault(epoch, EpochAudit(epoch)).add(
                normalize(sample_digest(sampler.permutation(epoch)[first:end])))
            view = [totals[e].to_dict() for e in sorted(totals)]
        return view, [epoch, first, end]

    def sync_audit_async(self, mode: str) -> AuditSum | None:
        """Start folding every rank's audit share in (collective, not waited for; None
        when ``mode`` is off): what a snapshot writes, see :meth:`SampleAudit.sync_async`."""
        if mode == "off":
            return None
        self._span.digest(self.state.audit)
        if self._sum is not None:  # folded in by the new sum
            self._covered = self._sum[1]
        pending = self.state.audit.sync_async(self.state.epoch)
        self._sum = (pending, self._position_now())
        return pending

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
        self._covered, self._sum = self._position_now(), None
        if not audit.finish(sampler.dataset_length):
            message = audit.message
            unstepped = self.unstepped()
            if unstepped:
                message += (f"; {unstepped} samples were never stepped before the epoch "
                            f"ended ({_UNSTEPPED_CAUSE})")
            if is_main:
                log.error("SAMPLE AUDIT FAILED: %s", message)
            if mode == "error":
                raise SampleAuditError(message)
        elif is_main:
            say(log, "sample audit: %s", audit.message)
        return audit
