"""The snapshot writer: one thread that writes staged snapshots, newest first.

The training thread must never wait for a write: a write (serialising the state into
shared memory, hashing it, committing the manifest, deleting the previous snapshot)
takes longer than the copy that stages a snapshot, and on a GPU longer than many
steps. So the writer holds at most one snapshot *in flight* and one *queued*: a
snapshot taken while another is written waits in the queue, and a newer one taken
before the queued one started replaces it (its buffers are reused). Each committed
snapshot is thus the newest state that was staged when the previous write ended.

Two buffer sets rotate between the in-flight and the queued snapshot; the second is
allocated only the first time a snapshot is taken while another is written.

Between writes the thread also runs one *preparation* at a time (:meth:`prepare`:
making the snapshot file the next snapshot is copied into, which takes seconds for a
large state), so that neither the training thread nor a write waits for it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from elastic_kit.snapshot._slots import Slot
from elastic_kit.snapshot._staging import StagedState, StagingBuffers
from elastic_kit.store import pool_cpu_seconds

__all__ = ["Job", "SnapshotWriter"]

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One snapshot to write: its staged state, step and metadata."""

    staged: StagedState
    step: int
    metadata: dict[str, Any]
    buffers: StagingBuffers
    #: when it was taken (``time.perf_counter()``), for the commit latency
    taken_at: float = field(default_factory=time.perf_counter)
    #: the snapshot file it was staged into directly (None: into ``buffers``)
    slot: Slot | None = None
    #: completes the staged state on the writer thread before it is written
    finish: Callable[[Any], None] | None = None
    #: when its manifest was committed (set by ``write``; None: at the write's end).
    #: What follows the commit in a write (deleting the older snapshot, making the
    #: next file) is not part of the commit latency.
    committed_at: float | None = None


