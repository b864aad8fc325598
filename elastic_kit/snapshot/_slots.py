"""The snapshot files a node's writer reuses: mapped once, copied into in place.

A snapshot's tensors are copied straight into a file in the node's snapshot
directory (``/dev/shm``), one :func:`~elastic_kit.store.plan_flat` tensor file,
which the commit then moves (renames: same inode, no copy) into the step directory.
Mapping and first touching the pages of a fresh tmpfs file costs far more than
copying into pages already mapped (and on CUDA, registering a mapping as pinned
memory costs as much again), so each file is a *slot*, mapped (and registered) once
and reused: when a newer snapshot commits, the older one's file is moved back out of
its step directory (manifest first: :func:`~elastic_kit.store.release_flat`) and is
the next snapshot's target. Two slots rotate: one holds the committed snapshot, the
other takes the next.

A slot is in one of three states: *free* (its file at its own path, ``.slot-*`` in
the node directory, for the next snapshot), *busy* (a snapshot is being copied into
it or written) or *holding* a committed step (its file inside that step's
directory). The training thread only takes a free slot that already fits the state
(:meth:`Slots.take`); making, resizing and first touching slots happen on the writer
thread (:meth:`Slots.acquire`, :meth:`Slots.prepare`). A restarted writer makes its
first slots out of the files its killed predecessor left free (:meth:`Slots.claim_dead`),
whose pages exist already.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
import threading
from typing import Any, Callable, Sequence

import torch

from elastic_kit.snapshot._cuda_host import register as host_register
from elastic_kit.snapshot._cuda_host import unregister as host_unregister
from elastic_kit.store import FlatPlan, map_file, plan_flat, tensor_views, zero_bytes

__all__ = ["PARKED", "SLOT_PREFIX", "Slot", "Slots", "mapped_files", "pid_alive", "process_start",
           "owner_alive", "slot_owner", "slot_owner_alive", "remove_dead_slots",
           "reusable"]

_OPEN_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

log = logging.getLogger(__name__)

#: Name prefix of a slot file in a node's snapshot directory (the store's scan
#: ignores it: not a step directory).
SLOT_PREFIX = ".slot-"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``);
    None where that cannot be read (gone, hidden by ``hidepid``, not Linux).

    With the pid it names one process for good: a pid is reused by a later process
    (routinely in a container restarted in its pod, whose processes tend to get the
    same pids again while its ``/dev/shm`` volume lives on), a start time is not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
        # the command name (field 2) may hold spaces and parentheses: split after it
        return int(stat_line.rpartition(b")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _own_owner() -> str:
    """This process's part of its slot names: ``<pid>`` and, where known, ``.<start>``
    (read each time: slots are made a few times per process, never on a hot path)."""
    pid = os.getpid()
    start = process_start(pid)
    return f"{pid}" if start is None else f"{pid}.{start}"


def slot_owner(name: str) -> tuple[int, int | None] | None:
    """``(pid, start)`` of the process whose slot file is named ``name`` (``start``:
    see :func:`process_start`; None in a name without it); None for another name."""
    if not name.startswith(SLOT_PREFIX):
        return None
    pid, _, start = name[len(SLOT_PREFIX):].split("-", 1)[0].partition(".")
    if not pid.isdigit() or not (start.isdigit() or not start):
        return None
    return int(pid), int(start) if start else None


def slot_pid(name: str) -> int | None:
    """The pid of the process whose slot file is named ``name``; None for another name."""
    owner = slot_owner(name)
    return None if owner is None else owner[0]


def owner_alive(pid: int, start: int | None) -> bool:
    """Whether the process that started at ``start`` with ``pid`` still runs: a live
    process that reuses a dead one's pid is not it. Without a start time (or where it
    cannot be read) only the pid is asked."""
    if not pid_alive(pid):
        return False
    if start is None:
        return True
    now = process_start(pid)
    return now is None or now == start


def slot_owner_alive(name: str) -> bool:
    """Whether the process whose slot file is named ``name`` is alive (False for a
    name that is not a slot's)."""
    owner = slot_owner(name)
    return owner is not None and owner_alive(*owner)


def _dead_slots(node_dir: str) -> list[str]:
    """The names of the slot files in ``node_dir`` whose processes are gone (a killed
    worker's, its pid perhaps taken by another process since), sorted; a live
    process's are left out (another tier of it may use them)."""
    try:
        names = sorted(os.listdir(node_dir))
    except OSError:
        return []
    return [name for name in names
            if name.startswith(SLOT_PREFIX) and not slot_owner_alive(name)]


def mapped_files() -> set[tuple[int, int]]:
    """``(st_dev, st_ino)`` of every file this process maps now (``/proc/self/maps``;
    empty where the kernel does not say)."""
    out: set[tuple[int, int]] = set()
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or fields[4] == "0":
            continue
        major, _, minor = fields[3].partition(":")
        try:
            out.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
        except ValueError:
            continue
    return out


def remove_dead_slots(node_dir: str) -> int:
    """Remove slot files left by processes that are gone (a killed worker's); returns
    how many. A live process's slots stay (another tier of it may use them)."""
    removed = 0
    for name in _dead_slots(node_dir):
        try:
            os.remove(os.path.join(node_dir, name))
            removed += 1
        except OSError:
            pass
    return removed


class Slot:
    """One reused snapshot file, mapped (and on CUDA registered) once.

    Attributes:
        path: the file's own path (where it is while free).
        inode: the file's inode (it keeps it while renamed into a step directory).
        plan: the layout of the state it was made for.
        mapped: the shared mapping of the whole file (1-D ``uint8``).
        views: the plan's tensors, as views of ``mapped``.
        step: the committed step whose directory holds the file, else None.
        busy: a snapshot is being copied into it or written.
        registered: the mapping is registered with CUDA as pinned memory.
    """

    def __init__(self, path: str, plan: FlatPlan, *, pin: bool, reuse: str | None = None) -> None:
        fd = None if reuse is None else _adopt(reuse, path)
        #: the file is a dead process's slot, taken over (see :meth:`Slots.claim_dead`)
        self.reused = fd is not None
        if fd is None:
            fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            st = os.fstat(fd)
            # a page of a mapped file that a full tmpfs cannot give kills the process
            # that touches it (SIGBUS): refuse here instead, as an OSError
            _check_room(path, plan.size, plan.size - st.st_blocks * 512)
            os.ftruncate(fd, plan.size)
            # ... and reserve the pages: another process may fill the tmpfs between the
            # check and the first touch below (a DataLoader's batches, another job)
            _reserve(fd, plan.size, path)
            self.inode = st.st_ino
            self.mapped = map_file(path, plan.size, shared=True)
            # first touch of the tmpfs pages (or, in a reused file, of the mapping's
            # page table: about half the cost), here (the writer thread, with the
            # hashing threads), not in a snapshot
            zero_bytes(self.mapped)
        except BaseException:
            try:
                os.remove(path)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)
        self.path = path
        self.plan = plan
        self.views = tensor_views(self.mapped, plan)
        self.step: int | None = None
        self.busy = False
        self.registered = False
        #: CUDA events of copies into the file that may still run (a replaced
        #: snapshot's): the mapping outlives them (see :class:`_Parked`)
        self.pending: list[Any] = []
        if pin:
            self.register()

    def register(self) -> None:
        """Register the mapping with CUDA as pinned memory (once), so device-to-host
        copies into it and host-to-device copies from it run at the bus's speed. A
        refusal is logged: the copies then go through pageable memory, slower."""
        if self.registered or not torch.cuda.is_available() or not self.mapped.numel():
            return
        err, message = host_register(self.mapped.data_ptr(), self.mapped.numel())
        if err != 0:
            # Linux refuses to pin a shared mapping of a file on a disk's file system
            # for long: the snapshot directory should be on a tmpfs (/dev/shm)
            log.warning("cannot register snapshot file %s as pinned memory (CUDA error %d: "
                        "%s): its copies go through pageable memory; is its directory on a "
                        "tmpfs such as /dev/shm?", self.path, err, message)
            return
        self.registered = True

    def fits(self, items: Sequence[tuple[str, torch.Tensor]]) -> bool:
        return self.plan.fits(items)

    def close(self, *, unlink: bool) -> None:
        """Unregister and drop the mapping; with ``unlink`` remove the file when it is
        at its own path (a file in a committed step directory stays: it is the
        snapshot)."""
        PARKED.reap()
        running = [e for e in self.pending if not _finished(e)]
        if running:  # given back once they complete
            log.debug("snapshot file %s: its mapping is kept until %d copies into it "
                      "complete", self.path, len(running))
            PARKED.add(self.mapped, self.registered, running)
        else:
            _unregister(self.mapped, self.registered, f"snapshot file {self.path}")
        self.registered = False
        self.pending = []
        self.views = []
        self.mapped = torch.empty(0, dtype=torch.uint8)
        if unlink and self.step is None:
            try:
                if os.lstat(self.path).st_ino == self.inode:
                    os.remove(self.path)
            except OSError:
                pass


