"""SnapshotTier: a node-local store in shared memory, written every K steps."""

from __future__ import annotations

import hashlib
import logging
import collections
import math
import os
import re
import secrets
import shutil
import socket
import statistics
import threading
import time
from typing import Any, Callable, Iterable

import fsspec
import torch

from elastic_kit.store import (
    CheckpointStore, FlatCheckpoint, Layout, LoadedCheckpoint, Manifest, StepDir,
    agree_on_holder, broadcast_state, check_file_name, commit_flat, copy_tensors, flat_file,
    hash_flat, is_flat, map_tree, open_flat, plan_flat, release_flat, resolve_url,
    split_state, state_nbytes, target_device,
)
from elastic_kit.distributed import (
    DistInfo, all_gather_object, all_reduce_max, broadcast_object, is_dist_ready, unreachable,
)
from elastic_kit.errors import CheckpointError
from elastic_kit.snapshot._private import (
    UnsafeTreeError, check_root, is_private_entry, private_dir, user_dir_name,
)
from elastic_kit.snapshot._replica import (
    REPLICAS, ReplicaReceiver, ReplicaSender, advertised_host, writer_addresses,
)
from elastic_kit.snapshot._shards import (
    Listing, add_partials, describe, is_part, listing, load_parts, local_tensors, localize,
    part_dir_name, part_source,
)
from elastic_kit.snapshot._slots import (
    Slot, Slots, mapped_files, remove_dead_slots, reusable,
)
from elastic_kit.snapshot._leftovers import host_node_alive, host_node_name, host_node_pid
from elastic_kit.snapshot._mirror import DeviceMirror, MirrorCopy
from elastic_kit.snapshot._relay import DeviceRelay, max_bytes_from_env
from elastic_kit.snapshot._staging import DeviceStall, FileTarget, storage_keys
from elastic_kit.snapshot._to_device import copy_to_device
from elastic_kit.snapshot._writer import Job, SnapshotWriter

__all__ = ["SnapshotTier", "agree_run_identity", "default_root", "interval_for",
           "snapshot_dir"]

log = logging.getLogger(__name__)

#: Environment variable naming the shared-memory directory (default ``/dev/shm``).
ROOT_ENV = "ELASTIC_KIT_SNAPSHOT_DIR"
#: Environment variable naming this node's snapshot directory inside the run's
#: (default ``<host>-<agent pid>_<agent start>``); for several "nodes" that share one parent process.
NODE_ENV = "ELASTIC_KIT_SNAPSHOT_NODE"
#: Free space a node needs, as a multiple of the state's size: two slots (the
#: committed snapshot stays until the next one is committed) plus a margin.
SPACE_FACTOR = 2.2
_MAX_AUTO_EVERY = 10_000
#: The share of the training time automatic snapshots may take: what a snapshot
#: stops training for (building the state dict, starting the audit's sum over the
#: ranks, which the writer waits for, the copy out of the live tensors, the wait for
#: the part of that copy overlapped with the next forward and backward pass, and on
#: CUDA the device's time in the copies), not the write's wall time: it runs on a
#: background thread and never holds training up. A state on the CPU also counts the
#: write's CPU seconds (its thread's and the hashing threads'): CPU training keeps
#: the cores busy, and what the write takes of them, training loses (on a GPU host
#: the training thread leaves cores idle). With a snapshot costing ``C`` seconds and failures
#: every ``M`` seconds on average, the interval that loses the least time (Young's
#: approximation, ``sqrt(2 C M)``) costs ``sqrt(C / 2M)`` of the time: 1% is that
#: optimum for a 0.5 s snapshot at a failure every ~40 minutes, and a smaller state at
#: that failure rate would be best snapshotted less often still; spending more buys
#: back only seconds of redone work per failure.
DEFAULT_BUDGET = 0.01
#: The automatic interval spreads the median cost of this many recent snapshots: one
#: snapshot delayed by a busy core (or a page fault of a new buffer) is not taken for
#: the cost of all of them.
COST_WINDOW = 5
#: Seconds :meth:`SnapshotTier.close` waits for the last snapshot's stream to a peer.
FLUSH_TIMEOUT_S = 10.0
#: Seconds the writer waits for the stream of an older snapshot to end before reusing
#: its file (past it, the file goes with the step and a new one is made).
RELEASE_WAIT_S = 2.0
#: The metadata key, in every snapshot's manifest, naming the durable store's run
#: identity it belongs to (removed from what :meth:`SnapshotTier.load` returns).
IDENTITY_KEY = "elastic_kit_run_identity"
#: The most bytes of a device's state a snapshot is staged in pinned buffers when no
#: snapshot file is free (before the first is made, or while the previous snapshot
#: is written): allocating pinned memory takes the training thread about a second per
#: 1-2 GB, and holds a state's size of it. A larger state's snapshot is copied only
#: straight into a file; one due while none is free is skipped (see
#: :meth:`SnapshotTier._skip_for_pinned_buffers`).
PINNED_STAGING_MAX_BYTES = 256 << 20
#: A rank's part directory in a node's snapshot directory (sharded state).
#: How many of the newest snapshot steps a sharded state's part reports at each flag
#: exchange (whether this rank holds its part of them; see
#: :meth:`SnapshotTier.part_report`).
PART_REPORT = 2
_PART_DIR = re.compile(r"p[0-9]{1,5}")


def agree_run_identity(store: Any, info: DistInfo) -> str | None:
    """The run identity ``store`` holds (created on an empty store), read on rank 0 and
    broadcast, so every rank agrees on it. Collective when a process group exists.

    None (snapshots must stay off, with a warning on rank 0) when the store cannot
    give one: a store object without ``run_identity()``, or one that cannot be read
    or written. Without a durable store there is no identity and no snapshots: a
    snapshot could not be told from an older run's.
    """
    if getattr(store, "node_local", False) and is_dist_ready() and info.world_size > 1:
        return _agree_node_local_identity(store, info)
    identity, why = None, ""
    if info.rank == 0:
        get = getattr(store, "run_identity", None)
        if get is None:
            why = f"the store {type(store).__name__} has no run_identity()"
        else:
            try:
                identity = get()
            except Exception as e:
                why = f"cannot read or create the run identity of {store.url}: {e!r}"
        if identity is None:
            log.warning("in-memory snapshots are off (%s): restarts resume from the durable "
                        "checkpoint store", why)
    if is_dist_ready() and info.world_size > 1:
        identity = broadcast_object(identity, src=0)
    return identity


def _agree_node_local_identity(store: Any, info: DistInfo) -> str | None:
    """:func:`agree_run_identity` for a node-local store (every node's local rank 0
    writes a directory of its own). Rank 0 may run on another node than where the run
    began, whose directory holds no identity yet: had it created one, every snapshot
    of the run would have been taken for another run's, and removed. So every node
    tells what its directory holds; the run's identity is the one held beside the
    newest durable step (ties: the lowest rank), a new one only where no node has
    one; a node without it, or with another (a reused disk), takes it on. Collective."""
    found: tuple[str | None, int, str] = (None, -1, "")
    if info.local_rank == 0:
        try:
            newest = store.latest_step()
            found = (store.run_identity(create=False), -1 if newest is None else newest, "")
        except Exception as e:
            found = (None, -1, f"cannot read the run identity of {store.url}: {e!r}")
    everyone = all_gather_object(found)
    why = next((w for _, _, w in everyone if w), "")
    identity: str | None = None
    if not why:  # every rank takes this branch alike: the gathered lists are the same
        held = [(newest, -rank, ident) for rank, (ident, newest, _) in enumerate(everyone)
                if ident is not None]
        if held:
            identity = max(held)[2]
        else:
            if info.rank == 0:
                try:
                    identity = store.run_identity()
                except Exception as e:
                    log.warning("cannot create the run identity of %s: %r", store.url, e)
            identity = broadcast_object(identity, src=0)
    if identity is not None and info.local_rank == 0 and found[0] != identity:
        if found[0] is not None:
            # a reused disk: kept, its old identity would be the one beside this
            # node's newest step once the node holding the run's is gone, and every
            # snapshot of the run would be taken for another run's (and removed)
            log.warning("the node-local store %s held the run identity %s of another run; "
                        "it takes this run's (%s) on", store.url, found[0][:12], identity[:12])
        try:  # this node's directory takes the run's identity on
            store.run_identity(adopt=identity, replace=True)
        except Exception as e:
            why = f"cannot write the run identity to {store.url}: {e!r}"
    if all_reduce_max(int(identity is None or bool(why))):
        if info.rank == 0 or why:
            log.warning("in-memory snapshots are off (%s): restarts resume from the durable "
                        "checkpoint store", why or "no node could give the run identity")
        return None
    return identity