class SnapshotWriter:
    """Writes :class:`Job`\\ s on one background thread with ``write(job)``.

    Args:
        write: writes and commits one job (called on the writer thread); an error
            it raises is kept and returned once by :meth:`take_error`.
        name: the thread's name.

    Attributes:
        written: steps committed, in order.
        replaced: steps whose queued snapshot a newer one replaced before it was
            written (the newer one is written instead).
        last_write_s: seconds the last write took on the writer thread.
        last_commit_latency_s: seconds from taking the last written snapshot to its
            commit (its manifest written: restorable from then on).
        write_cpu_s: for each write, whether its state was on CUDA and the CPU
            seconds it took (this thread's and the shared thread pool's over the
            write, which includes pool work of other writers meanwhile, if any); the
            newest last.
    """

    def __init__(self, write: Callable[[Job], None], *, name: str = "ek-ckpt-snapshot") -> None:
        self._write = write
        self._name = name
        self._cond = threading.Condition()
        self._queued: Job | None = None
        self._inflight: Job | None = None
        self._closed = False
        self._task: Callable[[], None] | None = None  # a preparation not started yet
        self._preparing = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._sets = [StagingBuffers()]
        #: the CUDA device the writer thread makes its own (see _follow_device): the
        #: device of the last snapshot's state, else the one current on the thread
        #: that hands work over (None: CUDA not in use)
        self._device: int | None = None
        self._state_device = False  # _device is a snapshot's state's
        self.written: list[int] = []
        self.replaced: list[int] = []
        self.last_write_s = 0.0
        self.last_commit_latency_s = 0.0
        self.write_cpu_s: collections.deque[tuple[bool, float]] = collections.deque(maxlen=100)

    # ------------------------------------------------------------ training thread
    @property
    def busy(self) -> bool:
        """Whether a snapshot is being written or waits to be."""
        with self._cond:
            return self._inflight is not None or self._queued is not None

    def buffers(self) -> tuple[StagingBuffers, bool]:
        """The buffers to stage the next snapshot into, and whether the writer is
        idle (so the snapshot will be written at once and copies may be deferred to
        the writer thread). A queued snapshot not yet started is taken back: its
        buffers are reused and the newer snapshot replaces it."""
        with self._cond:
            if self._queued is not None:
                job, self._queued = self._queued, None
                job.staged.discard()  # the newer snapshot copies everything again
                # the newer snapshot's copies into these buffers (or the writer's
                # into this file) come after this one's still running on the device
                job.staged.fence()
                if job.slot is not None:  # its file is free for the next snapshot
                    job.slot.pending = job.staged.side_events()
                    job.slot.busy = False
                self.replaced.append(job.step)
                log.debug("snapshot step %d is replaced by a newer one before it was "
                          "written", job.step)
                return job.buffers, False
            if self._inflight is None:
                return self._sets[0], True
            free = [b for b in self._sets if b is not self._inflight.buffers]
            if not free:
                free = [StagingBuffers()]
                self._sets.append(free[0])
            return free[0], False

    def submit(self, job: Job) -> None:
        """Queue ``job`` (staged into the buffers :meth:`buffers` returned)."""
        with self._cond:
            self._closed = False
            self._queued = job
            self._start(job.staged.device)

    def prepare(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the writer thread when no snapshot waits to be written
        (replacing a preparation not started yet). An error it raises is kept like a
        failed write's; :meth:`close` drops one that has not started."""
        with self._cond:
            self._closed = False
            self._task = task
            self._start()

    def _start(self, device: torch.device | None = None) -> None:  # with self._cond held
        if device is not None and device.index is not None:  # the state's device
            self._device, self._state_device = device.index, True
        elif not self._state_device and torch.cuda.is_initialized():  # (never without CUDA)
            self._device = torch.cuda.current_device()
        self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def wait_staged(self) -> bool:
        """Wait until no snapshot reads the live tensors; whether one did."""
        with self._cond:
            jobs = [j for j in (self._inflight, self._queued) if j is not None]
        waited = False
        for job in jobs:
            if not job.staged.staged.is_set():
                waited = True
                job.staged.wait_staged()
        return waited

    def take_error(self) -> BaseException | None:
        """The error of a failed write since the last call, if any."""
        with self._cond:
            err, self._error = self._error, None
        return err

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the queued and in-flight snapshots are written and the pending
        preparation ran; whether that happened within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._inflight is None and self._queued is None
                and self._task is None and not self._preparing, timeout)

    def close(self) -> None:
        """Write what is queued, then stop the thread (idempotent; the next
        :meth:`submit` starts a new one). A preparation not started is dropped."""
        with self._cond:
            self._closed = True
            self._task = None
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    # ------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closed
                                    or self._task is not None)
                if self._queued is None:
                    if self._closed or self._task is None:
                        return
                    task, self._task = self._task, None
                    self._preparing = True
                else:
                    task = None
                    job, self._queued = self._queued, None
                    self._inflight = job
            self._follow_device()
            if task is not None:
                self._prepare(task)
                continue
            t0 = time.perf_counter()
            cpu0, pool0 = time.thread_time(), pool_cpu_seconds()
            try:
                try:
                    job.staged.copy_deferred()
                except BaseException:
                    if job.slot is not None:  # its file is free again, once the copies
                        job.slot.pending = job.staged.side_events()  # still running end
                        job.slot.busy = False
                    raise
                self._write(job)  # which frees the job's file if it fails
                done = time.perf_counter()
                self.last_write_s = done - t0
                self.last_commit_latency_s = (job.committed_at or done) - job.taken_at
                cpu = time.thread_time() - cpu0 + pool_cpu_seconds() - pool0
                self.write_cpu_s.append((job.staged.cuda, cpu))
                self.written.append(job.step)
            except BaseException as e:  # kept for the training thread, which decides
                job.staged.staged.set()
                with self._cond:
                    self._error = e
            finally:
                with self._cond:
                    self._inflight = None
                    self._cond.notify_all()

    def _follow_device(self) -> None:
        """Make the snapshots' CUDA device (that of their state, else the training
        thread's current one, which a script that never called
        ``torch.cuda.set_device`` leaves at 0) this thread's current one. A new
        thread's is device 0: registering a snapshot file there, or a copy it issues,
        would make a CUDA context on GPU 0 for a rank of another GPU (hundreds of MB
        of GPU 0's memory for each such rank of a node, with sharded state)."""
        device = self._device
        try:
            if device is not None and torch.cuda.current_device() != device:
                torch.cuda.set_device(device)
        except Exception as e:  # the writes still run, on the thread's device
            log.debug("the snapshot writer cannot use CUDA device %s: %r", device, e)

    def _prepare(self, task: Callable[[], None]) -> None:
        try:
            task()
        except BaseException as e:  # kept for the training thread, which decides
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._preparing = False
                self._cond.notify_all()