def _check_room(path: str, size: int, need: int) -> None:
    """Raise ``OSError(ENOSPC)`` when the file system of ``path`` has less than
    ``need`` bytes free (what a snapshot file of ``size`` bytes adds to it)."""
    if need <= 0:
        return
    free = shutil.disk_usage(os.path.dirname(path) or ".").free
    if free < need:
        raise OSError(errno.ENOSPC, f"no room for a snapshot file of {size / 1e6:.0f} MB: "
                      f"{free / 1e6:.0f} MB free, {need / 1e6:.0f} MB needed", path)


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate the file's ``size`` bytes now (``posix_fallocate``): a tmpfs answers
    ENOSPC here, where a sparse file's page would kill its first toucher with SIGBUS.
    A file system that cannot reserve (EOPNOTSUPP) is left to the free-space check.

    Raises:
        OSError: ENOSPC (or another error reserving), naming the file.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise OSError(e.errno, f"cannot reserve {size / 1e6:.0f} MB for a snapshot file: "
                      f"{os.strerror(e.errno or 0).lower()}", path) from e


def _finished(event: Any) -> bool:
    """Whether the CUDA ``event`` completed; an event that cannot say (a failed
    device) counts as running, so that its copy's memory is never given back."""
    try:
        return bool(event.query())
    except Exception:
        return False


