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
copied later, overlapping the next forward and backward pass:

- CUDA tensors going into pinned buffers (pinned staging, or a snapshot file
  registered as pinned memory) are copied on a side stream, issued at once: the
  training thread never waits for them. :meth:`StagedState.wait_staged` (before the
  optimizer step) makes the caller's stream wait for the copies on the device, so
  the step's kernels run after them while the CPU goes on; the device idles only
  where a copy outlasts the forward and backward pass it overlaps.
- The rest (CPU tensors, or pageable destinations, whose device-to-host copy would
  block the thread that issues it) are copied on the writer thread.

CUDA tensors going into a registered snapshot file go through the device's mirror of
the file where it has room (:mod:`elastic_kit.snapshot._mirror`): a few multi-tensor
copies on the training stream instead of one launch per tensor, and nothing for the
optimizer's step to wait for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Sequence

import torch

from elastic_kit.snapshot._mirror import DeviceMirror, MirrorCopy
from elastic_kit.snapshot._relay import DeviceRelay
from elastic_kit.snapshot._streams import side_stream
from elastic_kit.store import FlatPlan, map_tree, storable

__all__ = ["DeviceStall", "FileTarget", "StagingBuffers", "StagedState", "storage_keys"]



def storage_keys(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The storage addresses of ``tensors`` (a parameter matches the ``detach()``
    view its module's ``state_dict()`` returns)."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors
                     if isinstance(t, torch.Tensor) and _dense(t))


def _dense(t: torch.Tensor) -> bool:
    """A plain strided tensor, which a buffer of its shape and dtype can hold (not
    quantized or nested: strided too, but ``torch.empty`` cannot make their like)."""
    return t.layout == torch.strided and not t.is_quantized and not t.is_nested


class FileTarget(NamedTuple):
    """A snapshot file to stage straight into.

    Attributes:
        plan: its layout.
        views: each of the plan's tensors, as a view of ``mapped``.
        mapped: the file's mapping (1-D ``uint8``).
        pinned: the mapping is registered with CUDA as pinned memory.
    """

    plan: FlatPlan
    views: Sequence[torch.Tensor]
    mapped: torch.Tensor
    pinned: bool = False


@dataclass
class DeviceStall:
    """How long a stream waited on the device for a snapshot's side-stream copies.

    Attributes:
        done: the event recorded after the copies on the side stream that the
            optimizer's step waits for.
        mark: the event recorded on the waiting stream just before its wait (None
            until a stream waits). Both time their completion.
        start: the event recorded on the side stream before the copies.
        direct_bytes: the bytes copied straight to the host before :attr:`done` (the
            rest went through the device's relay; see :mod:`elastic_kit.snapshot._relay`).
    """

    done: Any
    mark: Any = None
    start: Any = None
    direct_bytes: int = 0

    def seconds(self) -> float | None:
        """The wait (0 when the copies were done before the stream got there); None
        until both are known (no stream waited, or they are still running)."""
        mark, done = self.mark, self.done
        if mark is None or not (mark.query() and done.query()):
            return None
        return max(0.0, mark.elapsed_time(done) / 1000.0)

    def copy_seconds(self) -> float | None:
        """How long the side stream took from its start to :attr:`done` (the
        relay's device copies and the ``direct_bytes`` copied straight to the host);
        None until known."""
        start, done = self.start, self.done
        if start is None or not (start.query() and done.query()):
            return None
        return max(0.0, start.elapsed_time(done) / 1000.0)


@dataclass
class StagedState:
    """A state dict whose tensors are (or are about to be) copies in CPU buffers.

    Attributes:
        state: the state dict to write, with CPU tensors in place of the live ones.
        deferred: ``(live, buffer)`` pairs to copy later (:meth:`copy_deferred`).
        after: a CUDA event recorded when the snapshot was taken: deferred CUDA
            copies wait for it, so they see every update issued before.
        copied: a CUDA event marking the end of the copies issued at staging time
            (None without CUDA tensors).
        staged: set once nothing reads the live tensors any more, or (device
            copies on the side stream) once the caller's stream waits for them.
        side_done: a CUDA event recorded on the side stream after the copies issued
            there at staging time that read the live tensors (None without them).
        side_all: an event after the relay's copies to the host, which follow
            ``side_done`` on the side stream (None without a relay).
        side_device: the device of those copies.
        device: the CUDA device whose streams carry this snapshot's copies and
            events: its first CUDA tensor's (None without CUDA tensors). A tensor
            on another device (a state spread over several) is copied at once,
            synchronously, so that every event here covers every copy.
        stall: the device's wait for them before the optimizer step.
        nbytes: the tensors' bytes.
        into_file: the tensors were staged straight into a snapshot file's views.
        cuda: some of the tensors are on a CUDA device.
        mirrored: the copy through the device's mirror (see
            :mod:`elastic_kit.snapshot._mirror`), None without one.
    """

    state: Any
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    after: Any = None
    copied: Any = None
    side_done: Any = None
    side_all: Any = None
    side_device: torch.device | None = None
    device: torch.device | None = None
    stall: DeviceStall | None = None
    staged: threading.Event = field(default_factory=threading.Event)
    nbytes: int = 0
    into_file: bool = False
    cuda: bool = False
    mirrored: MirrorCopy | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _next: int = field(default=0, repr=False)  # the next deferred CPU pair to copy
    _active: int = field(default=0, repr=False)  # CPU pairs being copied now

    def _cpu_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [p for p in self.deferred if not p[0].is_cuda]

    def _copy_cpu(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy deferred CPU pairs not yet taken, one at a time; the writer thread and
        a training thread waiting in :meth:`wait_staged` share the work."""
        while True:
            with self._cond:
                if self._next >= len(pairs):
                    return
                src, dst = pairs[self._next]
                self._next += 1
                self._active += 1
            try:
                dst.copy_(src)
            finally:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()

    def copy_deferred(self) -> None:
        """Fill the buffers left empty, then mark the state staged (on the writer
        thread; also on failure, so that no training thread waits forever)."""
        try:
            deferred = self.deferred
            cpu = [p for p in deferred if not p[0].is_cuda]
            cuda = [p for p in deferred if p[0].is_cuda]
            self._copy_cpu(cpu)
            with self._cond:  # a pair the training thread took may still be copied
                self._cond.wait_for(lambda: self._active == 0)
            if cuda:
                stream = side_stream(cuda[0][0].device)
                if self.after is not None:
                    stream.wait_event(self.after)
                with torch.cuda.stream(stream):
                    for src, dst in cuda:
                        dst.copy_(src, non_blocking=True)
                stream.synchronize()
            if self.copied is not None:
                self.copied.synchronize()
            if self.side_done is not None:
                self.side_done.synchronize()
            if self.side_all is not None:
                self.side_all.synchronize()
            if self.mirrored is not None and self.mirrored.read is not None:
                self.mirrored.read.synchronize()
        finally:
            self.staged.set()

    def discard(self) -> None:
        """Give up the deferred copies (a newer snapshot replaces this one before it
        was written, and copies everything again into the same buffers)."""
        with self._cond:
            self._next = len(self.deferred)
            self._cond.wait_for(lambda: self._active == 0)
        self.staged.set()

    def side_events(self) -> list[Any]:
        """The events that end this snapshot's copies on the snapshot stream (into
        its buffers or file; empty without them). A copy on the training stream
        (``copied``) needs none: a later copy on that stream runs after it."""
        events = [self.side_done, self.side_all,
                  None if self.mirrored is None else self.mirrored.read]
        return [e for e in events if e is not None]

    def fence(self) -> None:
        """Make the training stream wait, on the device, for this snapshot's copies
        on the snapshot stream (the CPU does not wait).

        Called on the training thread when a newer snapshot replaces this one
        before it was written and takes over its buffers: the newer one's copies
        may be issued on the training stream, which nothing else orders after
        these, and the writer would then read buffers (or a file) that a copy of
        this older snapshot still writes into."""
        if self.device is None:
            return
        events = self.side_events()
        if events:
            stream = torch.cuda.current_stream(self.device)
            for event in events:
                stream.wait_event(event)

    def wait_staged(self) -> None:
        """Return once nothing reads the live tensors any more, or, for the copies on
        the side stream, once the caller's current stream waits for them (on the
        device: the CPU does not wait).

        The caller (the training thread, before the optimizer step) copies deferred
        CPU tensors the writer thread has not reached yet instead of waiting for it:
        on a busy machine the writer may get little CPU, and the wait stays bounded
        by one copy of what is left."""
        if self.staged.is_set():
            return
        if self.stall is not None:
            with self._cond:
                if self.stall.mark is None:  # once, on the training thread's stream
                    stream = torch.cuda.current_stream(self.side_device)
                    mark = torch.cuda.Event(enable_timing=True)
                    mark.record(stream)
                    stream.wait_event(self.stall.done)
                    self.stall.mark = mark
        cpu = self._cpu_pairs()
        self._copy_cpu(cpu)
        if len(cpu) == len(self.deferred):
            # no deferred copy left to the writer thread: done once the last CPU copy
            # ends (copies issued at staging time run on the caller's stream, or on
            # the side stream it now waits for, ahead of any later update)
            with self._cond:
                self._cond.wait_for(lambda: self._active == 0)
            self.staged.set()
        self.staged.wait()

class _Unfit(Exception):
    """The state's tensors do not have the snapshot file's layout (internal)."""


class StagingBuffers:
    """CPU buffers for one snapshot in flight, reused from one snapshot to the next."""

    def __init__(self) -> None:
        self._pool: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._pool.values())

    def stage(self, state: Any, *, later: frozenset[int] = frozenset(),
              into: FileTarget | None = None, relay: DeviceRelay | None = None,
              mirror: DeviceMirror | None = None) -> StagedState:
        """Copy ``state``'s tensors into the buffers (those whose storage is in
        ``later`` are left for later: see the module) and return the state to write.
        Buffers of keys that disappeared are freed.

        ``into``: a snapshot file to copy into instead. The state's storable tensors
        (:func:`~elastic_kit.store.storable`, in tree order) are copied into its views,
        which are then the staged tensors (one copy, straight into the snapshot), when
        they have the plan's keys, dtypes and shapes; when they do not (the state
        changed its layout), everything is staged into the pooled buffers instead and
        :attr:`StagedState.into_file` is False. The state is walked once, and nothing
        is copied before the whole walk showed that it fits. The pooled buffers are
        kept for the next snapshot that cannot go straight into a file.

        ``relay``: the device's relay, which takes part of the side stream's copies
        off the optimizer's path. ``mirror``: the device's mirror of the file, through
        which the CUDA tensors go into a registered file where it has room (see
        :mod:`elastic_kit.snapshot._mirror`)."""
        if into is not None:
            try:
                return self._stage(state, later, into, relay, mirror)
            except _Unfit:
                pass
        return self._stage(state, later, None, relay, None)

    def _stage(self, state: Any, later: frozenset[int], into: FileTarget | None,
               relay: DeviceRelay | None, mirror: DeviceMirror | None) -> StagedState:
        pool = self._pool
        used: dict[str, torch.Tensor] = {}
        # live, buffer, pinned, index in the file's plan (-1: a pooled buffer)
        copies: list[tuple[torch.Tensor, torch.Tensor, bool, int]] = []
        plan = None if into is None else into.plan
        views: Sequence[torch.Tensor] = () if into is None else into.views
        keys: Sequence[str] = () if plan is None else plan.keys
        pinned_file = into is not None and into.pinned
        # the first CUDA tensor's device, for the mirror (looked for only when it is used)
        device: torch.device | None = None
        find_device = mirror is not None and pinned_file
        taken = 0  # the plan's tensors matched so far

        def leaf(path: str, x: Any) -> Any:
            nonlocal taken, device
            if not isinstance(x, torch.Tensor):
                return x  # primitives; anything else the store's validator refuses, naming it
            # a state dict's tensors are mostly detached already; detaching each again
            # costs about 0.3 us per tensor of the training thread's time
            t = x.detach() if x.requires_grad else x
            if not _dense(t):
                return t.to("cpu", copy=True)
            if plan is not None:
                i = taken
                # the plan's next key: a tensor of its (storable) dtype is storable
                fits = i < len(keys) and keys[i] == path and plan.dtypes[i] == t.dtype
                if fits or storable(t):
                    if not fits or plan.shapes[i] != t.shape:
                        raise _Unfit
                    taken = i + 1
                    copies.append((t, views[i], pinned_file, i))
                    if find_device and device is None and _mirrorable(t):
                        device = t.device
                    return views[i]
            buf = pool.get(path)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            used[path] = buf
            copies.append((t, buf, t.is_cuda, -1))
            return buf

        out = StagedState(state=map_tree(state, leaf), into_file=plan is not None)
        if plan is not None and taken != len(views):
            raise _Unfit
        if plan is None:
            self._pool = used
        mirror_views = None
        if mirror is not None and pinned_file and device is not None:
            assert plan is not None
            mirror_views = mirror.views(plan, device)
        mirrored: list[tuple[int, torch.Tensor]] = []
        side: list[tuple[torch.Tensor, torch.Tensor]] = []
        primary: torch.device | None = None  # the device of the first CUDA tensor
        for t, buf, pinned, i in copies:
            out.nbytes += buf.nbytes
            cuda = t.is_cuda
            out.cuda = out.cuda or cuda
            if cuda and primary is None:
                primary = t.device
            elif cuda and t.device != primary:
                # another device's tensor: copied now, so that the snapshot's events
                # (on the first device's streams) need not cover a second device
                buf.copy_(t)
                continue
            if (mirror_views is not None and i >= 0 and t.numel() and t.device == device
                    and _mirrorable(t)):
                mirrored.append((i, t))
                continue
            deferred = bool(later) and t.untyped_storage().data_ptr() in later
            if deferred and cuda and pinned:
                side.append((t, buf))
            elif deferred:
                out.deferred.append((t, buf))
            elif cuda:
                if out.copied is None:
                    out.copied = torch.cuda.Event()
                buf.copy_(t, non_blocking=True)
            else:
                buf.copy_(t)
        if mirrored:
            assert mirror is not None and into is not None
            out.mirrored = mirror.copy(into.plan, into.mapped, mirrored)
        if side:
            _copy_on_side_stream(side, out, relay)
        out.device = primary
        # recorded on the state's device: the training thread's current device may be
        # another one (a script that never called torch.cuda.set_device)
        if any(src.is_cuda for src, _ in out.deferred):
            out.after = torch.cuda.Event()
            out.after.record(torch.cuda.current_stream(primary))
        if out.copied is not None:
            out.copied.record(torch.cuda.current_stream(primary))
        if not out.deferred and out.side_done is None:
            # CUDA copies run on the caller's stream, ahead of any later update to
            # the live tensors: only the writer waits for them (``copied``)
            out.staged.set()
        return out


_NO_RELAY = DeviceRelay(max_bytes=0)  # every copy straight to the host


def _mirrorable(t: torch.Tensor) -> bool:
    """Whether ``t`` goes through the device's mirror (when the file and the mirror
    allow): a CUDA tensor. Tests on the CPU widen it, the CPU standing in."""
    return t.is_cuda


def _copy_on_side_stream(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                         out: StagedState, relay: DeviceRelay | None = None) -> None:
    """Issue the device-to-host copies of ``pairs`` (CUDA source, pinned buffer) on
    the device's snapshot stream, after the work queued so far on the caller's
    stream; ``out.side_done`` marks the end of those that read the live tensors.

    With a ``relay`` the last of its budget's bytes go to its device buffer first
    (before ``side_done``) and on to the host after it (``out.side_all``)."""
    device = pairs[0][0].device
    stream = side_stream(device)
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)  # sees every update issued before the snapshot
    plan = (relay or _NO_RELAY).plan(pairs)
    with torch.cuda.stream(stream):
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for src, piece in plan.to_relay:
            piece.copy_(src, non_blocking=True)
        for src, dst in plan.direct:
            dst.copy_(src, non_blocking=True)
        for src, _ in pairs:
            src.record_stream(stream)  # not reused by the allocator while read here
        out.side_done = torch.cuda.Event(enable_timing=True)
        out.side_done.record(stream)
        if plan.from_relay:
            for piece, dst in plan.from_relay:
                dst.copy_(piece, non_blocking=True)
                piece.record_stream(stream)  # the relay's buffer, made on another stream
            out.side_all = torch.cuda.Event()
            out.side_all.record(stream)
    out.side_device = device
    out.stall = DeviceStall(out.side_done, start=start, direct_bytes=plan.direct_bytes)
