"""The state at the end of the last step, for a snapshot taken as the process fails.

A worker that fails because a peer died (its next collective raises) still holds the
state of the last step every rank finished: the peer died in the step after it, and
the parameters change only in the optimizer's step, which no rank reached. Written
to this node's memory as the worker exits, that state makes the failure cost at most
the step in progress, where the periodic snapshots cost the steps since the last one.

Three things of that state do change in the step in progress, before the collective
that fails, and are kept here at every step end (on the ranks that write snapshots,
for a few tens of microseconds): the random number generators' states (a forward pass
draws from them), the model's buffers (batch norm updates its running statistics in
the forward pass; copied into buffers kept for it) and the gradient scaler's scale
(watched through its version counter, not copied: a change means the state is not
the step's; the scaler's own update is an in-place op that bumps it). The optimizer's
pre-hook marks the step in progress as changing the rest: from then on no snapshot is
taken at exit.

The sample audit of the steps since its last sum over the ranks is not known on one
rank: it is derived from the sampler's position (the samples at the epoch's positions
the last sum did not cover, over all ranks), and the snapshot says so in its metadata.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from elastic_kit.distributed import unwrap_model
from elastic_kit.state import raw_rng_state

__all__ = ["StepEnd", "Mark"]

log = logging.getLogger(__name__)


@dataclass
class Mark:
    """What the state was at the end of step :attr:`step` (``event``: a CUDA event
    recorded then, after the step's kernels, for a model on a GPU)."""

    step: int
    rng: dict[str, Any]
    scale_version: tuple[int, ...] | None
    event: Any = None


class StepEnd:
    """Marks of the state at each step end, and whether it is still intact.

    Args:
        state: the training state (a ``TrainState``).
        enabled: whether to keep marks (only where this rank writes snapshots of
            unsharded state: elsewhere it costs nothing).
    """

    def __init__(self, state: Any, *, enabled: bool) -> None:
        self.state = state
        self.enabled = enabled
        self.mark: Mark | None = None
        self._changing = False
        self._names: list[str] = []
        self._buffers: list[torch.Tensor] = []
        self._copies: list[torch.Tensor] = []
        self._device: torch.device | None = None  # the model's GPU, if on one
        self._event: Any = None
        if enabled:
            named = list(unwrap_model(state.model).named_buffers())
            self._names = [n for n, _ in named]
            self._buffers = [b for _, b in named]
            self._copies = [torch.empty_like(b) for b in self._buffers]
            on_gpu = [p.device for p in unwrap_model(state.model).parameters() if p.is_cuda]
            if on_gpu:
                self._device = on_gpu[0]
                self._event = torch.cuda.Event()

    def _scale_version(self) -> tuple[int, ...] | None:
        """The scaler's scale tensor and its version counter; ``()`` where there is no
        scale (no scaler, a disabled one, or one not used yet); None where it cannot be
        watched (a scaler without the ``_scale`` tensor torch's has)."""
        scaler = self.state.scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return ()
        if not hasattr(scaler, "_scale"):
            return None
        scale = scaler._scale
        return (id(scale), scale._version) if isinstance(scale, torch.Tensor) else ()

    def record(self) -> None:
        """Mark the state as it is now: the end of step ``state.step``."""
        if not self.enabled:
            return
        if self._buffers:
            torch._foreach_copy_(self._copies, self._buffers)
        if self._event is not None:  # one event, recorded again at every step end
            self._event.record(torch.cuda.current_stream(self._device))
        self.mark = Mark(step=int(self.state.step), rng=raw_rng_state(),
                         scale_version=self._scale_version(), event=self._event)
        self._changing = False

    def optimizer_started(self) -> None:
        """The optimizer began changing the parameters: the mark no longer holds."""
        self._changing = True

    def intact(self) -> Mark | None:
        """The mark, when the state is still that of its step (apart from what the
        mark kept: the generators and the buffers); None when it is not, or when
        there is no mark."""
        mark = self.mark
        scale = self._scale_version()
        if (mark is None or self._changing or int(self.state.step) != mark.step
                or scale is None or scale != mark.scale_version):
            return None
        # buffers replaced since (a module moved after the restore): their copies are
        # of tensors the model no longer holds
        now = [b for _, b in unwrap_model(self.state.model).named_buffers()]
        if len(now) != len(self._buffers) or any(a is not b for a, b in zip(now, self._buffers)):
            return None
        return mark

    def reading(self, mark: Mark) -> contextlib.AbstractContextManager[Any]:
        """Where to read the state of ``mark`` on a GPU: a stream of its own that
        waits only for the step's end (the mark's event), not for what the training
        stream queued since. That may be a collective the failed peer never joins
        (with NCCL it hangs on the device): a copy or a ``.item()`` queued behind it
        would hang too. Elsewhere, nothing changes."""
        if mark.event is None or self._device is None:
            return contextlib.nullcontext()
        stream = torch.cuda.Stream(device=self._device)
        stream.wait_event(mark.event)
        return torch.cuda.stream(stream)

    def buffers_at_mark(self) -> dict[str, torch.Tensor]:
        """The model's buffers as they were at the mark, by their names in the model's
        state dict. All of them: a forward pass may have changed any since, and not
        every change shows (batch norm's kernels update their running statistics
        without bumping the tensors' version counters)."""
        return dict(zip(self._names, self._copies))