class _Parked:
    """Mappings of closed slots that copies on the device may still write into.

    Why. A snapshot replaced before it was written gives its file back while its
    device-to-host copies may still run (the CPU runs ahead of the device). Were the
    file unmapped (or unregistered) then, because the state's layout changed and the
    writer drops the file, the copy would write into memory that is no longer the
    file's. Waiting for the copies is no answer either: they may wait behind a
    collective that never ends (a dead peer's), and the writer would hang. So such a
    mapping is kept, with its events, until they complete, and given back at a later
    close of any slot (the file itself is removed at once: its pages live as long as
    the mapping)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[torch.Tensor, bool, list[Any]]] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def add(self, mapped: torch.Tensor, registered: bool, events: list[Any]) -> None:
        with self._lock:
            self._held.append((mapped, registered, events))

    def reap(self) -> int:
        """Give back the mappings whose copies completed; returns how many."""
        with self._lock:
            done, running = [], []
            for h in self._held:
                (done if all(_finished(e) for e in h[2]) else running).append(h)
            self._held = running
        for mapped, registered, _ in done:
            _unregister(mapped, registered, "a closed snapshot file")
        return len(done)


#: The mappings of closed slots whose copies were still running (see :class:`_Parked`).
PARKED = _Parked()


def _unregister(mapped: torch.Tensor, registered: bool, what: str) -> None:
    if registered:
        err = host_unregister(mapped.data_ptr())
        if err != 0:
            log.debug("unregistering %s failed (CUDA error %d)", what, err)


def reusable(st: os.stat_result) -> bool:
    """Whether a file of status ``st`` may become a slot: a plain file of this user's
    with one name (nothing else reaches its pages through another name)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.getuid()