def default_root() -> str:
    """``$ELASTIC_KIT_SNAPSHOT_DIR``, else ``/dev/shm``."""
    return os.environ.get(ROOT_ENV) or "/dev/shm"


def snapshot_dir(root: str, run_id: str, key: str) -> str:
    """The run's snapshot directory on this host:
    ``<root>/elastic_kit-<uid>/<run>-<hash>``.

    Per user (see :mod:`elastic_kit.snapshot._private`). ``key`` (the durable store's
    URL, as one string per store: a relative local path made absolute) is hashed in,
    so two jobs that share a run id (``local`` for every run outside torchrun, or
    torchrun's default ``none``) but not a store never see each other's snapshots;
    two runs that share both are told apart by the store's run identity in every
    snapshot.
    """
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", run_id)[:64] or "run"
    digest = hashlib.blake2b(f"{run_id}\0{_store_key(key)}".encode(),
                             digest_size=8).hexdigest()
    return os.path.join(root, user_dir_name(), f"{safe}-{digest}")


def interval_for(cost_s: float, step_s: float, budget: float) -> int:
    """The snapshot interval K that keeps snapshots costing the training thread
    ``cost_s`` seconds each within ``budget`` of steps of ``step_s`` seconds:
    ``ceil(cost_s / (budget * step_s))``, at least 1 and at most 10,000."""
    if not (step_s > 0 and 0 < budget < 1 and cost_s >= 0):
        raise ValueError(f"interval_for(cost_s={cost_s!r}, step_s={step_s!r}, budget={budget!r}): "
                         "expected cost_s >= 0, step_s > 0 and budget in (0, 1)")
    return max(1, min(math.ceil(cost_s / (budget * step_s)), _MAX_AUTO_EVERY))


