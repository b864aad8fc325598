"""A relay on the device for the part of a snapshot's copy that outlasts a step.

A CUDA snapshot's parameters and optimizer state are copied to the host on a side
stream while the next forward and backward pass runs; the optimizer's step waits
(on the device) for the copies, as it changes those tensors. Where the copy takes
longer than the pass (on an H100, 89 ms for 4.83 GB against a 57 ms pass), the device
idles for the difference at every snapshot (32 ms there): the largest part of a
snapshot's cost to training, and what kept the automatic interval long.

The relay takes that difference off the optimizer's path. The last ``budget`` bytes
of the copies go first to a buffer on the device (a device-to-device copy, at the
device's memory bandwidth: about a millisecond per gigabyte on an H100), then from
there to the host after the event the optimizer's step waits for, on the same side
stream, while training goes on. Only the copies' sources are read before that event,
so the step may change them as soon as it passes.

The budget follows what was measured: after each snapshot the device's wait and the
direct copies' speed say how many more bytes to relay next time (with a quarter more
as margin); a wait that went away does not shrink it, as it would come back. It is
bounded by the bytes the copies hold, by the device's free memory, keeping
:data:`RESERVE_FRACTION` of the device (and at least :data:`RESERVE_MIN_BYTES`) free
for training, and by ``$ELASTIC_KIT_SNAPSHOT_RELAY_MAX_BYTES`` (``0``: no relay).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from elastic_kit._env import non_negative_from_env

__all__ = ["MAX_BYTES_ENV", "RESERVE_FRACTION", "RESERVE_MIN_BYTES", "DeviceRelay",
           "RelayPlan", "device_memory", "max_bytes_from_env"]

log = logging.getLogger(__name__)

#: Caps the device memory a snapshot's relay, and its mirror
#: (:mod:`elastic_kit.snapshot._mirror`), each hold in bytes (``0``: neither);
#: default: no cap beyond the device's free memory.
MAX_BYTES_ENV = "ELASTIC_KIT_SNAPSHOT_RELAY_MAX_BYTES"
#: The share of the device's memory the relay always leaves free.
RESERVE_FRACTION = 0.1
#: ... and at least this many bytes.
RESERVE_MIN_BYTES = 2 << 30
#: A device wait shorter than this is not worth a relay (seconds).
MIN_STALL_S = 0.0005
#: The budget grows by the measured shortfall times this (a margin for noise).
MARGIN = 1.25
#: Budgets are whole multiples of this (fewer reallocations of the buffer).
_GRAIN = 64 << 20


def max_bytes_from_env() -> int | None:
    """``$ELASTIC_KIT_SNAPSHOT_RELAY_MAX_BYTES`` as an int, or None when unset."""
    return non_negative_from_env(MAX_BYTES_ENV, int, "a whole number of bytes",
                                 "0: no relay")


@dataclass
class RelayPlan:
    """How one snapshot's side-stream copies go.

    Attributes:
        direct: ``(source, destination)`` pairs copied straight to the host before
            the event the optimizer's step waits for.
        to_relay: ``(source, relay piece)``: device-to-device copies, before that event.
        from_relay: ``(relay piece, destination)``: the rest of the way, after it.
        direct_bytes: the bytes of ``direct``.
    """

    direct: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    to_relay: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    from_relay: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    direct_bytes: int = 0


class DeviceRelay:
    """The relay buffer of one device and its budget (see the module).

    Args:
        max_bytes: a cap on the budget (None: the device's free memory only; 0: off).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        #: bytes relayed per snapshot (grows from measurements, see :meth:`learn`)
        self.budget = 0
        self._buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the relay holds."""
        return 0 if self._buffer is None else self._buffer.numel()

    def close(self) -> None:
        """Free the device buffer (after the writes that use it were joined)."""
        self._buffer = None

    def plan(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> RelayPlan:
        """Split ``pairs`` (CUDA source, host destination, in copy order) into direct
        copies and relayed pieces: the last :attr:`budget` bytes of the contiguous
        pairs are relayed (a tensor may be cut in two)."""
        out = RelayPlan()
        left = 0
        if self.budget > 0 and pairs:
            # never more than the copies themselves (a wait the relay cannot remove,
            # as when it already takes everything, must not grow it without end)
            total = sum(s.numel() * s.element_size() for s, d in pairs if _relayable(s, d))
            self.budget = min(self.budget, -(-total // _GRAIN) * _GRAIN)
            if self.budget > 0 and self._buffer_for(pairs[0][0].device) is not None:
                left = self.budget
        relayed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for src, dst in reversed(pairs):
            n = src.numel() * src.element_size()
            if left <= 0 or not n or not _relayable(src, dst):
                out.direct.append((src, dst))
                out.direct_bytes += n
                continue
            s, d = _bytes(src), _bytes(dst)
            k = max(0, n - left)  # bytes [k, n) are relayed
            relayed.append((s[k:], d[k:], s))
            left -= n - k
            if k:
                out.direct.append((s[:k], d[:k]))
                out.direct_bytes += k
        out.direct.reverse()
        at = 0
        assert self._buffer is not None or not relayed
        for s, d, _ in reversed(relayed):
            piece = self._buffer[at:at + s.numel()]  # type: ignore[index]
            out.to_relay.append((s, piece))
            out.from_relay.append((piece, d))
            at += s.numel()
        return out

    def learn(self, stall_s: float, direct_bytes: int, copy_s: float) -> None:
        """Grow the budget by the bytes the device waited for: ``stall_s`` seconds of
        wait, with ``direct_bytes`` copied straight to the host in ``copy_s`` seconds
        on the side stream."""
        if self.max_bytes == 0 or stall_s < MIN_STALL_S or direct_bytes <= 0 or copy_s <= 0:
            return
        more = MARGIN * stall_s * direct_bytes / copy_s
        budget = -(-int(self.budget + more) // _GRAIN) * _GRAIN
        if self.max_bytes is not None:
            budget = min(budget, self.max_bytes)
        if budget > self.budget:
            log.debug("snapshot relay: the device waited %.1f ms; relaying %d MB per "
                      "snapshot from now", stall_s * 1e3, budget >> 20)
            self.budget = budget

    def _buffer_for(self, device: torch.device) -> torch.Tensor | None:
        """The relay buffer (made or grown to the budget where the device's free
        memory allows; else the budget shrinks to what fits)."""
        buf = self._buffer
        if buf is not None and buf.numel() >= self.budget and buf.device == device:
            return buf
        held = 0 if buf is None or buf.device != device else buf.numel()
        free, total = device_memory(device)
        room = free + held - max(RESERVE_MIN_BYTES, int(RESERVE_FRACTION * total))
        size = min(self.budget, max(0, room) // _GRAIN * _GRAIN)
        if size <= 0:
            log.debug("snapshot relay: no room on %s (free %d MB)", device, free >> 20)
            self.budget, self._buffer = 0, None
            return None
        self._buffer = None  # free the smaller one first
        try:
            self._buffer = torch.empty(size, dtype=torch.uint8, device=device)
        except RuntimeError as e:  # out of memory after all: no relay
            log.debug("snapshot relay: cannot allocate %d MB on %s: %r", size >> 20, device, e)
            self.budget = 0
            return None
        self.budget = size
        return self._buffer


def _relayable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether a pair can be cut into byte ranges (both contiguous, alike)."""
    return (src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
            and src.shape == dst.shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def device_memory(device: torch.device) -> tuple[int, int]:
    """The device's free and total bytes (the CPU, for tests: unlimited)."""
    if device.type != "cuda":
        return 1 << 62, 1 << 62
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)