def _adopt(spare: str, path: str) -> int | None:
    """Open the claimed file ``spare`` under the slot's name ``path`` (an open file
    descriptor), or None (the spare is removed) when it is not a plain file of this
    user's with one name."""
    try:
        os.rename(spare, path)
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        log.debug("cannot reuse snapshot file %s: %r", spare, e)
        for p in (spare, path):
            try:
                os.remove(p)
            except OSError:
                pass
        return None
    st = os.fstat(fd)
    if reusable(st):
        return fd
    os.close(fd)
    try:
        os.remove(path)
    except OSError:
        pass
    return None


class Slots:
    """A node writer's slots: ``held`` holding committed steps, one more for the next.

    ``held``: the committed snapshots the writer keeps (one; two for a sharded
    state's part, whose previous step must stay until the other nodes' parts of the
    newer one are in memory too)."""

    def __init__(self, node_dir: str, *, held: int = 1) -> None:
        self.node_dir = node_dir
        self.max_slots = held + 1
        self._lock = threading.Lock()
        self._slots: list[Slot] = []
        self._n = 0
        self._tag = secrets.token_hex(4)
        #: whether the states are on CUDA (the slots are then registered as pinned)
        self.pin = False
        #: slots made so far (a reused slot is not counted again)
        self.made = 0
        #: dead processes' slot files claimed for the next slots made
        self._spares: list[str] = []

    @property
    def count(self) -> int:
        """Slots that exist (free, busy or holding a step)."""
        with self._lock:
            return len(self._slots)

    @property
    def spare_bytes(self) -> int:
        """Bytes of the claimed dead processes' files not reused yet (space the next
        slots take without growing the directory)."""
        total = 0
        with self._lock:
            spares = list(self._spares)
        for p in spares:
            try:
                total += os.lstat(p).st_size
            except OSError:
                pass
        return total

    def claim_dead(self, also: Sequence[str] = ()) -> int:
        """Take over the slot files of processes that are gone (a killed worker's), to
        be the next slots made; returns how many. ``also``: more directories to take
        them from (an earlier launch's node directories of the run on this host,
        whose free files would otherwise count as used space until they are removed
        after this writer's first snapshot, see the tier's free-space check).

        Why. A killed worker's free slot is a file of the state's size whose pages
        exist: reusing it spares the restarted writer allocating and zeroing as many
        fresh pages (measured: half the cost of a new file). A live process's slots
        stay (another tier of it may use them); those beyond the slots this writer
        can use, and any that is not a plain file of this user's, are removed."""
        claimed = 0
        found = [os.path.join(d, name) for d in (self.node_dir, *also)
                 for name in _dead_slots(d)]
        for path in found:
            if len(self._spares) < self.max_slots:
                spare = self.spare_path()
                try:
                    os.rename(path, spare)  # atomic: another claimant finds it gone
                    st = os.lstat(spare)
                except OSError:
                    continue
                path = spare
                if reusable(st):
                    with self._lock:
                        self._spares.append(spare)
                    claimed += 1
                    continue
            try:
                os.remove(path)
            except OSError:
                pass
        return claimed

    def wants_spare(self) -> bool:
        """Whether a file taken over now would be one of this writer's slots (it has
        fewer slots and claimed files than it can use)."""
        with self._lock:
            return len(self._slots) + len(self._spares) < self.max_slots

    def spare_path(self) -> str:
        """A new name in the node directory for a file to take over as a spare."""
        with self._lock:
            self._n += 1
            return os.path.join(self.node_dir, f"{SLOT_PREFIX}{_own_owner()}-{self._tag}"
                                               f"-spare{self._n}")

    def add_spare(self, path: str) -> None:
        """Take over the file moved to :meth:`spare_path` ``path`` (a plain file of
        this user's with one name, which nothing maps) for the next slot made."""
        with self._lock:
            self._spares.append(path)

    def _new(self, plan: FlatPlan) -> Slot:
        self._n += 1
        path = os.path.join(self.node_dir, f"{SLOT_PREFIX}{_own_owner()}-{self._tag}-{self._n}")
        with self._lock:
            spare = self._spares.pop() if self._spares else None
        slot = Slot(path, plan, pin=self.pin, reuse=spare)
        self.made += 1
        return slot

    def take(self, items: Sequence[tuple[str, torch.Tensor]]) -> Slot | None:
        """A free slot that fits ``items``, marked busy; None when there is none (the
        caller stages elsewhere). Never allocates: the training thread calls it."""
        with self._lock:
            for s in self._slots:
                if not s.busy and s.step is None and s.fits(items):
                    s.busy = True
                    return s
        return None

    def take_free(self) -> Slot | None:
        """A free slot of whichever layout, marked busy; None when there is none. For
        the training thread, which checks the fit as it copies (one walk of the
        state) and hands an unfit slot back with :meth:`done`. Never allocates."""
        with self._lock:
            for s in reversed(self._slots):  # the newest: the latest layout
                if not s.busy and s.step is None:
                    s.busy = True
                    return s
        return None

    def acquire(self, items: Sequence[tuple[str, torch.Tensor]]) -> Slot:
        """A free slot that fits ``items``, made (or remade at the new size) when
        none does; marked busy (the writer thread)."""
        slot = self.take(items)
        if slot is not None:
            return slot
        plan = plan_flat(items)
        # a free slot of another layout (the state changed shape) is taken out under
        # the lock, so that the training thread's take_free cannot take it meanwhile
        for s in self._take_out(lambda s: True):
            s.close(unlink=True)
        slot = self._new(plan)
        slot.busy = True
        with self._lock:
            self._slots.append(slot)
        return slot

    def prepare(self, plan: FlatPlan) -> None:
        """Make sure a free slot of ``plan`` waits for the next snapshot (the writer
        thread, after a commit), so that the training thread can copy into it."""
        with self._lock:
            free = [s for s in self._slots if not s.busy and s.step is None]
            if any(s.plan == plan for s in free) or len(self._slots) - len(free) >= self.max_slots:
                return
        for s in self._take_out(lambda s: s.plan != plan):
            s.close(unlink=True)
        slot = self._new(plan)
        with self._lock:
            self._slots.append(slot)

    def _take_out(self, which: Callable[[Slot], bool]) -> list[Slot]:
        """Remove the free slots ``which`` selects from the list, under the lock (the
        caller closes them): none of them can be taken meanwhile."""
        with self._lock:
            out = [s for s in self._slots if not s.busy and s.step is None and which(s)]
            self._slots = [s for s in self._slots if all(s is not o for o in out)]
        return out

    def done(self, slot: Slot, step: int | None) -> None:
        """``slot`` now holds committed ``step`` (None: the write failed; it is free
        again, its file back at its path)."""
        with self._lock:
            slot.step, slot.busy = step, False

    def holder(self, step: int) -> Slot | None:
        """The slot whose file is in committed step ``step``'s directory."""
        with self._lock:
            return next((s for s in self._slots if s.step == step), None)

    def released(self, slot: Slot, *, moved: bool) -> None:
        """``slot``'s step was deleted; its file is back at its path when ``moved``
        (else it went with the step, and the slot is dropped)."""
        with self._lock:
            slot.step = None
        if not moved:
            self._drop(slot)

    def inodes(self) -> set[int]:
        with self._lock:
            return {s.inode for s in self._slots}

    def _drop(self, slot: Slot) -> None:
        with self._lock:
            if slot in self._slots:
                self._slots.remove(slot)
        slot.close(unlink=True)

    def close(self) -> None:
        """Drop every slot; free ones' files are removed, a committed one's stays (and
        so are the claimed files not reused)."""
        with self._lock:
            slots, self._slots = self._slots, []
            spares, self._spares = self._spares, []
        for s in slots:
            s.close(unlink=True)
        for p in spares:
            try:
                os.remove(p)
            except OSError:
                pass