class SnapshotTier:
    """Full training-state snapshots in node-local shared memory, every ``every`` steps.

    Args:
        key: the durable store's URL (names the snapshot directory).
        info: this worker's :class:`~elastic_kit.DistInfo`.
        every: take a snapshot every this many optimizer steps; ``None`` chooses it
            from measurements so that taking one stops training for at most
            ``budget`` of the training time (``K = ceil(cost / (budget * step
            time))``, where the cost is what a snapshot takes of the training time
            (the training thread's, the device's, and for a state on the CPU the
            write's CPU seconds; see :data:`DEFAULT_BUDGET`): every step only while a
            snapshot costs under ``budget`` of a step).
        budget: the share of the training time snapshots may take
            (``every=None``; :data:`DEFAULT_BUDGET`, 1%).
        root: the shared-memory directory (default :func:`default_root`).
        replicate: stream each committed snapshot to the next node's memory (see
            :mod:`elastic_kit.snapshot._replica`; from :meth:`connect`, with two nodes
            or more).
        identity: the durable store's run identity (:func:`agree_run_identity`),
            recorded in every snapshot and replica; a snapshot carrying another (an
            older run of a store deleted or replaced since) is never loaded, and this
            node's are removed when the tier starts. None only for a tier used on its
            own, without a durable store: it then trusts only snapshots without one.
        filesystem: an fsspec filesystem wrapping the local one for the snapshots'
            writes (a fault-injecting one in tests); default: the local disk.
        sharded: the state holds DTensors (FSDP2): every rank writes its own part
            and a restore reshards (see :mod:`elastic_kit.snapshot._shards`).

    The snapshot tree is private to the user (``<root>/elastic_kit-<uid>/``, 0700
    directories, 0600 files); every directory on the way is checked (owner, mode, no
    symlink) and a tree that fails the check switches snapshots off with a warning
    naming the path and the reason.

    Only local rank 0 of each node writes (with sharded state, every rank writes its
    part). Taking a snapshot copies the state's
    tensors straight into a snapshot file in shared memory, mapped once and reused
    (registered as pinned memory for CUDA tensors; see
    :mod:`elastic_kit.snapshot._slots`); the parameters and optimizer state may be
    copied on the writer thread instead, while the next forward and backward pass
    runs (the optimizer-step pre-hook waits for that copy).
    The write then runs on the writer thread, and the training thread never waits for
    it: a snapshot taken while the previous one is being written is queued, and a
    newer one replaces a queued one that has not started (see
    :mod:`elastic_kit.snapshot._writer`), so the write's speed bounds how fresh the
    newest committed snapshot is, not how fast training runs. A snapshot of a state
    with more than :data:`PINNED_STAGING_MAX_BYTES` on a CUDA device, due while no
    snapshot file is free to copy it into (before the writer made the first, or while
    the previous snapshot is written), is skipped rather than staged in pinned buffers
    allocated on the training thread (:attr:`skipped`).

    .. warning::
        Shared memory is host RAM. A node holds its own snapshot, the file the next
        one is copied into (two files rotate) and one peer's replica while the run
        lives (about three times the state's size), and one more replica for a
        moment: the next replica is received before the previous one is deleted. When ``root`` has less free
        space than 2.2 times the state, snapshots are switched off with a warning and
        restarts resume from the durable store; a replica that does not fit is
        refused (the sender logs a warning once) and the node keeps its own. The
        writer also keeps one staging copy of the state in its process memory, and a
        second while a snapshot waits for the previous one's write (only a snapshot
        taken while another is written is staged there; it is copied into a snapshot
        file when its write starts).
    """

    def __init__(self, key: str, *, info: DistInfo, every: int | None = None,
                 budget: float = DEFAULT_BUDGET, root: str | None = None,
                 replicate: bool = True, identity: str | None = None,
                 filesystem: fsspec.AbstractFileSystem | None = None,
                 sharded: bool = False) -> None:
        if every is not None and (type(every) is not int or every < 1):
            raise ValueError(f"snapshot every={every!r} must be None (automatic) or an int >= 1")
        if not 0 < budget < 1:
            raise ValueError(f"snapshot budget={budget!r} must be in (0, 1)")
        self.info = info
        self.every = every
        self.budget = budget
        self.root = root or default_root()
        self.run_dir = snapshot_dir(self.root, info.run_id, key)
        self.identity = identity
        # The agent is the workers' parent and outlives the group restarts it drives.
        named = os.environ.get(NODE_ENV)
        node = re.sub(r"[^A-Za-z0-9_-]", "_", named[:128]) if named \
            else host_node_name(os.getppid())
        node = node or "node"
        #: another launch's node directories on this host are named like this one,
        #: with their agents' pids (none where $ELASTIC_KIT_SNAPSHOT_NODE names nodes)
        self._host_named = not named
        self._stale_removed = False
        self.node_dir = os.path.join(self.run_dir, node)
        #: sharded state: every rank writes its part (see :mod:`._shards`) into a
        #: directory of its own in the node's
        self.sharded = sharded
        parts = [part_dir_name(info.local_rank)] if sharded else []
        #: where this rank's snapshots are written
        self.write_dir = os.path.join(self.node_dir, *parts)
        #: the group's token (rank 0 draws it in :meth:`connect`): parts of one save
        #: carry it, so parts of two saves of one step are never mixed
        self.group = secrets.token_hex(8)
        #: committed snapshots this rank keeps: a part keeps its previous step too,
        #: since a complete snapshot needs every rank's part of one step, and the
        #: other nodes' parts (or their replicas) may not have reached the newest yet
        self._kept = 2 if sharded else 1
        #: a part's steps beyond those: the newest step every rank is known to hold
        #: its part of (``_common``, learnt at the flag exchanges: see
        #: :meth:`part_report`), and those reported held to the exchange in flight
        #: (``_pinned``), which may become it; ``_present``: steps this process
        #: committed and still holds. Under ``_parts_lock`` (the writer thread
        #: deletes, the training thread reports).
        self._parts_lock = threading.Lock()
        self._asked: collections.deque[int] = collections.deque(maxlen=PART_REPORT)
        self._present: set[int] = set()
        self._pinned: frozenset[int] = frozenset()
        self._reported: tuple[int, ...] | None = None
        self._common: int | None = None
        #: the step a sharded restore loaded (every rank holds its parts: it is the
        #: common step until the exchanges agree a newer one), or None
        self._restored_common: int | None = None
        #: why snapshots found on this node were not used (for the restore line)
        self.ignored: list[str] = []
        self._trusted = False  # the tree passed the check: this user's alone
        self.enabled = True
        self.store: CheckpointStore | None = None
        #: the current K, the same on every rank (automatic mode: rank 0's proposal,
        #: which the checkpointer's flag exchange makes every rank adopt at one step)
        self.interval = every or 1
        self._proposed = every or 1  # the K this node's costs last suggested
        #: the training thread's time in the last snapshot taken (seconds): taking it
        #: and waiting for its deferred copy before the optimizer step
        self._cost_s: float | None = None
        self._costs: collections.deque[float] = collections.deque(maxlen=COST_WINDOW)
        self._last_stall: DeviceStall | None = None
        self._last_mirrored: MirrorCopy | None = None
        #: where the last :meth:`load` of a snapshot file spent its time (seconds):
        #: choosing, mapping and verifying it, and on CUDA allocating the device's
        #: tensors and the pinned buffers and copying through them (``bytes``: how
        #: many; see :mod:`elastic_kit.snapshot._to_device`)
        self.last_load_phases: dict[str, float] = {}
        #: seconds the device waited for each snapshot's side-stream copies before
        #: the optimizer step (CUDA; the newest last, known at the next snapshot)
        self.device_stalls: collections.deque[float] = collections.deque(maxlen=1000)
        #: the device buffer that takes the part of the side-stream copies that
        #: outlasts a step off the optimizer's path (CUDA; grows from the stalls)
        self.relay = DeviceRelay(max_bytes_from_env())
        #: the file's layout on the device, through which a snapshot's CUDA tensors go
        #: into a registered file in a few launches (CUDA; where there is room)
        self.mirror = DeviceMirror(max_bytes_from_env())
        #: the training stream's time in each snapshot's copy into the mirror
        #: (CUDA; the newest last, known at the next snapshot)
        self.mirror_copy_s: collections.deque[float] = collections.deque(maxlen=1000)
        #: the CPU seconds of each snapshot's write counted in its cost (a state on
        #: the CPU; the newest last, known at the next snapshot)
        self.write_cpu_costs: collections.deque[float] = collections.deque(maxlen=1000)
        self._space_checked = False
        self._writer = SnapshotWriter(self._write)
        self.replicate = replicate
        self._receiver: ReplicaReceiver | None = None
        self._sender: ReplicaSender | None = None
        # how long the writer waits for a stream of an older snapshot before reusing
        # its file (0 once the tier is abandoned: its peer may be the node that died)
        self._release_wait_s = RELEASE_WAIT_S
        #: whether this node's restore read its own snapshot (not a replica) of the
        #: step that was loaded (local rank 0; set by :meth:`load`)
        self.loaded_own = False
        #: the snapshot files (one copy, straight into shared memory); None where the
        #: tier writes through another filesystem (tests inject faults there) and
        #: snapshots are written as ordinary checkpoints
        self._slots: Slots | None = None
        self._flat_layout: Layout | None = None
        #: the state has more than PINNED_STAGING_MAX_BYTES on a CUDA device (None
        #: until this process's first periodic snapshot measured it)
        self._large_device: bool | None = None
        #: snapshots copied straight into a snapshot file by the training thread
        #: (the others were staged in buffers while a write ran, and copied after)
        self.direct = 0
        #: steps whose snapshot was not taken: a device's state larger than
        #: :data:`PINNED_STAGING_MAX_BYTES` with no snapshot file free (none made yet,
        #: or the previous snapshot still being written)
        self.skipped: list[int] = []
        #: the writer thread's seconds in the last snapshot file's hashing and in its
        #: commit (payload, manifest, the older snapshot's release)
        self.last_hash_s = 0.0
        self.last_commit_s = 0.0
        if not os.path.isdir(self.root):
            self._disable(f"{self.root} does not exist")
            return
        try:
            check_root(self.root)
            private_dir(self.root, [user_dir_name(), os.path.basename(self.run_dir), node,
                                    *parts])
            self._trusted = True
        except UnsafeTreeError as e:
            self._disable(f"the snapshot tree is not private: {e}")
            return
        except OSError as e:
            self._disable(f"cannot make the snapshot directory {self.node_dir}: {e!r}")
            return
        self.store = _TierStore(self.write_dir, keep_last=self._kept, node_local=True,
                                info=info, private=True, filesystem=filesystem)
        self.store.writer = self._writer
        if filesystem is None:
            self._slots = Slots(self.write_dir, held=self._kept)
            fs, path = resolve_url(self.write_dir)
            # this rank is the directory's only writer: a leftover of an interrupted
            # commit (a temporary directory, a step without its manifest: a whole
            # state's file each) is a dead predecessor's, removed at once (a durable
            # store's 600 s let a crash loop fill the tmpfs and turn snapshots off)
            self._flat_layout = Layout(fs, path, url=self.write_dir, private=True,
                                       stale_after_s=0.0)
        if info.local_rank == 0:
            self._remove_unusable()
        if info.local_rank == 0 or sharded:
            if self._slots is not None:  # a killed worker's free file is the next one's
                # (also an earlier launch's on this host: its files would count as
                # used space, and switch snapshots off on a small /dev/shm, until its
                # directory goes after this writer's first snapshot)
                parts = [part_dir_name(info.local_rank)] if sharded else []
                self._slots.claim_dead(also=[os.path.join(stale, *parts)
                                             for stale in self._stale_nodes()])
                self._clean_leftovers()
            else:
                remove_dead_slots(self.write_dir)

    def _clean_leftovers(self) -> None:
        """Remove what a killed predecessor's interrupted commits left here, before
        the first snapshot's space check counts it as used."""
        layout = self._flat_layout
        if layout is None:
            return
        try:
            newest = max((d.step for d, _ in layout.committed()), default=0)
            layout.clean_stale(newest_committed=newest)
        except OSError as e:
            log.debug("cannot clean %s: %r", self.write_dir, e)

    def _disable(self, why: str) -> None:
        if self.enabled and self.info.local_rank == 0:
            log.warning("in-memory snapshots are off (%s): restarts resume from the durable "
                        "checkpoint store", why)
        self.enabled = False

    # ------------------------------------------------------------------ cadence
    def proposal(self, step_s: float | None) -> int:
        """The interval K this node's snapshots suggest for steps of ``step_s`` seconds.

        ``K = ceil(cost / (budget * step_s))``, where the cost is the median of what
        the last :data:`COST_WINDOW` snapshots took of the training thread's time (the
        state dict, starting the audit's sum, the staging copy, the wait for its
        deferred part before the optimizer step) plus, on CUDA, the device's time in
        the snapshot's copies (its wait for them before the optimizer step, its copy
        into the mirror), and for a state on the CPU the CPU seconds of the
        snapshot's write (see :data:`DEFAULT_BUDGET`). The write's wall time is not
        counted: it never stops training (a snapshot due while one is written is
        queued). The step time is the checkpointer's (the one
        estimate, measured on rank 0, whose proposal every rank adopts); without it,
        or a snapshot yet, the last proposal.
        """
        if self.every is not None:
            return self.every
        if self._costs and step_s is not None and step_s > 0:
            self._proposed = interval_for(statistics.median(self._costs), step_s, self.budget)
        return self._proposed

    @property
    def cost_s(self) -> float | None:
        """The training thread's time in the last snapshot taken (seconds; None before
        the first); the automatic interval spreads the median of the recent ones."""
        return self._cost_s

    def due(self, step: int) -> bool:
        """Whether a snapshot is due at ``step`` by the agreed interval (on every rank
        alike, also where writing is off: taking one starts the audit's sum, a
        collective)."""
        return step % self.interval == 0

    @property
    def writes(self) -> bool:
        """Whether this rank writes snapshots (each node's local rank 0, while on; every
        rank with sharded state)."""
        return self.enabled and self.store is not None and (
            self.info.local_rank == 0 or self.sharded)

    # ------------------------------------------------------------------ writing
    def save(self, state_dict: dict[str, Any] | Callable[[], dict[str, Any]], *, step: int,
             metadata: dict[str, Any], copy_later: Iterable[torch.Tensor] = (),
             started: float | None = None,
             finish: Callable[[dict[str, Any]], None] | None = None,
             last: bool = False, periodic: bool = False) -> None:
        """Take a snapshot of ``state_dict`` (or of what the callable returns, called
        only here: other ranks skip building it) and write it in the background
        (local rank 0 only). Never waits for an earlier snapshot's write.

        The tensors are copied into staging buffers (or straight into a free
        snapshot file) now, except those in ``copy_later`` (tensors that change only
        in ``optimizer.step()``): CUDA ones are copied on a side stream, issued now,
        which the current stream waits for (on the device) in :meth:`wait_staged`;
        CPU ones on the writer thread before :meth:`wait_staged` returns, when the
        writer is idle. ``started``: the ``time.perf_counter()`` at which taking the
        snapshot began (default: now), for the automatic interval's cost.
        ``finish``: called with the staged state on the writer thread before it is
        written, to put in values that are not known yet on the training thread (the
        audit's sum over the ranks, in flight); an error it raises drops the snapshot
        and switches snapshots off, like a failed write. ``last``: the last snapshot
        of a rank that fails (its peer died): taken even when the write before failed
        (a snapshot whose audit sum the dead peer never joined), which is logged.
        ``periodic``: one of the every-K-steps snapshots, which a large device state
        skips while no snapshot file is free (see :meth:`_skip_for_pinned_buffers`);
        any other (an explicit or a leaving node's snapshot) is always taken.
        """
        if not self.writes:
            return
        t0 = time.perf_counter() if started is None else started
        if self.sharded and (not self._asked or self._asked[-1] != step):
            self._asked.append(step)  # taken or not: every rank's list is the same
        err = self._writer.take_error()
        if err is not None and last:
            log.warning("writing a snapshot to %s failed: %r", self.node_dir, err)
        elif err is not None:  # snapshots are an optimisation: never fail training
            self._disable(f"writing a snapshot to {self.node_dir} failed: {err!r}")
            return
        if callable(state_dict):
            state_dict = state_dict()
        if self.sharded:  # this rank's part: its local shards and the rest
            state_dict, descs = localize(state_dict)
            metadata = describe(metadata, descs, info=self.info, group=self.group)
            copy_later = local_tensors(copy_later)
        if not self._has_space(state_dict):
            return
        self._fold_later_costs()
        if periodic and not last and self._skip_for_pinned_buffers(state_dict, step):
            return
        try:
            buffers, idle = self._writer.buffers()
            # with a write in flight the writer thread cannot copy soon: copy all now,
            # except CUDA tensors, whose copies go on a side stream (see _staging)
            later = storage_keys(copy_later if idle
                                 else [t for t in copy_later
                                       if isinstance(t, torch.Tensor) and t.is_cuda])
            slots = self._slots
            slot = slots.take_free() if idle and slots is not None else None
            into = None if slot is None else FileTarget(slot.plan, slot.views, slot.mapped,
                                                         slot.registered)
            staged = buffers.stage(state_dict, later=later, into=into, relay=self.relay,
                                   mirror=self.mirror)
            if slots is not None:
                slots.pin = slots.pin or staged.cuda  # slots made from now on are pinned
                if slot is not None and not staged.into_file:
                    # the state changed its layout: the writer makes a file that fits
                    slots.done(slot, None)
                    slot = None
            self._last_stall, self._last_mirrored = staged.stall, staged.mirrored
            if self.identity is not None:
                metadata = {**metadata, IDENTITY_KEY: self.identity}
            self._writer.submit(Job(staged, step, metadata, buffers, taken_at=t0, slot=slot,
                                    finish=finish))
            self.direct += slot is not None
            self._cost_s = time.perf_counter() - t0
            self._costs.append(self._cost_s)
        except Exception as e:  # snapshots are an optimisation: never fail training
            self._disable(f"taking snapshot step {step} for {self.node_dir} failed: {e!r}")

    def _has_space(self, state_dict: dict[str, Any]) -> bool:
        """Whether the root has room for two snapshots of ``state_dict`` (checked once;
        snapshots are switched off when it has not: a file mapped on a full tmpfs
        kills the process that touches it with SIGBUS)."""
        if self._space_checked:
            return self.enabled
        self._space_checked = True
        # with sharded state, every rank of the node writes a part like this one
        ranks = self.info.local_world_size if self.sharded else 1
        size = state_nbytes(state_dict)
        if not self.sharded:  # the file's size: each tensor starts aligned (many small
            size = max(size, plan_flat(split_state(state_dict)[1]).size)  # ones: ~4 KiB each)
        need = int(SPACE_FACTOR * ranks * size)
        try:
            # the dead processes' files claimed are reused, not added
            free = shutil.disk_usage(self.root).free + (
                self._slots.spare_bytes if self._slots is not None else 0)
        except OSError as e:
            self._disable(f"cannot read the free space of {self.root}: {e}")
            return False
        if free < need:
            self._disable(f"{self.root} has {free / 1e6:.1f} MB free, two snapshots "
                          f"need {need / 1e6:.1f} MB")
            return False
        return True

    def _skip_for_pinned_buffers(self, state_dict: dict[str, Any], step: int) -> bool:
        """Whether to skip this snapshot because its state would be staged in pinned
        buffers that are not worth allocating on the training thread (nor holding:
        a state's size of pinned host memory): the state has more than
        :data:`PINNED_STAGING_MAX_BYTES` on a CUDA device, and there is no snapshot
        file to copy it into, since none exists yet (this process's first snapshot) or
        the previous snapshot is still being written.

        In the first case the writer thread makes (and registers) a file of the
        state's layout meanwhile; in both, the first snapshot due after that is copied
        straight into a file. A state that changes its layout once files exist is
        staged as before."""
        slots = self._slots
        if slots is None:
            return False
        if slots.count:
            if self._large_device and self._writer.busy:
                self._note_skip(step, "the previous one is still being written")
                return True
            return False
        if self._large_device is False:
            return False  # measured small: staged as usual until its file is made
        _, items = split_state(state_dict)
        on_device = sum(t.numel() * t.element_size() for _, t in items if _pinned_staging(t))
        self._large_device = on_device > PINNED_STAGING_MAX_BYTES
        if not self._large_device:
            return False
        slots.pin = True
        self._note_skip(step, f"its {on_device >> 20} MB on the device wait for the "
                              "writer to make a snapshot file")
        # a preparation asked for again replaces the pending one, and one that finds
        # a free file of the layout made does nothing
        plan = plan_flat(items)
        self._writer.prepare(lambda: slots.prepare(plan))
        return True

    def prepare(self, state_dict: dict[str, Any]) -> bool:
        """Have the writer thread make (and on CUDA register) the snapshot file for
        states of ``state_dict``'s layout now, so that the next snapshot is copied
        straight into it; whether a file was asked for.

        Why. Without a file, a process's first snapshot is staged in buffers
        allocated on the training thread (or, for a large device state, skipped
        while the file is made): after a restart that is the snapshot that should
        already protect the restored steps. The checkpointer calls this once the
        restored state is in the live objects, whose layout the next snapshots have.

        Only a rank that writes snapshot files, once; with sharded state, for this
        rank's part. A layout that turns out not to fit costs one file made, as a
        layout change does.
        """
        slots = self._slots
        if not self.writes or slots is None or slots.count:
            return False
        try:
            if self.sharded:  # this rank's part: its local shards and the rest
                state_dict, _ = localize(state_dict)
            _, items = split_state(state_dict)
            plan = plan_flat(items)
        except Exception as e:  # the snapshot itself will say what is wrong
            log.debug("no snapshot file prepared for %s: %r", self.node_dir, e)
            return False
        if not items or not self._has_space(state_dict):
            return False
        on_device = sum(t.numel() * t.element_size() for _, t in items if _pinned_staging(t))
        self._large_device = on_device > PINNED_STAGING_MAX_BYTES
        # registered as pinned memory when the state is on CUDA
        slots.pin = slots.pin or self._large_device or any(t.is_cuda for _, t in items)
        self._writer.prepare(lambda: slots.prepare(plan))
        return True

    def _note_skip(self, step: int, why: str) -> None:
        if not self.skipped:
            log.info("snapshot step %d skipped: %s (a device's state over %d MB is copied "
                     "straight into a snapshot file, never staged in pinned buffers "
                     "allocated on the training thread); told once", step, why,
                     PINNED_STAGING_MAX_BYTES >> 20)
        self.skipped.append(step)

    def _write(self, job: Job) -> None:
        """Write and commit one staged snapshot (on the writer thread)."""
        assert self.store is not None
        sender = self._sender
        try:
            if job.finish is not None:
                job.finish(job.staged.state)
            if self.sharded:
                add_partials(job.staged.state, job.metadata)
        except BaseException:
            if job.slot is not None and self._slots is not None:
                self._slots.done(job.slot, None)  # free for the next snapshot (a failing
            raise                                  # rank's last one is still taken)
        if self._slots is not None:
            self._commit_flat(job.staged.state, job.step, job.metadata, job.slot, job=job)
            return
        # the stream to the peer starts on the store's worker once the write committed
        self.store.save(job.staged.state, step=job.step, metadata=job.metadata,
                        blocking=True, on_commit=None if sender is None else sender.offer)
        self.store.wait_local()  # the previous snapshot's deletion, here, not in training

    def _commit_flat(self, state: Any, step: int, metadata: dict[str, Any],
                     slot: Slot | None, *, job: Job | None = None) -> str:
        """Commit ``state`` as snapshot ``step`` in a snapshot file (the writer thread,
        or a restore keeping a copy): copied into a free slot unless it was staged
        there, hashed in parallel, committed with the manifest last (``job``: the
        write's, which learns when), then the older snapshots deleted, their file
        moved back out to be the next one's slot."""
        assert self._slots is not None and self._flat_layout is not None
        payload, items = split_state(state)
        if slot is None:
            slot = self._slots.acquire(items)
            # the second copy: only when staged while a write ran
            copy_tensors([(view, t) for view, (_, t) in zip(slot.views, items)])
        try:
            t0 = time.perf_counter()
            hashes = hash_flat(slot.mapped, slot.plan)
            t1 = time.perf_counter()
            path, _ = commit_flat(self._flat_layout, step=step, flat_path=slot.path,
                                  plan=slot.plan, hashes=hashes, payload=payload,
                                  metadata=metadata, world_size=self.info.world_size)
        except BaseException:
            self._slots.done(slot, None)
            raise
        # the step committed again (an explicit snapshot at a step a periodic one
        # took): commit_flat removed the file it replaced, whose slot is dropped
        before = self._slots.holder(step)
        self._slots.done(slot, step)
        with self._parts_lock:
            self._present.add(step)
        if before is not None and before is not slot:
            self._slots.released(before, moved=False)
        if job is not None:
            job.committed_at = time.perf_counter()
        if self._sender is not None:
            self._sender.offer(step, path)
        self._release_older(step)
        self.last_hash_s, self.last_commit_s = t1 - t0, time.perf_counter() - t1
        self._slots.prepare(slot.plan)  # the next file, when one must be made
        return path

    def _release_older(self, step: int) -> None:
        """Delete this node's snapshots older than ``step`` (a part: older than the
        step before it, and except the newest step every rank holds and those
        reported held to the exchange in flight: see :meth:`part_report`); a file of
        this writer's moves back out of its step directory for reuse once no stream
        reads it."""
        assert self._slots is not None and self._flat_layout is not None
        layout = self._flat_layout
        committed = list(layout.committed())
        steps = sorted({d.step for d, _ in committed if d.step <= step})
        oldest_kept = steps[-self._kept] if len(steps) >= self._kept else step
        with self._parts_lock:  # decided at once: a report sees a step held or gone
            also = set(self._pinned) | ({self._common} if self._common is not None else set())
            committed = [(d, m) for d, m in committed
                         if d.step < oldest_kept and d.step not in also
                         and is_private_entry(d.path)]
            self._present -= {d.step for d, _ in committed}
        for d, manifest in committed:
            slot = self._slots.holder(d.step)
            try:
                if slot is None:
                    if not self._take_over(layout, d, manifest):
                        layout.delete(d)
                    continue
                idle = self._sender is None or self._sender.wait_not_sending(
                    d.step, self._release_wait_s)
                moved = idle and release_flat(layout, d, to=slot.path, inode=slot.inode,
                                              manifest=manifest)
                if not idle:
                    layout.delete(d)  # the stream keeps its open file; a new slot is made
                self._slots.released(slot, moved=moved)
            except OSError as e:
                log.warning("cannot delete the older snapshot %s: %r", d.path, e)
        try:
            layout.clean_stale(newest_committed=step)
        except OSError as e:
            log.debug("cannot clean %s: %r", self.node_dir, e)
        self._remove_stale_nodes()

    def part_report(self) -> tuple[float, ...]:
        """For the flag exchange (every rank, at the same step): for each of the
        :data:`PART_REPORT` newest snapshot steps taken, 1.0 where this rank holds its
        part of it (committed, not deleted since), else 0.0; all zeros for a state
        that is not sharded.

        Why. A sharded snapshot is complete only with every rank's part of one step,
        and each rank's writer commits at its own pace: one whose queued snapshot a
        newer one replaced, or whose write failed, lacks a step the others hold. Had
        each kept only its newest parts, a failure could find no step every rank
        holds, and the restart would go back to the durable store. The exchange's sum
        says which steps every rank holds (:meth:`parts_agreed`); the steps reported
        held stay until then, and the newest held by all stays until a newer one is."""
        if not self.sharded or not self.writes:
            return (0.0,) * PART_REPORT
        with self._parts_lock:
            asked = [-1] * (PART_REPORT - len(self._asked)) + list(self._asked)
            held = tuple(float(s >= 0 and s in self._present) for s in asked)
            self._reported = tuple(asked)
            self._pinned = frozenset(s for s, h in zip(asked, held) if h)
        return held

    def parts_agreed(self, held: Iterable[float], world_size: int) -> None:
        """The exchange's sum over the ranks of :meth:`part_report`: the newest
        step reported held by all ``world_size`` ranks is kept from now on, instead
        of the one kept before; the other reported steps may go."""
        with self._parts_lock:
            reported, self._reported = self._reported, None
            if reported is None:
                return
            for s, n in reversed(list(zip(reported, held))):
                if s >= 0 and n >= world_size:
                    if self._common is None or s > self._common:
                        self._common = s
                    break
            self._pinned = frozenset()

    def parts_kept(self) -> set[int]:
        """The parts' steps kept beyond the newest ones, alike on every rank (the
        replicas of a node's parts keep them too): the newest step every rank holds
        and those reported to the exchange in flight, which may become it."""
        with self._parts_lock:
            kept = set(self._reported or ())
            if self._common is not None:
                kept.add(self._common)
        return kept

    @property
    def common_step(self) -> int | None:
        """The newest snapshot step every rank is known to hold its part of (a
        sharded state), or None."""
        with self._parts_lock:
            return self._common

    def _take_over(self, layout: Layout, d: StepDir, manifest: Manifest) -> bool:
        """Delete step ``d``, a snapshot file this writer did not make (the one a
        restarted run restored: its killed predecessor's), moving its file out to be
        this writer's next slot; whether it did. The file's pages exist: reusing it
        spares freeing as many and allocating new ones.

        Only a plain file of this user's with one name that this process does not map:
        a restored tensor may still be a view of its copy-on-write mapping, whose
        pages read the file's until written, so writing the file would change it. Not
        while the stream to the peer sends it, nor for a sharded state's part."""
        slots = self._slots
        name = flat_file(manifest) if is_flat(manifest) else None
        if slots is None or self.sharded or name is None or not slots.wants_spare():
            return False
        try:
            st = os.lstat(os.path.join(d.path, check_file_name(name)))
        except (OSError, ValueError):
            return False
        if not reusable(st):
            return False
        if (st.st_dev, st.st_ino) in mapped_files():
            log.debug("snapshot %s is still mapped: deleted, not reused", d.path)
            return False
        if self._sender is not None and not self._sender.wait_not_sending(
                d.step, self._release_wait_s):
            return False
        spare = slots.spare_path()
        if not release_flat(layout, d, to=spare, inode=st.st_ino, manifest=manifest):
            return True  # deleted (its file had gone)
        slots.add_spare(spare)
        return True

    def _fold_later_costs(self) -> None:
        """Add to the last snapshot's cost what it cost training after it was taken,
        known once that ran: the device's time in it (how long the training stream
        waited for its copies on the side stream before the optimizer step, and its
        own copy into the mirror) and, for a state on the CPU, the CPU seconds of its
        write (see :data:`DEFAULT_BUDGET`). With the training thread's time, what the
        snapshot cost training."""
        probe, self._last_stall = self._last_stall, None
        mirrored, self._last_mirrored = self._last_mirrored, None
        stall = None if probe is None else probe.seconds()
        inline = None if mirrored is None else mirrored.seconds()
        if stall is not None:
            assert probe is not None
            self.device_stalls.append(stall)
            copy_s = probe.copy_seconds()
            if copy_s is not None:
                self.relay.learn(stall, probe.direct_bytes, copy_s)
        if inline is not None:
            self.mirror_copy_s.append(inline)
        write_cpu = 0.0
        writes = self._writer.write_cpu_s
        while writes:
            on_cuda, cpu = writes.popleft()
            if not on_cuda:  # the CPU the training's own threads would have had
                write_cpu += cpu
                self.write_cpu_costs.append(cpu)
        extra = (stall or 0.0) + (inline or 0.0) + write_cpu
        if extra and self._cost_s is not None and self._costs:
            self._cost_s += extra
            self._costs[-1] = self._cost_s

    def wait_staged(self) -> None:
        """Wait until the snapshot taken last no longer reads the live tensors (its
        deferred copy is done; for copies on the side stream, until the current
        stream waits for them on the device). The wait is part of that snapshot's
        cost."""
        t0 = time.perf_counter()
        if self._writer.wait_staged() and self._cost_s is not None:
            self._cost_s += time.perf_counter() - t0
            self._costs[-1] = self._cost_s

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot taken so far is written (or replaced by a newer
        one); whether that happened within ``timeout`` seconds. Not collective."""
        return self._writer.wait(timeout)

    @property
    def written(self) -> list[int]:
        """The steps this node's writer committed, in order (local rank 0)."""
        return list(self._writer.written)

    @property
    def replaced(self) -> list[int]:
        """The steps whose snapshot a newer one replaced while it waited for the
        previous one's write (it was never written; the newer one was)."""
        return list(self._writer.replaced)

    @property
    def commit_latency_s(self) -> float:
        """Seconds from taking the last written snapshot to its commit."""
        return self._writer.last_commit_latency_s

    # ------------------------------------------------------------------ peers
    def connect(self) -> None:
        """Start streaming snapshots to the next node. Collective: call on every rank.

        Each node's writer opens a receiver on :func:`advertised_host` (any free port);
        the ranks gather the writers' addresses and a token rank 0 draws, and each
        writer streams to the next writer in global rank order. Nothing happens with
        one node, outside a process group, or with ``replicate=False``.
        """
        if not (is_dist_ready() and self.info.world_size > 1):
            return
        if not self.replicate:
            if self.sharded:  # the parts of one save carry one group token
                self.group = broadcast_object(self.group, src=0)
            return
        _close_abandoned_receivers()
        if self._receiver is None and self.writes and self.info.local_rank == 0:
            try:
                tree = (self.root, [user_dir_name(), os.path.basename(self.run_dir),
                                    os.path.basename(self.node_dir)])
                self._receiver = ReplicaReceiver(self.node_dir, run=self._run_label(),
                                                 token="", host=advertised_host(),
                                                 keep_parts=self.parts_kept, tree=tree)
            except OSError as e:
                log.warning("snapshots are not replicated to this node (%s): cannot listen "
                            "on %s: %r", self.node_dir, advertised_host(), e)
        r = self._receiver
        mine = (self.info.rank, os.path.basename(self.node_dir),
                None if r is None else (r.host, r.port),
                secrets.token_hex(16) if self.info.rank == 0 else None,
                None if r is None else r.ident)
        everyone: list[Any] = all_gather_object(mine)  # held: never freed on gloo's thread
        token = everyone[0][3]
        self.group = token[:16]
        writers = [e for e in sorted(everyone) if e[2] is not None]
        if r is not None:
            r.token = token
            r.peers = writer_addresses([e[2][0] for e in writers])
        if r is None and not (self.sharded and self.writes):
            return
        names = [e[1] for e in writers]
        if len(writers) < 2 or len(set(names)) < len(names):
            return  # one node (or nodes that share a directory): no one to replicate to
        why = unreachable([e[2][0] for e in writers])
        if why is not None:  # every rank sees the same list: none replicates
            if self.info.is_main:
                log.warning("snapshots are not replicated to peer nodes: %s", why)
            return
        if mine[1] not in names:
            return  # this node's local rank 0 has no receiver: it is not in the ring
        me = names.index(mine[1])
        succ = writers[(me + 1) % len(writers)]
        if self._sender is not None:
            self._sender.close(timeout=FLUSH_TIMEOUT_S)
        source = part_source(mine[1], self.info.local_rank) if self.sharded else mine[1]
        # from this node's advertised address, which the successor's receiver checks
        bind = next((e[2][0] for e in writers if e[1] == mine[1]), None)
        self._sender = ReplicaSender(succ[2], to=succ[4], source=source,
                                     run=self._run_label(), token=token, bind=_bindable(bind))
        log.info("snapshots of %s are replicated to node %s at %s:%d", mine[1], succ[1],
                 *succ[2])

    def _run_label(self) -> str:
        """The run's name on the replica channel: the directory and the identity."""
        name = os.path.basename(self.run_dir)
        return name if self.identity is None else f"{name}@{self.identity}"

    def _why_unusable(self, metadata: dict[str, Any]) -> str | None:
        found = metadata.get(IDENTITY_KEY)
        if found == self.identity:
            return None
        if found is None:
            return "it records no run identity"
        return (f"it belongs to another run of this store (identity {str(found)[:12]}, the "
                f"store now holds {str(self.identity)[:12]})")

    def _roots(self, node_dir: str) -> list[tuple[str, bool]]:
        """``(root, own)``: a node's own snapshot directory, its ranks' part
        directories and its replicas' (only real directories of this user's that
        others cannot write)."""
        roots = [(node_dir, True)]
        roots += [(os.path.join(node_dir, n), True) for n in sorted(os.listdir(node_dir))
                  if _PART_DIR.fullmatch(n) and is_private_entry(os.path.join(node_dir, n))]
        replicas = os.path.join(node_dir, REPLICAS)
        if is_private_entry(replicas):
            roots += [(os.path.join(replicas, n), False) for n in sorted(os.listdir(replicas))
                      if is_private_entry(os.path.join(replicas, n))]
        return roots

    def _stale_nodes(self) -> list[str]:
        """Node directories of this run on this host whose agent is gone (the job was
        launched again here: the new agent has another pid). Their snapshots of this
        run's identity are restore sources like this node's own, and they are removed
        once this node holds a snapshot of its own (else each launch would leave a
        state's worth of shared memory behind until the run ends)."""
        if not self._host_named:
            return []
        own = os.path.basename(self.node_dir)
        out = []
        for name in sorted(os.listdir(self.run_dir)):
            agent = host_node_pid(name)
            path = os.path.join(self.run_dir, name)
            if agent is not None and name != own and not host_node_alive(name) \
                    and is_private_entry(path):
                out.append(path)
        return out

    def _remove_stale_nodes(self) -> None:
        """Remove the gone agents' node directories (local rank 0, once; a sharded
        state: once every rank holds a part of a newer step, see :meth:`part_report`)."""
        if self._stale_removed or self.info.local_rank != 0:
            return
        if self.sharded and (self.common_step is None or self.common_step
                             == self._restored_common):
            return  # the restored step may lie in them: wait for a newer common one
        self._stale_removed = True
        try:
            for path in self._stale_nodes():
                log.info("removing the snapshots of an earlier launch on this host: %s", path)
                shutil.rmtree(path, ignore_errors=True)
        except OSError as e:
            log.debug("cannot clean %s: %r", self.run_dir, e)

    def _candidates(self, parts: bool | None = None) -> list[tuple[int, str, bool]]:
        """``(step, root, own)`` of every committed snapshot on this node that carries
        this run's identity (also in an earlier launch's node directory on this
        host), newest first (own before a replica of the same step); manifests read,
        payloads not. ``parts``: list a sharded state's parts (True) or whole
        snapshots (False); default: those of this tier's kind."""
        want = self.sharded if parts is None else parts
        out = []
        roots = self._roots(self.node_dir)
        for stale in self._stale_nodes():
            roots += self._roots(stale)
        for root, own in roots:
            for d, m in _layout(root).committed():
                why = self._why_unusable(m.metadata)
                if is_part(m.metadata) != want:
                    continue  # a sharded run's part, or a whole snapshot
                if why is None and is_private_entry(d.path):
                    out.append((d.step, root, own))
                elif why is not None:
                    self._note_ignored(d.path, d.step, why)
        return sorted(out, key=lambda c: (-c[0], not c[2]))

    def _note_ignored(self, path: str, step: int, why: str) -> None:
        note = f"snapshot step {step} in {path} ignored: {why}"
        if note not in self.ignored:
            self.ignored.append(note)
            log.warning("%s", note)

    def _remove_unusable(self) -> None:
        """Remove this run's snapshots on this host that carry another run identity
        (every node directory of the run: an older launch's agents had other pids).
        Only inside this user's private tree; a snapshot of this identity, which
        another agent of the run on this host may be using, stays."""
        if self.identity is None:
            return
        try:
            nodes = [os.path.join(self.run_dir, n) for n in sorted(os.listdir(self.run_dir))]
            for node_dir in [n for n in nodes if is_private_entry(n)]:
                for root, _ in self._roots(node_dir):
                    for d, m in list(_layout(root).committed()):
                        why = self._why_unusable(m.metadata)
                        if why is not None and is_private_entry(d.path):
                            self._note_ignored(d.path, d.step, why + "; removed")
                            shutil.rmtree(d.path, ignore_errors=True)
        except OSError as e:
            log.warning("cannot clean the old snapshots in %s: %r", self.run_dir, e)

    def ignored_note(self) -> str:
        """The restore line's account of snapshots not used (empty when none)."""
        if not self.ignored:
            return ""
        more = f" (and {len(self.ignored) - 1} more)" if len(self.ignored) > 1 else ""
        return f"; {self.ignored[0]}{more}"

    def newest_local(self) -> int | None:
        """The newest snapshot step this node holds, its own or a peer's replica (local
        rank 0; None elsewhere): whole snapshots and a sharded state's parts alike
        (:meth:`load` restores either kind into either state)."""
        if not self.enabled or self.store is None or self.info.local_rank != 0:
            return None
        try:
            found = self._candidates(parts=False) + self._candidates(parts=True)
        except Exception as e:
            log.warning("cannot list the snapshots in %s: %r", self.node_dir, e)
            return None
        return max((step for step, _, _ in found), default=None)

    def _parts(self) -> list[Listing]:
        """The parts of this run's identity this node holds, own and replicas (local
        rank 0; empty elsewhere or when the listing fails)."""
        if not (self.enabled and self.store is not None and self.info.local_rank == 0):
            return []
        out = []
        try:
            for step, root, own in self._candidates(parts=True):
                d = _layout(root).dir_of(step)
                found = listing(d.path, _layout(root).read_manifest(d), own=own)
                if found is not None:
                    out.append(found)
        except Exception as e:
            log.warning("cannot list the snapshot parts in %s: %r", self.node_dir, e)
        return out

    def _choose_root(self) -> tuple[str, int | None, FlatCheckpoint | None]:
        """The directory holding this node's newest snapshot that verifies, its step
        and, for a snapshot file, the mapped snapshot. Snapshot files are mapped and
        their chunks verified in parallel; other snapshots (written through another
        filesystem) are verified by one read when replicas are present. A corrupt or
        truncated snapshot is skipped for the next newest source, own or replica."""
        try:
            found = self._candidates(parts=False)
        except Exception as e:
            log.warning("cannot list the snapshots in %s: %r", self.node_dir, e)
            return self.node_dir, None, None
        only_own = all(own for _, _, own in found)
        for step, root, _ in found:
            layout = _layout(root)
            d = layout.dir_of(step)
            try:
                if is_flat(layout.read_manifest(d)):
                    return root, step, open_flat(layout, d)
                if only_own:  # the store's load verifies it (and falls back) itself
                    return root, step, None
                layout.verify(d, deep=True)
                return root, step, None
            except (CheckpointError, OSError) as e:
                log.warning("skipping snapshot %s for the next newest: %s", d.path, e)
        return self.node_dir, None, None

    def _own_state(self, opened: FlatCheckpoint, device: torch.device | None) -> Any:
        """The state of a mapped snapshot: zero-copy views of the file (CPU), copied
        to ``device`` through reused pinned buffers (CUDA), or cloned
        when the file is one this tier will write again (its own slot)."""
        state = opened.state
        if device is not None and device.type == "cuda":
            return copy_to_device(opened.mapped, state, device, self.last_load_phases)
        if device is not None and device.type != "cpu":
            return map_tree(state, lambda _, v: v.to(device) if isinstance(v, torch.Tensor)
                            else v)
        name = [n for n in opened.manifest.files if n != opened.manifest.payload]
        if self._slots is not None and name:
            try:
                inode = os.lstat(os.path.join(opened.path, name[0])).st_ino
            except OSError:
                inode = -1
            if inode in self._slots.inodes():
                return map_tree(state, lambda _, v: v.clone() if isinstance(v, torch.Tensor)
                                else v)
        if self.sharded:  # its DTensors' shards would be views holding the whole file
            return map_tree(state, lambda _, v: v.clone() if isinstance(v, torch.Tensor)
                            else v)
        return state

    def load(self, *, map_location: Any = None, into: Any = None) -> LoadedCheckpoint | None:
        """The newest snapshot any node holds, its own or a replica, broadcast to every
        rank from its holder. Collective.

        A snapshot file is mapped and verified chunk by chunk in parallel; on the CPU
        the state's tensors are views of it (no copy), on CUDA they are copied to the
        device through reused pinned buffers. A corrupt or
        truncated newest snapshot is skipped for the one before.

        With sharded state, ``into`` (the live state, or a function giving it) says
        the layout to restore into: see :func:`~elastic_kit.snapshot._shards.load_parts`.
        An unsharded state restores a sharded state's parts (a job that shards only
        at world size > 1, restarted on one node) when they are newer than every whole
        snapshot: whole, from a part of every saving rank (its own, a replica, or a
        peer's), verified against the digests saved with them; parts that do not
        cover the state are passed over with a note (:meth:`ignored_note`). A sharded
        state restores a whole snapshot (an unsharded state's, a snapshot file) that is
        newer than every sharded one, given to every rank as the durable store gives a
        checkpoint of whole tensors: ``TrainState`` then takes each rank's part.
        """
        assert self.store is not None
        if self.sharded:
            return self._load_sharded(map_location, into)
        from_parts = self._load_whole_from_parts(map_location)
        if from_parts is not None:
            return from_parts
        return self._load_whole(map_location)

    def _load_whole(self, map_location: Any) -> LoadedCheckpoint | None:
        """The newest whole snapshot any node holds, broadcast from its holder
        (collective). A sharded state takes only a snapshot file: a snapshot written as
        an ordinary checkpoint lies in a directory its tier's store does not read, and
        a node that lacked the snapshot keeps no copy (its files hold parts)."""
        root, step, opened = (self.node_dir, None, None)
        t0 = time.perf_counter()
        self.last_load_phases = {}
        if self.info.local_rank == 0 and self.enabled:
            root, step, opened = self._choose_root()
        self.last_load_phases["choose_map_verify_s"] = time.perf_counter() - t0
        distributed = is_dist_ready() and self.info.world_size > 1
        device = None if map_location is None else target_device(map_location)
        if not distributed:
            if opened is not None:
                loaded = LoadedCheckpoint.from_manifest(
                    opened.path, opened.manifest, state=self._own_state(opened, device))
                return self._accept(loaded, root, step)
            return None if self.sharded else self._load_store(root, step, map_location)
        newest, src, _ = agree_on_holder(step, self.info.rank, self.info.world_size)
        if newest is None:
            return None if self.sharded else self._load_store(root, step, map_location)
        header = None
        if self.info.rank == src:
            header = None if opened is None else {"path": opened.path,
                                                  "manifest": opened.manifest.to_json()}
        header = broadcast_object(header, src=src)
        if header is None:  # the holder's newest is not a snapshot file
            return None if self.sharded else self._load_store(root, step, map_location)
        state = None
        if self.info.rank == src:
            assert opened is not None
            state = self._own_state(opened, device)
        state = broadcast_state(state, src=src, rank=self.info.rank,
                                device=device or torch.device("cpu"))
        manifest = Manifest.from_json(header["manifest"], where=header["path"])
        loaded = LoadedCheckpoint.from_manifest(header["path"], manifest, state=state)
        lacked = (self.info.local_rank == 0 and self.writes and self._slots is not None
                  and not self.sharded and (step is None or step < newest))
        if lacked:  # a node that lacked the snapshot keeps the broadcast copy
            try:
                self._commit_flat(state, newest, dict(manifest.metadata), None)
            except Exception as e:
                log.warning("node %s could not keep its copy of snapshot step %d: %r",
                            self.node_dir, newest, e)
        return self._accept(loaded, root, step)

    def _load_parts(self, map_location: Any, into: Any,
                    newer_than: int = -1) -> LoadedCheckpoint | None:
        """The newest sharded snapshot held anywhere (after step ``newer_than``),
        resharded (collective)."""
        if into is None:
            raise ValueError("restoring a sharded snapshot needs into=, the live state "
                             "whose DTensors give the layout to restore into")
        loaded = self._restore_parts(map_location, into, newer_than)
        if loaded is not None:
            # every rank's part of this step is held somewhere (it was just read):
            # kept, here and in the replicas, until every rank holds a newer one (a
            # fast rank's writer would otherwise drop it after two new steps, while a
            # slow rank's has none yet, leaving no complete snapshot in memory)
            with self._parts_lock:
                self._common = self._restored_common = int(loaded.step)
        return loaded

    def _newest_of_each(self) -> tuple[int, int]:
        """The newest whole snapshot step and the newest part step any node holds
        (-1: none), agreed by every rank (collective)."""
        whole = part = -1
        if self.enabled and self.store is not None and self.info.local_rank == 0:
            try:
                whole = max((s for s, _, _ in self._candidates(parts=False)), default=-1)
                part = max((s for s, _, _ in self._candidates(parts=True)), default=-1)
            except Exception as e:
                log.warning("cannot list the snapshots in %s: %r", self.node_dir, e)
        if is_dist_ready() and self.info.world_size > 1:
            whole, part = all_reduce_max(whole), all_reduce_max(part)
        return whole, part

    def _load_sharded(self, map_location: Any, into: Any) -> LoadedCheckpoint | None:
        """A sharded state's restore (collective): the newest step memory can give,
        whichever kind holds it. A whole snapshot newer than every part held is tried
        first; the parts only after the step of the whole snapshot that restores (or
        is held), so that a newest part step that cannot be restored (a saving rank's
        part held nowhere) never rolls back past a whole snapshot; then that one."""
        whole, part = self._newest_of_each()
        fallback = None
        if whole > part:
            fallback = self._load_whole(map_location)
            if fallback is not None and fallback.step > part:
                return fallback
        # parts of the step a whole snapshot holds too are preferred (no rank then
        # holds the whole state): the floor is below it
        floor = (fallback.step if fallback is not None else whole - 1 if 0 <= whole <= part
                 else -1)
        loaded = self._load_parts(map_location, into, newer_than=floor)
        if loaded is not None:
            return loaded
        if fallback is not None:
            return fallback
        return self._load_whole(map_location) if 0 <= whole <= part else None

    def _load_whole_from_parts(self, map_location: Any) -> LoadedCheckpoint | None:
        """An unsharded state from the newest sharded snapshot's parts, when they are
        later than every whole snapshot held anywhere (collective)."""
        newest_whole, newest_part = self._newest_of_each()
        if newest_part < 0 or newest_part <= newest_whole:
            return None
        # only parts newer than the whole snapshots: an older complete step would roll
        # back past the newest whole one, which the caller restores instead
        return self._restore_parts(map_location, None, newest_whole)

    def _restore_parts(self, map_location: Any, into: Any,
                       newer_than: int) -> LoadedCheckpoint | None:
        """:func:`load_parts` of the parts held anywhere (collective): resharded onto
        ``into``, or whole when it is None; accepted for this run."""
        device = None if map_location is None else target_device(map_location)
        loaded, all_local = load_parts(info=self.info, node=os.path.basename(self.node_dir),
                                       found=self._parts(), into=into, device=device,
                                       on_skip=self._note_ignored, newer_than=newer_than)
        loaded = self._accept(loaded, self.node_dir, None if loaded is None else loaded.step)
        # "this node's memory" when no rank needed a range from another node
        self.loaded_own = loaded is not None and all_local
        return loaded

    def _load_store(self, root: str, step: int | None,
                    map_location: Any) -> LoadedCheckpoint | None:
        """The store's load (collective): snapshots written as ordinary checkpoints."""
        assert self.store is not None
        store = self.store
        if root != self.node_dir:
            # a node keeps only its own snapshots and one replica: no copy of a peer's
            store = CheckpointStore(root, keep_last=None, node_local=True, info=self.info)
        try:
            loaded = store.load(map_location=map_location)
            if store is self.store:  # a node that lacked the snapshot keeps the broadcast
                store.keep_copy(loaded)
        finally:
            if store is not self.store:
                store.close()
        return self._accept(loaded, root, step)

    def _accept(self, loaded: LoadedCheckpoint | None, root: str,
                step: int | None) -> LoadedCheckpoint | None:
        if loaded is not None:
            # every rank holds the same broadcast metadata: all take this branch alike
            why = self._why_unusable(loaded.metadata)
            if why is not None:
                self._note_ignored(loaded.path, loaded.step, why)
                loaded = None
            else:
                loaded.metadata.pop(IDENTITY_KEY, None)
        # this host's memory: this node's directory, or a gone agent's of this run
        # here (a node directory: a child of the run's; a replica lies deeper)
        self.loaded_own = (loaded is not None and os.path.dirname(root) == self.run_dir
                           and step == loaded.step)
        return loaded

    # ------------------------------------------------------------------ cleanup
    def close(self, *, remove: bool, flush: bool = True, node_only: bool = False) -> None:
        """Join the in-flight snapshot and, with ``flush``, its stream to the peer (at
        most ``FLUSH_TIMEOUT_S``); with ``remove``, also stop receiving replicas and
        delete this run's snapshots on this host (local rank 0; call it once every
        rank is done writing). ``node_only``: delete only this node's (its parts and
        the replicas it holds), and the run's directory once empty: a node that
        leaves while others stay, which may share this host (several agents on one
        machine) and keep theirs for the restart.

        ``flush=False`` is for a worker that is failing: the whole group restarts,
        so the peer's receiver goes down with its worker and a stream cannot land,
        while the peer may be the lost node itself, whose host no longer answers (a
        stream to it blocks until its socket times out). Waiting would only delay
        the worker's exit, and with it the restart."""
        if not flush:  # no write waits for a stream that cannot land
            self._release_wait_s = 0.0
        if self.store is not None:
            try:
                # writes the snapshots taken, then stops the writer's and the store's
                # threads (a process that makes many checkpointers would otherwise keep
                # idle threads per tier)
                self._writer.close()
                err = self._writer.take_error()
                self.store.close()
                if err is not None:
                    raise err
            except Exception as e:
                # a failing worker's (not flushed): its peers are gone or going, and a
                # write that needed them failing is expected; the restart says what
                # it restores from
                (log.warning if flush else log.info)(
                    "the last snapshot to %s failed: %r", self.node_dir, e)
        if self._sender is not None:
            self._sender.close(timeout=FLUSH_TIMEOUT_S if flush else 0.0)
            self._sender = None
        if self._slots is not None:
            self._slots.close()  # the committed snapshot's file stays in its directory
        self.relay.close()
        self.mirror.close()
        if self._receiver is not None:
            if remove:
                self._receiver.close()
            else:
                # a failing worker's: a peer may still stream its last snapshot here
                # while this process exits; a process that trains on (a retry in a
                # notebook, a sweep) closes it when its next tier connects
                with _ABANDONED_LOCK:
                    _ABANDONED.append(self._receiver)
            self._receiver = None
        if remove and self.info.local_rank == 0 and self._trusted:
            # never a tree that failed the check: it may be another user's
            # (not this user's directory above it, even when empty: gone, another
            # user could make one of that name, which switches this user's snapshots
            # off, until the host reboots)
            if not node_only:
                shutil.rmtree(self.run_dir, ignore_errors=True)
                return
            shutil.rmtree(self.node_dir, ignore_errors=True)
            try:
                os.rmdir(self.run_dir)
            except OSError:  # another node's snapshots, on this host: theirs to keep
                pass


