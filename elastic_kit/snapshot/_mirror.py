"""A mirror of the snapshot file on the device: the state in a few launches.

A CUDA snapshot copied tensor by tensor costs the training thread one launch per
tensor (a driver call and Python around it, several microseconds each), whatever
the tensor's size. A ResNet-50's state is about 480 tensors: a few milliseconds per
snapshot, which is most of what a snapshot costs a GPU worker's training thread,
and what sets the automatic interval (so the steps a worker with no surviving peer
redoes after a SIGKILL).

The mirror is a buffer on the device laid out like the snapshot file (the same
offsets, its padding zero). A snapshot then takes:

- one multi-tensor copy per dtype (``torch._foreach_copy_``: a few kernels for
  hundreds of tensors) of the state's CUDA tensors into the mirror, on the training
  stream, so it is the state of this step whatever the kernels queued after it do,
  at the device's memory bandwidth (about 0.1 ms for 200 MB on an H100); its time on
  the device is measured with two events and counted in the snapshot's cost;
- then, on the snapshot stream, one device-to-host copy per run of the file that
  only the mirror fills (usually one or two; a tensor on the CPU, such as a random
  generator's state, ends a run) into the file's registered mapping, while training
  goes on. Nothing waits for it but the writer, and the next copy into the mirror
  (on the device).

The optimizer's step never waits for it, as it does for the side stream's copies
of a snapshot staged another way (see :mod:`elastic_kit.snapshot._staging`).

Its cost is memory: one state's size on the device, held while snapshots are on.
It is made only where it leaves :data:`~._relay.RESERVE_FRACTION` of the device
(and at least :data:`~._relay.RESERVE_MIN_BYTES`) free, takes at most
:data:`MAX_FRACTION` of the device, and at most
``$ELASTIC_KIT_SNAPSHOT_RELAY_MAX_BYTES`` (the cap on the device memory snapshots
hold, shared with the relay; ``0``: neither). Where it is not made, a snapshot is
staged as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from elastic_kit.snapshot._relay import RESERVE_FRACTION, RESERVE_MIN_BYTES, device_memory
from elastic_kit.snapshot._streams import side_stream
from elastic_kit.store import FlatPlan, tensor_views

__all__ = ["MAX_FRACTION", "DeviceMirror", "MirrorCopy", "mirror_runs"]

log = logging.getLogger(__name__)

#: The most of a device's memory a mirror takes.
MAX_FRACTION = 0.25


@dataclass
class MirrorCopy:
    """The events of one snapshot's copy through the mirror (all None on the CPU,
    which stands in for the device in tests: its copies are done on return).

    Attributes:
        begin, end: recorded on the training stream around the copy into the mirror
            (timing events: the device's time in it).
        read: recorded on the snapshot stream after the copies into the file; the
            writer waits for it.
    """

    begin: Any = None
    end: Any = None
    read: Any = None

    def seconds(self) -> float | None:
        """The training stream's time in the copy into the mirror; None until known."""
        begin, end = self.begin, self.end
        if begin is None or not (begin.query() and end.query()):
            return None
        return max(0.0, begin.elapsed_time(end) / 1000.0)


def mirror_runs(plan: FlatPlan, mirrored: Sequence[bool]) -> list[tuple[int, int]]:
    """The byte ranges of the file that only the mirror fills: runs of consecutive
    tensors ``mirrored[i]``, from the first's offset to the last's end (with the
    padding between them, zero in both). An empty tensor neither ends nor makes a
    run; any other tensor not mirrored ends one."""
    runs: list[tuple[int, int]] = []
    start = end = -1
    for i, offset in enumerate(plan.offsets):
        n = plan.nbytes(i)
        if n == 0:
            continue
        if not mirrored[i]:
            if start >= 0:
                runs.append((start, end))
            start = -1
            continue
        if start < 0:
            start = offset
        end = offset + n
    if start >= 0:
        runs.append((start, end))
    return runs


class DeviceMirror:
    """The mirror buffer of one device, for one layout at a time (see the module).

    Args:
        max_bytes: a cap on its size (None: the module's limits only; 0: off).
        max_fraction: the most of the device's memory it takes.
    """

    def __init__(self, max_bytes: int | None = None, *,
                 max_fraction: float = MAX_FRACTION) -> None:
        self.max_bytes = max_bytes
        self.max_fraction = max_fraction
        self._buffer: torch.Tensor | None = None
        self._plan: FlatPlan | None = None
        self._views: list[torch.Tensor] = []
        self._refused: FlatPlan | None = None  # a layout it has no room for
        self._read: Any = None  # the last copy out of the buffer
        self._runs: tuple[tuple[bool, ...], list[tuple[int, int]]] = ((), [])
        self._alike: list[FlatPlan] = []  # plan objects known to equal ``_plan``

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the mirror holds."""
        return 0 if self._buffer is None else self._buffer.numel()

    def close(self) -> None:
        """Free the buffer (after the writes that read it were joined)."""
        self._buffer, self._plan, self._views, self._read = None, None, [], None
        self._runs, self._alike = ((), []), []

    def views(self, plan: FlatPlan, device: torch.device) -> list[torch.Tensor] | None:
        """``plan``'s tensors as views of the mirror on ``device``, made (zeroed) for
        this layout the first time, where the limits allow; None where they do not
        (asked again only for another layout)."""
        if self._buffer is not None and self._buffer.device == device:
            # the two snapshot files each have their own plan object, alike
            if any(p is plan for p in self._alike):
                return self._views
            if self._plan == plan:
                self._alike = (self._alike + [plan])[-4:]
                return self._views
        if self.max_bytes == 0:
            return None
        if self._refused is not None and (self._refused is plan or self._refused == plan):
            self._refused = plan  # the same object next time: no comparison
            return None
        held = self.nbytes if self._buffer is not None and self._buffer.device == device else 0
        free, total = device_memory(device)
        room = min(free + held - max(RESERVE_MIN_BYTES, int(RESERVE_FRACTION * total)),
                   int(self.max_fraction * total))
        if self.max_bytes is not None:
            room = min(room, self.max_bytes)
        if plan.size > room:
            log.debug("snapshot mirror: %d MB do not fit on %s (room %d MB)",
                      plan.size >> 20, device, max(0, room) >> 20)
            self._refused = plan
            return None
        if self._read is not None:
            self._read.synchronize()  # the last copy out of the old buffer
        self.close()
        try:
            buf = torch.zeros(plan.size, dtype=torch.uint8, device=device)
        except RuntimeError as e:  # out of memory after all: no mirror
            log.debug("snapshot mirror: cannot allocate %d MB on %s: %r",
                      plan.size >> 20, device, e)
            self._refused = plan
            return None
        self._buffer, self._plan, self._alike = buf, plan, [plan]
        self._views = tensor_views(buf, plan)
        log.debug("snapshot mirror: %d MB on %s", plan.size >> 20, device)
        return self._views

    def copy(self, plan: FlatPlan, mapped: torch.Tensor,
             pairs: Sequence[tuple[int, torch.Tensor]]) -> MirrorCopy:
        """Copy ``pairs`` (index in ``plan``, live tensor on the mirror's device) into
        the mirror on the current stream, then the runs they fill into ``mapped``
        (the file's mapping, registered) on the snapshot stream. Call :meth:`views`
        for ``plan`` first."""
        buf = self._buffer
        assert buf is not None and any(p is plan for p in self._alike), "views() first"
        groups: dict[tuple[torch.dtype, bool], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        mirrored = [False] * len(plan.keys)
        for i, src in pairs:
            # one list per dtype, and the non-contiguous apart: the multi-tensor
            # kernel takes a list only where every pair is alike
            dsts, srcs = groups.setdefault((src.dtype, src.is_contiguous()), ([], []))
            dsts.append(self._views[i])
            srcs.append(src)
            mirrored[i] = True
        key = tuple(mirrored)
        if self._runs[0] != key:
            self._runs = (key, mirror_runs(plan, mirrored))
        runs = self._runs[1]
        if buf.device.type != "cuda":  # the stand-in: done on return
            for (dtype, _), (dsts, srcs) in groups.items():
                _copy_group(dtype, dsts, srcs)
            for a, b in runs:
                mapped[a:b].copy_(buf[a:b])
            return MirrorCopy()
        stream = torch.cuda.current_stream(buf.device)
        if self._read is not None:
            stream.wait_event(self._read)  # the last copy out of the mirror
        out = MirrorCopy(begin=torch.cuda.Event(enable_timing=True),
                         end=torch.cuda.Event(enable_timing=True), read=torch.cuda.Event())
        out.begin.record(stream)
        for (dtype, _), (dsts, srcs) in groups.items():
            _copy_group(dtype, dsts, srcs)
        out.end.record(stream)
        side = side_stream(buf.device)
        side.wait_event(out.end)
        with torch.cuda.stream(side):
            for a, b in runs:
                mapped[a:b].copy_(buf[a:b], non_blocking=True)
            out.read.record(side)
        buf.record_stream(side)
        self._read = out.read
        return out


#: The dtypes torch's multi-tensor copy takes on CUDA (its kernel is compiled for
#: these); a tensor of another (``uint16``, ``complex32``, ...) is copied on its own.
FOREACH_DTYPES = frozenset(
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
     torch.complex128, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
     torch.bool]
    + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                   "float8_e5m2fnuz") if hasattr(torch, n)])


def _copy_group(dtype: torch.dtype, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy ``srcs`` (all of ``dtype``) into ``dsts``: in one multi-tensor copy where
    its kernel takes the dtype, else one copy each."""
    if dtype in FOREACH_DTYPES:
        torch._foreach_copy_(dsts, srcs)
    else:
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)

