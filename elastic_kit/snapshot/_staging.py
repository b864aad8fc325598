"""Staging a snapshot: copies of the state's tensors in reused CPU buffers.

A snapshot must be a state of one step, while training goes on: the tensors are
copied before the next step changes them, and the copy is the only time the
training thread spends on a snapshot (the write happens on the tier's writer
thread). Buffers are kept per key path and reused, because copying into pages that
are already mapped is several times faster than into fresh ones; buffers for CUDA
tensors are pinned, so the device-to-host copy runs at the bus's speed and is
issued without waiting (an event marks its end, which the writer thread waits for).

Tensors the caller promises not to change until :meth:`StagedState.wait_staged`
(parameters and optimizer state, which change only in ``optimizer.step()``) may be
copied later, on the writer thread, overlapping the next forward and backward pass.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

__all__ = ["StagingBuffers", "StagedState", "storage_keys"]

#: The mappings a checkpoint may hold (what the store's weights-only validator accepts).
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)


def storage_keys(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The storage addresses of ``tensors`` (a parameter matches the ``detach()``
    view its module's ``state_dict()`` returns)."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors
                     if isinstance(t, torch.Tensor) and t.layout == torch.strided)


@dataclass
class StagedState:
    """A state dict whose tensors are (or are about to be) copies in CPU buffers.

    Attributes:
        state: the state dict to write, with CPU tensors in place of the live ones.
        deferred: ``(live, buffer)`` pairs still to copy (:meth:`copy_deferred`).
        after: a CUDA event recorded when the snapshot was taken: deferred CUDA
            copies wait for it, so they see every update issued before.
        copied: a CUDA event marking the end of the copies issued at staging time
            (None without CUDA tensors).
        staged: set once nothing reads the live tensors any more.
        nbytes: the tensors' bytes.
    """

    state: Any
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    after: Any = None
    copied: Any = None
    staged: threading.Event = field(default_factory=threading.Event)
    nbytes: int = 0

    def copy_deferred(self) -> None:
        """Fill the buffers left empty, then mark the state staged (on the writer
        thread; also on failure, so that no training thread waits forever)."""
        try:
            cuda = [p for p in self.deferred if p[0].device.type == "cuda"]
            for src, dst in self.deferred:
                if src.device.type != "cuda":
                    dst.copy_(src)
            if cuda:
                stream = torch.cuda.Stream(device=cuda[0][0].device)
                if self.after is not None:
                    stream.wait_event(self.after)
                with torch.cuda.stream(stream):
                    for src, dst in cuda:
                        dst.copy_(src, non_blocking=True)
                stream.synchronize()
            if self.copied is not None:
                self.copied.synchronize()
        finally:
            self.deferred = []
            self.staged.set()

    def wait_staged(self) -> None:
        """Return once nothing reads the live tensors any more."""
        self.staged.wait()


class StagingBuffers:
    """CPU buffers for one snapshot in flight, reused from one snapshot to the next."""

    def __init__(self) -> None:
        self._pool: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._pool.values())

    def stage(self, state: Any, *, later: frozenset[int] = frozenset()) -> StagedState:
        """Copy ``state``'s tensors into the buffers (those whose storage is in
        ``later`` are left for :meth:`StagedState.copy_deferred`) and return the
        state to write. Buffers of keys that disappeared are freed."""
        used: dict[str, torch.Tensor] = {}
        out = StagedState(state=None)
        out.state = self._walk(state, "", later, used, out)
        self._pool = used
        if any(src.device.type == "cuda" for src, _ in out.deferred):
            out.after = torch.cuda.Event()
            out.after.record()
        if out.copied is not None:
            out.copied.record()
        if not out.deferred:
            # CUDA copies run on the caller's stream, ahead of any later update to
            # the live tensors: only the writer waits for them (``copied``)
            out.staged.set()
        return out

    def _walk(self, x: Any, path: str, later: frozenset[int],
              used: dict[str, torch.Tensor], out: StagedState) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            if t.layout != torch.strided:
                return t.to("cpu", copy=True)
            buf = self._pool.get(path)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                  pin_memory=t.device.type == "cuda")
            used[path] = buf
            out.nbytes += buf.numel() * buf.element_size()
            if later and t.untyped_storage().data_ptr() in later:
                out.deferred.append((t, buf))
            elif t.device.type == "cuda":
                if out.copied is None:
                    out.copied = torch.cuda.Event()
                buf.copy_(t, non_blocking=True)
            else:
                buf.copy_(t)
            return buf
        t = type(x)
        if t in _MAPPINGS:
            d = t()
            for k, v in x.items():
                d[k] = self._walk(v, f"{path}[{k!r}]", later, used, out)
            return d
        if t in (list, tuple):
            items = [self._walk(v, f"{path}[{i}]", later, used, out) for i, v in enumerate(x)]
            return items if t is list else tuple(items)
        return x  # primitives; anything else the store's validator refuses, naming it