#: The replica receivers of tiers closed without removing their snapshots (see
#: :meth:`SnapshotTier.close`), left open for a peer's last stream.
_ABANDONED: list[ReplicaReceiver] = []
_ABANDONED_LOCK = threading.Lock()


def _close_abandoned_receivers() -> None:
    """Close the receivers abandoned tiers of this process left listening: a new
    group's tier connects, so no stream of the old group is coming to them."""
    with _ABANDONED_LOCK:
        gone = _ABANDONED[:]
        _ABANDONED.clear()
    for receiver in gone:
        try:
            receiver.close()
        except Exception as e:  # a listener that is gone already
            log.debug("closing an abandoned replica receiver: %r", e)


def _pinned_staging(t: torch.Tensor) -> bool:
    """Whether staging ``t`` outside a snapshot file takes a pinned buffer: a CUDA
    tensor. Tests on the CPU widen it, the CPU standing in."""
    return t.is_cuda


class _TierStore(CheckpointStore):
    """The tier's node-local store. Snapshots reach it from the tier's writer thread;
    :meth:`wait` and :meth:`close` first join that thread's snapshots, so they mean
    here what they mean for any store: every snapshot saved so far is committed."""

    writer: SnapshotWriter | None = None

    def wait(self) -> None:
        if self.writer is not None:
            self.writer.wait()
        super().wait()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        super().close()


def _store_key(url: str) -> str:
    """The durable store's URL as one string per store: an absolute path for a local
    store (a relative one names another directory from another working directory),
    the protocol's canonical form otherwise."""
    try:
        fs, path = resolve_url(url)
        return str(fs.unstrip_protocol(path))
    except Exception:  # a URL the tier cannot resolve: taken as it is
        return url


def _bindable(host: str | None) -> str | None:
    """``host`` if a socket can bind to it here (a sender's source address: the
    receiver checks it), else None (the kernel's choice)."""
    if host is None:
        return None
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return host
    except OSError:
        return None


def _layout(root: str) -> Layout:
    fs, path = resolve_url(root)
    return Layout(fs, path, url=root)
