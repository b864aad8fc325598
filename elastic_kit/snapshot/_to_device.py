"""A mapped snapshot copied to a CUDA device through a few reused pinned buffers.

A restore maps the snapshot file privately (copy-on-write). Its tensors can reach a
GPU three ways:

- Straight from the mapping: pageable memory, which the driver stages through a
  small pinned buffer of its own, one copy at a time (about 1 GB/s measured on an
  H100 host).
- Registering the whole mapping as pinned memory (``cudaHostRegister``) first: the
  copies then run at the bus's speed, but the registration pins every page of the
  file, and the unregistration unpins them, both in proportion to the state's size.
  That was this tier's restore on an H100 host: 2.8 s to load 4.83 GB, against 0.09 s
  for the copy to the device itself.
- Through a few pinned buffers, reused (what :func:`copy_to_device` does): the shared
  thread pool copies the next window of the mapping into one buffer (host memory
  bandwidth, spread over threads, not one core's) while the window before goes to the
  device on a side stream; a buffer is refilled once the event after its copy has
  completed. The host copy and the bus overlap, and only the buffers are pinned
  (once: torch's caching host allocator keeps them).

The tensors on the device are allocated one by one, as ``Tensor.to`` would: a consumer
that keeps one of them (an optimizer's state) holds only that tensor's memory.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from elastic_kit.store import copy_tensors, map_tree

__all__ = ["WINDOW_BYTES", "WINDOWS", "copy_to_device"]

#: Bytes of the mapping copied to the device per pinned buffer fill.
WINDOW_BYTES = 128 << 20
#: Pinned buffers in turn: one filled on the host while the others' copies run.
WINDOWS = 3
#: Bytes one pool thread copies at a time (a window is spread over the pool).
_PIECE_BYTES = 16 << 20

#: one piece of a window: (offset in the mapping, bytes, where in the destination,
#: offset in the pinned buffer)
_Piece = tuple[int, int, torch.Tensor, int]


def copy_to_device(mapped: torch.Tensor, state: Any, device: torch.device,
                   phases: dict[str, float] | None = None, *,
                   window_bytes: int = WINDOW_BYTES, windows: int = WINDOWS) -> Any:
    """``state`` (whose tensors are views of the 1-D ``uint8`` CPU tensor ``mapped``)
    with each tensor copied to ``device``, through ``windows`` reused buffers of
    ``window_bytes`` (pinned where ``device`` is CUDA; the copies to the device are
    issued on a side stream, which is waited for before returning).

    Tensors that are not contiguous views of ``mapped`` are copied with ``.to``.
    ``phases``: receives the seconds spent allocating (``alloc_s``) and copying
    (``copy_s``), and the bytes copied through the buffers (``bytes``)."""
    if window_bytes < 1 or windows < 1:
        raise ValueError(f"window_bytes={window_bytes} and windows={windows} must be >= 1")
    phases = {} if phases is None else phases
    t0 = time.perf_counter()
    base = mapped.data_ptr()
    end = base + mapped.numel()
    spans: list[tuple[int, int, torch.Tensor]] = []

    def leaf(_: str, v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if (v.device.type == "cpu" and v.layout == torch.strided and v.is_contiguous()
                and v.numel() and base <= v.data_ptr() and v.data_ptr() + v.nbytes <= end):
            out = torch.empty(v.shape, dtype=v.dtype, device=device)
            spans.append((v.data_ptr() - base, v.nbytes, out.view(-1).view(torch.uint8)))
            return out
        return v.to(device, copy=True)

    out = map_tree(state, leaf)
    plan = _windows(spans, window_bytes)
    cuda = device.type == "cuda"
    size = max((sum(p[1] for p in w) for w in plan), default=0)
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
               for _ in range(min(windows, len(plan)))]
    t1 = time.perf_counter()
    stream = torch.cuda.Stream(device) if cuda and plan else None
    if stream is not None:  # the destinations were allocated on the current stream
        stream.wait_stream(torch.cuda.current_stream(device))
    done: list[Any] = [None] * len(buffers)
    for w, pieces in enumerate(plan):
        i = w % len(buffers)
        if done[i] is not None:
            done[i].synchronize()  # the copy out of this buffer has finished
        buf = buffers[i]
        copy_tensors([(buf[at:at + n], mapped[src:src + n]) for src, n, _, at in pieces],
                     piece_bytes=_PIECE_BYTES)
        if stream is None:
            for _, n, dst, at in pieces:
                dst.copy_(buf[at:at + n])
            continue
        with torch.cuda.stream(stream):
            for _, n, dst, at in pieces:
                dst.copy_(buf[at:at + n], non_blocking=True)
            done[i] = stream.record_event()
    if stream is not None:
        stream.synchronize()
    phases["alloc_s"] = t1 - t0
    phases["copy_s"] = time.perf_counter() - t1
    phases["bytes"] = float(sum(n for _, n, _ in spans))
    return out


def _windows(spans: list[tuple[int, int, torch.Tensor]], window_bytes: int) -> list[list[_Piece]]:
    """The spans' bytes in mapping order, cut into windows of at most
    ``window_bytes`` (a tensor larger than a window spans several)."""
    plan: list[list[_Piece]] = []
    current: list[_Piece] = []
    used = 0
    for offset, nbytes, dst in sorted(spans, key=lambda s: s[0]):
        done = 0
        while done < nbytes:
            if used == window_bytes:
                plan.append(current)
                current, used = [], 0
            n = min(nbytes - done, window_bytes - used)
            current.append((offset + done, n, dst[done:done + n], used))
            done += n
            used += n
    if current:
        plan.append(current)
    return plan
