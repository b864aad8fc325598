"""CheckpointStore: crash-safe checkpoints on any fsspec URL, for every rank of a job.

Who does what:

- **Writers.** Only global rank 0 writes when the storage is shared
  (``node_local=False``); local rank 0 of every node writes its own directory when
  ``node_local=True``. Other ranks return from ``save`` at once, touching no storage.
- **Saving is not collective.** :meth:`CheckpointStore.save`, :meth:`~CheckpointStore.wait`
  and :meth:`~CheckpointStore.close` run no collective, so ``if rank == 0: save(...)``
  (what scripts do) works, and so does calling them on every rank. A failed write
  raises on the writer only; a caller that needs every rank to know (the loop, the
  Checkpointer) all-reduces "did it fail" itself.
- **Loading is collective.** One rank reads (rank 0 on shared storage; on node-local
  storage the lowest rank holding the newest step any node has) and broadcasts the
  state tensor by tensor. Before its first collective, :meth:`~CheckpointStore.load`
  checks through the process group's key-value store that every rank called it, so
  a call on some ranks only fails with a clear error within ``load_timeout``, and
  never runs a collective that could pair with the user's gradient all-reduce.
- **One background worker.** Non-blocking writes and the retention that follows
  every save run on one single-thread executor, in order.

The on-storage rules (names, commit, verification, retention) are in ``_layout``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import re
import socket
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

import fsspec
import torch

from elastic_kit._checks import check_int, check_number, type_error
from elastic_kit.store._broadcast import agree_on_holder, broadcast_state, target_device
from elastic_kit.store._fs import is_local, resolve_url
from elastic_kit.store._handshake import handshake
from elastic_kit.store._identity import ensure_identity, read_identity
from elastic_kit.store._layout import Found, Layout, StepDir, _ManifestMissing
from elastic_kit.store._manifest import CHECKSUMS, Manifest
from elastic_kit.store._records import CheckpointInfo, LoadedCheckpoint, SaveHandle, resolved
from elastic_kit.store._serialize import (
    copy_deferred, cuda_devices, iter_tensors, load_payload, new_hasher, prepare_state, storage_keys,
    validate_state,
)
from elastic_kit.store._exchange import KvExchange
from elastic_kit.store._sharded import (
    SaveRefused, ShardsVanished, has_sharded, read_sharded, save_sharded, stage,
)
from elastic_kit.distributed import (
    DistInfo, broadcast_object, get_dist_info, group_id, is_dist_ready,
)
from elastic_kit.errors import (
    CheckpointConflictError, CheckpointCorruptError, CheckpointError, UnsafeCheckpointError,
)

__all__ = ["CheckpointStore", "CheckpointInfo", "LoadedCheckpoint", "SaveHandle"]

log = logging.getLogger(__name__)


def _host_name() -> str:
    """This host's name as one path component (``{hostname}`` in a store's URL)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
    return "_" + name if name in (".", "..") else name


def _new_process_token() -> str:
    return uuid.uuid4().hex


# One writer id per process (regenerated in a forked child): several store objects of
# one job share it, two jobs (or a restarted job's new processes) never do.
_PROCESS_TOKEN = _new_process_token()


def _reset_token() -> None:
    global _PROCESS_TOKEN
    _PROCESS_TOKEN = _new_process_token()


os.register_at_fork(after_in_child=_reset_token)

# How many load() calls (and blocking saves of sharded state) this process made in each
# process group, across stores: the handshake keys of the n-th call are the same on
# every rank that makes the calls in the same order.
_CALL_SEQ: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
_LOAD_LOCK = threading.Lock()
# Background sharded saves exchange their entries under keys named after the store,
# the step and how many background saves of that step (of that store) this process
# began: every rank counts the same saves, whatever failed on one rank alone.
_SHARDED_SAVES: dict[tuple[str, int], int] = {}
_SHARDED_SAVES_KEPT = 256  # counts of the most recent steps (a re-save comes soon)
#: Seconds a background sharded save waits for another rank's entries or rank 0's
#: verdict with no sign of progress from it before it fails (a rank that died
#: mid-save: its group is restarted anyway). A rank still writing is waited for.
SHARDED_EXCHANGE_TIMEOUT = 300.0
#: Seconds without progress after which a rank leaving on an error path gives up a
#: background sharded save's wait for its peers
#: (:meth:`CheckpointStore.give_up_on_silent_peers`).
SILENT_PEERS_S = 15.0  # three progress beats (store._exchange.BEAT_S)
# Reads of a store whose sharded checkpoints keep vanishing under the readers.
_MAX_RESCANS = 20


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise type_error(name, value, "True or False")


def _check_step(step: Any) -> int:
    """``step`` as an int in [0, 10**12); numpy and torch integer scalars are taken
    (a step counted in a tensor or an array), a bool or a float is not."""
    if isinstance(step, bool) or str(getattr(step, "dtype", "")) in ("bool", "torch.bool"):
        raise TypeError(f"step={step!r}: expected an int, got a bool")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"step={step!r}: expected an int (numpy and torch integer scalars "
                        f"are accepted), got {type(step).__name__}") from None
    if not 0 <= step < 10**12:
        raise ValueError(f"step={step!r} must be an int in [0, 10**12)")
    return step

class CheckpointStore:
    """Crash-safe checkpoints in ``url``: ``step-<n>/`` directories with a manifest.

    Args:
        url: a path (``str`` or ``os.PathLike``) or fsspec URL (``/ckpt``,
            ``file:///ckpt``, ``memory://run1``, ``s3://bucket/run1``, ``gs://...``,
            ``az://...``). The text ``{hostname}`` is replaced by this host's name,
            so ``"/nfs/ckpt/{hostname}"`` gives every node a directory of its own on
            shared storage for ``node_local=True``. The text ``{node_rank}`` is
            replaced by this worker's node rank, so ``"/local/ckpt-{node_rank}"``
            gives every node of a one-machine test its own "local disk"; it is
            torchrun's group rank, which a re-rendezvous may give to another node
            (a node lost: the survivor that was node 1 becomes node 0), and a node
            then reads and writes the directory another node used (its own newer
            steps there are no longer read; its in-memory snapshots, keyed by the URL
            as given, still are).
        keep_last: committed checkpoints to keep (``None``: keep all). Older ones are
            deleted only after a newer one is committed, and never one newer than the
            newest this store wrote or verified. A step this store's load skipped as
            corrupt is not counted (so ``keep_last`` loadable ones stay).
        node_local: every node writes its own directory (local disks); on load the
            newest step held anywhere is broadcast from its holder.
        storage_options: passed to fsspec (credentials, endpoint_url, ...).
        info: this worker's :class:`DistInfo` (read from the environment when None).
        checksum: ``"xxh3_128"`` (default: about 7 GB/s on one core, hashed on a
            helper thread behind the writes, so saving runs at disk speed),
            ``"crc32"`` (zlib, about 1.8 GB/s) or ``"sha256"`` (cryptographic). Loading
            verifies with whatever algorithm the manifest names.
        reuse_staging: keep the CPU staging copy of a non-blocking save for the next
            one (copying into mapped pages is several times faster than into fresh
            ones). Costs one CPU copy of the state between saves; see the warning.
        io_timeout: seconds one request to a remote store (``s3://``) may wait for
            the server before it fails, so an unresponsive endpoint raises well within
            the job's collective timeout instead of blocking for minutes. s3fs tries
            each call twice, and no read is retried after ``3 * io_timeout`` s: with
            the default a save or load against an endpoint that never answers fails
            after about 40 s (measured: one ``info`` call is two requests).
        read_attempts: tries of a failed read (403, 500, a dropped connection)
            before it is raised; a failed read never counts as corruption.
        load_timeout: seconds :meth:`load` (and a blocking save of sharded state)
            waits for every rank to call it before it raises (keep it below the
            collective timeout).
        stale_after_s: a leftover of another writer's interrupted save is removed
            only once nothing in it changed for this long.
        filesystem: an fsspec filesystem to use instead of the one ``url``'s protocol
            names (a wrapper, a pre-configured client); ``url`` is then the path in it.
        private: on a local disk, create directories 0700 and files 0600 (other
            users of the host cannot read the state; the snapshot tier's stores).

    Example::

        store = CheckpointStore("s3://bucket/run1", keep_last=3,
                                storage_options={"profile": "train"})
        loaded = store.load()                 # collective: every rank
        start = loaded.step + 1 if loaded else 0
        if loaded:
            model.load_state_dict(loaded.state["model"])
        for step in range(start, steps):
            ...
            if step % 100 == 0 and rank == 0:  # or on every rank: others return at once
                store.save({"model": model.state_dict()}, step=step, blocking=False)
        store.close()

    .. warning::
        :meth:`load` is collective when a process group exists: call it on every
        rank. A call on some ranks only raises ``CheckpointError("load() is collective:
        call it on every rank ...")`` after ``load_timeout`` seconds; so does a blocking
        :meth:`save` of sharded state (DTensors) on some ranks only (``if rank == 0:``).

    .. warning::
        With ``blocking=False`` and ``reuse_staging=True`` (the default) the writer
        ranks keep one CPU copy of the state alive between saves. Pass
        ``reuse_staging=False`` when host memory is tighter than save latency.

    .. warning::
        ``node_local=True`` means every node's local rank 0 writes: the URL must
        name storage that is private to the node (a local disk, or a shared path
        containing ``{hostname}``), or the nodes overwrite each other's saves.
    """

    def __init__(self, url: str | os.PathLike[str], *, keep_last: int | None = 3,
                 node_local: bool = False, storage_options: dict[str, Any] | None = None,
                 info: DistInfo | None = None, checksum: str = "xxh3_128",
                 reuse_staging: bool = True, io_timeout: float = 10.0,
                 read_attempts: int = 3, load_timeout: float = 60.0,
                 stale_after_s: float = 600.0,
                 filesystem: fsspec.AbstractFileSystem | None = None,
                 private: bool = False) -> None:
        if isinstance(url, os.PathLike):
            url = os.fspath(url)
        if not isinstance(url, str):
            raise type_error("url", url, "a path (str or os.PathLike) or fsspec URL")
        keep_last = check_int("keep_last", keep_last, minimum=1, allow_none=True)
        if not isinstance(checksum, str):
            raise type_error("checksum", checksum, f"one of {CHECKSUMS}")
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum={checksum!r} must be one of {CHECKSUMS}")
        new_hasher(checksum)  # a missing dependency fails here, not at the first save
        io_timeout = check_number("io_timeout", io_timeout, above=0)
        load_timeout = check_number("load_timeout", load_timeout, above=0)
        stale_after_s = check_number("stale_after_s", stale_after_s, above=-1)
        read_attempts = check_int("read_attempts", read_attempts, minimum=1)
        for name, value in (("node_local", node_local), ("reuse_staging", reuse_staging),
                            ("private", private)):
            _check_flag(name, value)  # a truthy "false" would quietly mean True
        if info is not None and not isinstance(info, DistInfo):
            raise type_error("info", info, "None or an ek.DistInfo")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options={storage_options!r}: expected a dict of the "
                            f"filesystem's options or None")
        self._info = info
        #: the URL as given, before ``{node_rank}`` is replaced: the same on every node
        #: and across the re-rendezvous that may give a node another node rank
        self.url_template: str = url  # type: ignore[assignment]
        if isinstance(url, str):
            url = url.replace("{node_rank}", str(self.info.node_rank))
            if "{hostname}" in url:
                url = url.replace("{hostname}", _host_name())
        self.url: str = url  # type: ignore[assignment]
        if filesystem is not None:
            if not isinstance(url, str) or not url:
                raise ValueError(f"url={url!r} must be a non-empty path in the filesystem")
            self.fs, self.root = filesystem, filesystem._strip_protocol(url).rstrip("/") or url
        else:
            self.fs, self.root = resolve_url(url, storage_options, io_timeout=float(io_timeout))
        self.keep_last = keep_last
        self.node_local = node_local
        self.checksum = checksum
        self.reuse_staging = reuse_staging
        self.load_timeout = float(load_timeout)
        self._layout = Layout(self.fs, self.root, url=self.url, writer_id=_PROCESS_TOKEN,
                              read_attempts=read_attempts, stale_after_s=float(stale_after_s),
                              read_budget_s=3 * float(io_timeout), private=bool(private))
        self._started = time.time()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None  # the in-flight write (writers only)
        self._pending_step: int | None = None
        self._conflict: CheckpointConflictError | None = None  # a second writer was seen
        self._error: BaseException | None = None  # a failed save, raised once
        self._newest_verified = -1  # newest step this store wrote or fully verified
        self._staging: dict[str, torch.Tensor] = {}
        self._staged: threading.Event | None = None  # set when deferred copies are done
        #: the key-value exchange of a background sharded save in flight (see
        #: give_up_on_silent_peers)
        self._exchange_in_flight: KvExchange | None = None
        #: seconds of silence after which a peer is given up, once asked to, and the
        #: ranks given up so far
        self._silent_peers_s: float | None = None
        self._silent_ranks: set[int] = set()
        self.last_save_s: float = 0.0  # duration of the last write (writers only)

    # ------------------------------------------------------------------ roles
    @property
    def info(self) -> DistInfo:
        """The worker's place in the job: as given, else read now (the store may be
        created before ``init_distributed``, and ranks change across restarts)."""
        return self._info if self._info is not None else get_dist_info()

    @property
    def is_writer(self) -> bool:
        """True on the ranks that write: rank 0, or local rank 0 when node-local."""
        return self.info.local_rank == 0 if self.node_local else self.info.rank == 0

    def __repr__(self) -> str:
        return (f"CheckpointStore({self.url!r}, keep_last={self.keep_last}, "
                f"node_local={self.node_local})")

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ background
    def _submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ek-ckpt")
        return self._executor.submit(fn, *args)

    def _drain(self) -> None:
        """Wait for every queued background job (write, retention); raise nothing."""
        executor = self._executor
        if executor is None:
            return
        try:
            marker = executor.submit(lambda: None)
        except RuntimeError:
            # being shut down (close() on another thread, such as a leaving rank's,
            # or the interpreter's exit): the shutdown waits for the jobs instead
            executor.shutdown(wait=True)
            return
        marker.result()

    def _take_pending(self) -> BaseException | None:
        """Join the in-flight write; return (and forget) its error."""
        self._drain()
        fut, step = self._pending, self._pending_step
        self._pending, self._pending_step, self._staged = None, None, None
        if fut is None:
            return None
        err = fut.exception()
        if err is not None:
            # str(): an OSError's repr leaves out the file it names
            log.error("background save of checkpoint step %s to %s failed: %s: %s", step,
                      self.url, type(err).__name__, err)
        return err

    def take_pending_error(self) -> BaseException | None:
        """Join the in-flight non-blocking write and return (and forget) its error, or
        an earlier background failure, without raising: for a caller about to save
        again that reports it itself (a SIGTERM's last save, which a failure of the
        save before must not prevent). A conflict with another job stays."""
        err = self._take_pending() or self._error
        self._error = None
        return err

    def _raise_pending(self) -> None:
        err = self.take_pending_error()
        if err is not None:
            raise err
        if self._conflict is not None:
            raise self._conflict

    # ------------------------------------------------------------------ saving
    def save(self, state_dict: dict[str, Any], *, step: int, metadata: dict[str, Any] | None = None,
             blocking: bool = True, copy_later: Iterable[torch.Tensor] = (),
             on_commit: Callable[[int, str], None] | None = None) -> SaveHandle:
        """Save ``state_dict`` as checkpoint ``step``. Not collective, except for sharded
        state (DTensors: FSDP2), which every rank saves its own shards of: call it on
        every rank then (a blocking one is a collective; a non-blocking one copies
        this rank's shards and writes them in the background).

        The writer ranks write; every other rank validates the arguments and returns
        at once without touching storage, so calling it on rank 0 only and calling it
        on every rank both work.

        Args:
            state_dict: nested dicts/lists/tuples of tensors and Python primitives.
            step: the global step (``>= 0``). Saving a committed step again replaces
                it without ever un-committing it: the step is committed, with the old
                or the new state, at every moment of the re-save.
            metadata: small JSON-able dict recorded in the manifest (``epoch``...).
            blocking: when False, writers copy the tensors to CPU memory (inside
                ``save()``, except those in ``copy_later``) and write on the store's
                background worker. The next ``save``/``wait``/``close`` on the writer
                waits for it and raises its error.
            copy_later: with ``blocking=False``, tensors of ``state_dict`` (matched by
                storage, so parameters match their ``state_dict()`` views) that the
                caller promises not to modify until :meth:`wait_staged` returns: they
                are copied on the background worker, overlapping whatever the caller
                does next, instead of inside ``save()``. :class:`ElasticLoop` passes
                the parameters and optimizer state (they change only in
                ``optimizer.step()``) and calls :meth:`wait_staged` right before it,
                so the copy overlaps the next forward and backward pass. Ignored
                when blocking.
            on_commit: called as ``on_commit(step, path)`` on the store's background
                worker once the checkpoint is committed (not when the write failed),
                before the retention that follows; for work that must see the
                committed files (the snapshot tier streams them to a peer). An error
                it raises is logged, never raised by the save.

        Returns:
            a :class:`SaveHandle`: ``staged`` and ``committed`` futures of this save
            (both resolved when the call returns, unless ``blocking=False`` on a
            writer).

        Raises:
            TypeError: ``state_dict`` is no dict (nor has ``state_dict()``), or holds
                something weights-only loading cannot read
                (the message names the key path), or ``metadata`` is not JSON-able.
            OSError: the write failed (``ENOSPC`` named as such; the partial
                checkpoint is removed); on the writer only.
            CheckpointConflictError: another job commits to the same URL (every
                later save is refused).
            CheckpointError: the store cannot be read.

        .. warning::
            A blocking save returns on the writer once the checkpoint is committed.
            A non-blocking save commits later: a crash before the next ``wait()``
            loses it (the previous checkpoint stays valid). Deleting the checkpoints
            beyond ``keep_last`` runs on the background worker after the commit.
        """
        step = _check_step(step)
        _check_flag("blocking", blocking)
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata={metadata!r}: expected a dict of JSON values or None")
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metadata={metadata!r} must be JSON-serializable: {e}") from e
        if hasattr(state_dict, "state_dict") and not isinstance(state_dict, dict):
            state_dict = state_dict.state_dict()
        if not isinstance(state_dict, Mapping):
            # save(5) (or a list) committed a checkpoint nothing can restore into
            raise type_error("state_dict", state_dict,
                             "a dict of the state, or an object with state_dict()")
        if has_sharded(state_dict):
            return self._save_sharded(state_dict, step, metadata, blocking, on_commit)
        validate_state(state_dict)
        if not self.is_writer:
            return SaveHandle(step)
        self._raise_pending()
        world_size = self.info.world_size
        if blocking:
            prepared = prepare_state(state_dict, copy=False)
            self._submit(self._write, prepared, step, metadata, world_size).result()
            if on_commit is not None:
                self._submit(self._committed, on_commit, step)
            self._submit(self._retain, step)
            return SaveHandle(step)
        used: dict[str, torch.Tensor] = {}
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = prepare_state(state_dict, copy=True,
                               pool=self._staging if self.reuse_staging else None,
                               used=used, later=storage_keys(copy_later), deferred=deferred)
        self._staging = used if self.reuse_staging else {}
        after = None
        devices = cuda_devices(state_dict)
        if devices:
            # the deferred copies wait for the work issued so far on their device (the
            # current device may be another: a script that never called set_device)
            after = {d: torch.cuda.current_stream(d).record_event()
                     for d in {src.device for src, _ in deferred if src.is_cuda}} or None
            for d in devices:  # the pinned copies were issued non_blocking
                torch.cuda.synchronize(d)
        event = threading.Event() if deferred else None
        handle = SaveHandle(step, staged=Future() if deferred else resolved(),
                            committed=Future())
        self._staged = event
        self._pending_step = step
        self._pending = self._submit(self._stage_write_retain, deferred, after, event, staged,
                                     step, metadata, world_size, on_commit, handle)
        return handle

    def _save_sharded(self, state: Any, step: int, metadata: dict[str, Any], blocking: bool,
                      on_commit: Callable[[int, str], None] | None) -> SaveHandle:
        """Every rank writes its own shards; rank 0 the rest and the manifest (collective)."""
        if self.node_local:
            raise ValueError(
                f"{self!r}: sharded state (DTensors) needs storage every rank can read at "
                f"load time, expected node_local=False (each rank's shards may be needed "
                f"by any rank after a change of world size)")
        info = self.info
        background = not blocking and is_dist_ready() and info.world_size > 1
        # Named before anything can fail on this rank alone: its peers name it alike.
        exchange = self._exchange(step) if background else None
        # A failure of this rank alone (an earlier save's error, a conflict only the
        # writer saw, a value it cannot stage) is carried into the save's first
        # exchange: every rank then fails this save together, and no rank is left in a
        # collective (or on exchange keys) its peers never join.
        failure: BaseException | None = self.take_pending_error()
        earlier = failure is not None
        if failure is None and self._conflict is not None:
            failure = self._conflict
        if exchange is None:
            if is_dist_ready() and info.world_size > 1:
                # ``if rank == 0: save(...)`` with sharded state would pair the save's
                # collectives with the other ranks' own (FSDP's all-gathers): gloo
                # aborts the process, NCCL may hang or mix data. Fail it clearly.
                self._handshake(info, "save", "sharded save()", "save() of sharded state")
            self._write_sharded(state, step, metadata, self._gather, self._broadcast,
                                failed=failure, earlier=earlier)
            if on_commit is not None and info.rank == 0:
                self._submit(self._committed, on_commit, step)
            if info.rank == 0:
                self._submit(self._retain, step)
            return SaveHandle(step)
        staged = None
        if failure is None:
            try:
                used: dict[str, torch.Tensor] = {}
                staged = stage(state, pool=self._staging if self.reuse_staging else None,
                               used=used)
                self._staging = used if self.reuse_staging else {}
                for d in cuda_devices(state):  # the pinned copies were issued non_blocking
                    torch.cuda.synchronize(d)
            except BaseException as e:
                failure = e
        if failure is not None:
            self._in_flight(exchange)
            self._submit(self._sharded_refused, step, metadata, exchange, failure, earlier)
            raise failure
        handle = SaveHandle(step, committed=Future())
        self._pending_step = step
        self._in_flight(exchange)
        self._pending = self._submit(self._sharded_in_background, staged, step, metadata,
                                     exchange, on_commit, handle)
        return handle

    def _exchange(self, step: int) -> KvExchange:
        """The key-value exchange of this rank's background sharded save of ``step``."""
        from torch.distributed.distributed_c10d import _get_default_store

        info = self.info
        key = (self.url, step)
        with _LOAD_LOCK:
            n = _SHARDED_SAVES.pop(key, 0) + 1
            _SHARDED_SAVES[key] = n  # the newest last: the oldest counts go first
            while len(_SHARDED_SAVES) > _SHARDED_SAVES_KEPT:
                del _SHARDED_SAVES[next(iter(_SHARDED_SAVES))]
        store = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        # the group's own keys (see group_id: collective its first time, as save() is
        # for sharded state)
        prefix = f"elastic_kit/sharded-save/{group_id()}/{store}/{step}/{n}"
        # the ranks given up so far, a live view (a save in flight may give one up
        # before this one waits)
        return KvExchange(_get_default_store(), prefix, info.rank, info.world_size,
                          timeout=SHARDED_EXCHANGE_TIMEOUT,
                          presumed_silent=self._silent_ranks)

    def _in_flight(self, exchange: KvExchange) -> None:
        """``exchange`` is the background save's now: this rank shows progress in it
        from now on (the work before its first exchange counts: a hurried peer would
        give up a rank 0 in slow storage calls), and it is hurried if this rank was
        told to give up silent peers (see :meth:`give_up_on_silent_peers`; set before
        the check, as that method reads it after setting its own: one of them
        hurries)."""
        exchange.start_beating()
        self._exchange_in_flight = exchange
        if self._silent_peers_s is not None:
            exchange.hurry(self._silent_peers_s)

    def _exchange_done(self, exchange: KvExchange) -> None:
        """A background sharded save's exchange ended: remember the ranks it gave up
        as silent (a later save's hurried wait gives them one beat, not the whole
        hurried time: a rank leaving on an error path, after the save in flight
        failed for a dead peer, may have to take part in one more: its refusal)."""
        exchange.close()
        self._silent_ranks |= exchange.silent
        if self._exchange_in_flight is exchange:
            self._exchange_in_flight = None

    def _sharded_refused(self, step: int, metadata: dict[str, Any], exchange: KvExchange,
                         failure: BaseException, earlier: bool) -> None:
        """Take part in a background sharded save this rank failed to begin, so that
        its peers learn it at once; the failure itself was raised by ``save()``."""
        try:
            self._write_sharded(None, step, metadata, exchange.gather, exchange.broadcast,
                                failed=failure, earlier=earlier)
        except BaseException as e:
            log.debug("background sharded save of step %d, refused here: %r", step, e)
        finally:
            self._exchange_done(exchange)

    def _write_sharded(self, state: Any, step: int, metadata: dict[str, Any],
                       gather: Callable[[Any], list[Any]],
                       broadcast: Callable[[Any], Any],
                       failed: BaseException | None = None, earlier: bool = False) -> bool:
        """Write and commit sharded ``state``; True on rank 0 (which committed).
        ``failed``: this rank cannot take part (raised after its peers learned it);
        ``earlier``: it is an earlier save's error, reported now."""
        info = self.info
        t0 = time.perf_counter()
        manifest = save_sharded(self._layout, state, step=step, checksum=self.checksum,
                                metadata=metadata, rank=info.rank,
                                world_size=info.world_size, gather=gather,
                                broadcast=broadcast, failed=failed, earlier=earlier)
        self.last_save_s = time.perf_counter() - t0
        if manifest is None:
            return False
        self._newest_verified = max(self._newest_verified, step)
        log.info("sharded checkpoint step %d committed to %s (%.1f MB in %d files, "
                 "%.2f s)", step, self._layout.dir_of(step).path,
                 manifest.size_bytes / 1e6, len(manifest.files), self.last_save_s)
        return True

    def _sharded_in_background(self, state: Any, step: int, metadata: dict[str, Any],
                               exchange: KvExchange,
                               on_commit: Callable[[int, str], None] | None,
                               handle: SaveHandle) -> None:
        try:
            committer = self._write_sharded(state, step, metadata, exchange.gather,
                                            exchange.broadcast)
        except SaveRefused as e:
            handle.committed.set_exception(e)
            if not e.echo:
                raise
            # Refused because a peer reported an earlier save's failure, which this
            # rank learned from that save already: raising it again at the next save
            # would refuse that one on the peer, and so on, back and forth forever.
            log.error("background save of checkpoint step %d to %s failed: %s", step,
                      self.url, e)
            return
        except BaseException as e:
            handle.committed.set_exception(e)
            raise
        finally:
            self._exchange_done(exchange)
        handle.committed.set_result(None)
        if committer:
            if on_commit is not None:
                self._committed(on_commit, step)
            self._retain(step)

    def _gather(self, obj: Any) -> list[Any]:
        if not (is_dist_ready() and self.info.world_size > 1):
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.info.world_size
        dist.all_gather_object(out, obj)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if not (is_dist_ready() and self.info.world_size > 1):
            return obj
        return broadcast_object(obj, src=0)

    def _stage_write_retain(self, deferred: list[tuple[torch.Tensor, torch.Tensor]], after: Any,
                            staged: threading.Event | None, state: Any, step: int,
                            metadata: dict[str, Any], world_size: int,
                            on_commit: Callable[[int, str], None] | None,
                            handle: SaveHandle) -> None:
        try:
            if staged is not None:
                try:
                    copy_deferred(deferred, after)
                finally:
                    staged.set()  # also on failure: the error surfaces at the next store call
                    if not handle.staged.done():
                        handle.staged.set_result(None)
            self._write(state, step, metadata, world_size)
        except BaseException as e:
            handle.committed.set_exception(e)
            raise
        handle.committed.set_result(None)
        if on_commit is not None:
            self._committed(on_commit, step)
        self._retain(step)

    def _committed(self, on_commit: Callable[[int, str], None], step: int) -> None:
        try:
            on_commit(step, self._layout.dir_of(step).path)
        except Exception as e:  # the checkpoint is committed: the callback cannot fail it
            log.warning("the on_commit callback of checkpoint step %d in %s failed: %r",
                        step, self.url, e)

    def wait_staged(self) -> None:
        """Return once the in-flight save no longer reads the caller's tensors.

        After a non-blocking save with ``copy_later``, call this before modifying any
        of those tensors (:class:`ElasticLoop` calls it before ``optimizer.step()``).
        Returns at once when nothing is being staged. Only this rank's background
        copy is waited for; a failure is raised by the next ``save``/``wait``/``close``.
        """
        if self._staged is not None:
            self._staged.wait()
            self._staged = None

    def _write(self, state: Any, step: int, metadata: dict[str, Any], world_size: int) -> None:
        t0 = time.perf_counter()
        path, manifest = self._layout.commit(state, step=step, checksum=self.checksum,
                                             metadata=metadata, world_size=world_size)
        self.last_save_s = time.perf_counter() - t0
        self._newest_verified = max(self._newest_verified, step)
        log.info("checkpoint step %d committed to %s (%.1f MB in %.2f s)", step, path,
                 manifest.size_bytes / 1e6, self.last_save_s)

    def _retain(self, just_written: int) -> None:
        """Retention and cleaning after a commit; never fails the save that committed."""
        try:
            if self.keep_last is not None:
                self._layout.retain(self.keep_last, just_written=just_written,
                                    newest_verified=self._newest_verified,
                                    started=self._started)
            self._layout.clean_stale(newest_committed=just_written)
        except CheckpointConflictError as e:
            log.error("%s", e)
            self._conflict = e  # every later save on this store refuses to go on
        except Exception as e:
            log.warning("checkpoint retention in %s failed: %r", self.url, e)

    def wait(self) -> None:
        """Wait for this rank's in-flight save and retention; raise a failed save's
        error (once). Not collective: returns at once on non-writer ranks."""
        self._raise_pending()

    def wait_local(self) -> None:
        """Wait like :meth:`wait`, but log a failure instead of raising it.

        For error paths, where another error is already propagating and should stay
        the one the user sees.
        """
        self._take_pending()

    def give_up_on_silent_peers(self, seconds: float = SILENT_PEERS_S) -> None:
        """For a rank leaving on an error path or told to stop (a peer failed, likely
        died; torchrun's SIGTERM, after which it waits its grace and no longer): a
        background sharded save in flight, and any started later, stops waiting for
        ranks that show no sign of progress for ``seconds``, instead of the healthy
        group's ``SHARDED_EXCHANGE_TIMEOUT``; it then fails, and :meth:`wait` raises
        (:meth:`wait_local` logs). A peer that is alive and in the save keeps it
        waiting; a peer given up once is given one progress beat in a later save
        (a failed save's refusal, which a rank leaving still takes part in). Not
        collective; safe to call from a signal handler."""
        self._silent_peers_s = float(seconds)
        exchange = self._exchange_in_flight
        if exchange is not None:
            exchange.hurry(seconds)

    def close(self) -> None:
        """Wait for the in-flight save (raising its error) and stop the background
        worker. Not collective. The store may be used again afterwards (by a
        healthy group: waits for silent peers take their usual time again)."""
        try:
            self._raise_pending()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._silent_peers_s = None
            self._silent_ranks.clear()

    # ------------------------------------------------------------------ housekeeping
    def run_identity(self, *, create: bool = True, adopt: str | None = None,
                     replace: bool = False) -> str | None:
        """The random identity of the run this store holds (32 hex digits).

        Created when absent (``create``; create-if-absent, so writers racing on an
        empty store agree on one) and kept for as long as the store exists: the
        in-memory snapshot tier trusts a snapshot only when it carries the identity
        the store holds now, so a deleted or replaced store starts fresh. Not
        collective (the :class:`~elastic_kit.Checkpointer` reads it on rank 0 and
        broadcasts it). With ``create=False``, None when the store has none. ``adopt``:
        the identity to create when absent, instead of a new one (each node of a
        node-local store holds the run's one identity in its own directory);
        ``replace``: also when the store holds another one (a node's directory that
        held another run's identity takes this run's on).

        Raises:
            CheckpointCorruptError: the identity file holds something else.
            CheckpointError: the store cannot be read (after retries).
            OSError: it could not be created.
        """
        self._drain()
        if create:
            return ensure_identity(self._layout, adopt=adopt, replace=replace)
        return read_identity(self._layout)

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints in this store (this node's, when node-local), oldest first.

        Committed means the manifest is present and validates; payloads are not read
        (see :meth:`verify`). Not collective. Waits for this store's own queued
        background work first.

        Raises:
            NotADirectoryError: the URL is a file. FileNotFoundError: its bucket does
            not exist. CheckpointError: the store cannot be read (after retries).
        """
        self._drain()
        self._layout.check_root()
        return [CheckpointInfo.from_manifest(d.path, m) for d, m in self._layout.committed()]

    def latest_step(self) -> int | None:
        """The newest committed step in this store (not verified; not collective)."""
        infos = self.list()
        return infos[-1].step if infos else None

    def verify(self, *, deep: bool = True,
               step: int | None = None) -> list[tuple[int, str, str | None]]:
        """Check every ``step-<n>`` directory (only ``step``'s, when given): ``(step,
        path, problem or None)``, oldest first.

        ``deep`` recomputes checksums (reads everything); otherwise types and sizes
        only. A malformed or partial checkpoint is reported with its reason, never
        raised; a read that keeps failing raises :class:`CheckpointError`. On an object
        store a directory without a manifest is looked at again for a moment first
        (the retry policy's backoff): a job's retention removes a step's manifest
        before its files, and its save writes the files before the manifest, so what a
        first look finds may be a step being deleted (not reported) or committed
        (verified then).

        Raises:
            TypeError: ``step`` is not None or an int (``step="1"`` matched no step).
        """
        if step is not None:
            step = _check_step(step)
        self._drain()
        self._layout.check_root()
        out: list[tuple[int, str, str | None]] = []
        for d in self._layout.scan():
            if step is not None and d.step != step:
                continue
            try:
                try:
                    self._layout.verify(d, deep=deep)
                except _ManifestMissing:
                    if not self._settled_without_manifest(d):
                        if self._gone(d):
                            continue
                        self._layout.verify(d, deep=deep)  # committed meanwhile
                    else:
                        raise
                out.append((d.step, d.path, None))
            except CheckpointCorruptError as e:
                if self._gone(d):
                    continue
                out.append((d.step, d.path, str(e)))
            except CheckpointError:
                raise
            except Exception as e:  # the layout re-reads a vanished file: report it
                if self._gone(d):
                    continue
                out.append((d.step, d.path, f"{type(e).__name__}: {e}"))
        return out

    def _settled_without_manifest(self, d: StepDir) -> bool:
        """Whether ``d``, found without a manifest, still has none and still exists at
        each further look of the store's retry policy (False: it was deleted, or its
        manifest came). On a local disk the first look decides (a step's directory is
        renamed into place with its manifest, and renamed away to be deleted)."""
        if is_local(self._layout.fs):
            return True
        for _ in self._layout.looks_again():
            if self._gone(d) or not self._layout._manifest_missing(d):
                return False
        return True

    def _gone(self, d: StepDir) -> bool:
        """Whether ``d`` was deleted since the scan (the job's retention, running
        beside a tool that verifies the same URL): no problem to report."""
        try:
            return not self._layout._exists_dir(d)
        except Exception:
            return False

    def prune(self, keep: int, *, dry_run: bool = False,
              on_delete: Callable[[str, int | None, bool], None] | None = None
              ) -> list[CheckpointInfo]:
        """Delete the checkpoints older than the newest ``keep`` that verify, and stale
        leftovers of interrupted saves; returns the deleted (with ``dry_run``: doomed)
        checkpoints. ``on_delete(path, step, leftover)`` is called before each deletion
        (with ``dry_run``: for each that would happen), the leftovers' included
        (``leftover=True``; ``step`` None for a temporary directory), so a caller can
        say what went before a deletion that fails.

        Not collective; for tools (``python -m elastic_kit prune``) and scripts. A save
        in progress (of this or another process) is never removed.

        .. warning::
            Only checkpoints that fully verify count towards ``keep``, so prune reads
            and checksums every file of the newest ones (walking back from the newest
            until ``keep`` pass). A corrupt checkpoint newer than the oldest kept one
            is not counted and stays (load skips it; :meth:`verify` reports it); with
            fewer than ``keep`` that verify, no checkpoint is deleted.

        Example::

            store = CheckpointStore("s3://bucket/run1", keep_last=None)
            for info in store.prune(2, dry_run=True):
                print("would delete", info.step)

        Raises:
            TypeError: ``keep`` is not an int.
            ValueError: ``keep`` is less than 1.
            CheckpointError: the store cannot be read (after retries); a checkpoint
                that cannot be read stops prune before it deletes anything.
        """
        keep = check_int("keep", keep, minimum=1)
        self._drain()
        self._layout.check_root()
        before = {i.step: i for i in self.list()}
        doomed = self._layout.prune(keep, dry_run=dry_run, on_delete=on_delete)
        return [before[d.step] for d in doomed if d.step in before]

    # ------------------------------------------------------------------ reading
    def _found_to_loaded(self, found: Found, map_location: Any,
                         into: Any = None, *, shards: bool = True) -> LoadedCheckpoint:
        d, m = found.dir, found.manifest
        try:
            state = load_payload(found.source, map_location=map_location, where=d.path)
        finally:
            found.source.close()
        if shards and m.sharded is not None:
            try:
                state = read_sharded(self._layout, d, m, state, into=_template(into),
                                     gather=self._gather)
            except CheckpointCorruptError as e:
                raise _ShardsCorrupt(d.step) from e
        if shards or m.sharded is None:  # else verified once every rank read its shards
            self._newest_verified = max(self._newest_verified, d.step)
        return LoadedCheckpoint.from_manifest(d.path, m, state=state)

    def load(self, *, map_location: Any = None,
             into: Any = None) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies, or None. Collective: call on every rank.

        Corrupt or partial newer checkpoints are logged (warning) and skipped; a read
        that keeps failing is raised instead (it proves nothing about the checkpoint,
        and skipping it would roll training back). With a process group, one rank
        reads and broadcasts the state tensor by tensor; with ``node_local=True``
        the nodes that lack the step get it with ``lacked_locally=True``, and
        :meth:`keep_copy` commits their local copy (the ``Checkpointer`` and
        :func:`load_checkpoint` call it; ``load()`` itself only reads).

        Args:
            map_location: as for :func:`torch.load`; with a process group a callable
                is asked once where a CPU storage goes (every tensor goes there).
            into: for sharded checkpoints, the live state tree (or a function that
                returns it, called only when a sharded checkpoint is found) whose
                DTensors give the layout to load into: each rank then reads only the
                byte ranges of its own shards, at any world size. Without it, sharded
                tensors are loaded whole on every rank. Ignored for replicated state.

        Raises:
            CheckpointError: some rank did not call ``load()`` within ``load_timeout``
                ("load() is collective: call it on every rank"), or the store could
                not be read (on every rank).
            NotADirectoryError: the URL is a file. FileNotFoundError: its bucket does
                not exist.
            UnsafeCheckpointError: the newest verified checkpoint holds pickled objects
                (it is refused, never executed, and no older one is used in its place).
        """
        if self._executor is not None:
            err = self._take_pending()  # our own save first; its error stays for wait()
            if err is not None:
                self._error = err
        info = self.info
        distributed = is_dist_ready() and info.world_size > 1
        if distributed:
            self._handshake(info)
        below: int | None = None
        changed = 0
        while True:  # a sharded checkpoint found corrupt when read: the one before it
            try:
                if distributed:
                    return self._load_distributed(map_location, into, below)
                self._layout.check_root()
                found = self._layout.newest_verified(below=below)
                return None if found is None else self._found_to_loaded(found, map_location,
                                                                         into)
            except _ShardsCorrupt as e:
                log.warning("skipping checkpoint step %d, falling back to an older one: %s",
                            e.step, e.__cause__)
                self._layout.found_corrupt.add(e.step)
                below = e.step
            except ShardsVanished as e:
                # deleted or saved again while its shards were read (on every rank
                # alike): it proves nothing about its content, so the store is read
                # again from the same point, not from the step before it
                changed += 1
                if changed >= _MAX_RESCANS:
                    raise CheckpointError(
                        f"checkpoints in {self.url} kept changing while being read "
                        f"({changed} attempts): is another job writing this URL?") from e
                log.info("sharded checkpoint step %d changed while being read (%s): "
                         "reading the store again", e.step, e)

    def _handshake(self, info: DistInfo, kind: str = "load", what: str = "load()",
                   call: str = "load()") -> None:
        """Fail clearly unless every rank is in this ``load()`` call (or blocking save
        of sharded state: ``kind="save"``), within ``load_timeout`` (no collective: see
        :mod:`._handshake`, also for what keeps a failed group's keys from deciding)."""
        from torch.distributed.distributed_c10d import _get_default_group, _get_default_store

        group = _get_default_group()
        with _LOAD_LOCK:
            calls = _CALL_SEQ.setdefault(group, {})
            seq = calls[kind] = calls.get(kind, 0) + 1
        handshake(_get_default_store(), f"elastic_kit/checkpoint/{kind}/{seq}", info.rank,
                  info.world_size, self.load_timeout, f"{what} call #{seq} on {self.url}",
                  call)

    def _load_distributed(self, map_location: Any, into: Any,
                          below: int | None) -> LoadedCheckpoint | None:
        info = self.info
        device = target_device(map_location)
        found: Found | None = None
        error: BaseException | None = None
        if self.is_writer:
            try:
                self._layout.check_root()
                found = self._layout.newest_verified(below=below)
            except Exception as e:  # every rank must learn it, in the next collective
                error = e
        found_step = found.dir.step if found is not None else -1
        try:
            step, src, failed_rank = agree_on_holder(found.dir.step if found else None,
                                                     info.rank, info.world_size,
                                                     failed=error is not None)
            if error is not None:
                raise error
            if failed_rank >= 0:
                raise CheckpointError(f"rank {failed_rank} could not read its checkpoint "
                                      f"store (see its log); nothing was loaded")
            if step is None:
                return None
            state, header = None, None
            if info.rank == src:
                assert found is not None
                try:
                    loaded = self._found_to_loaded(found, device, shards=False)
                    found = None
                    state = loaded.state
                    assert loaded.manifest is not None
                    header = {"ok": True, "path": loaded.path,
                              "manifest": loaded.manifest.to_json()}
                except Exception as e:
                    broadcast_object({"ok": False, "error": f"{type(e).__name__}: {e}",
                                      "unsafe": isinstance(e, UnsafeCheckpointError)},
                                     src=src)
                    raise
            header = broadcast_object(header, src=src)
            if not header["ok"]:
                # the source's own error type where it was a refusal to unpickle;
                # anything else (a read, a device) is no verdict on the checkpoint
                error = UnsafeCheckpointError if header["unsafe"] else CheckpointError
                raise error(f"rank {src} could not load checkpoint step {step}: "
                            f"{header['error']}")
            state = broadcast_state(state, src=src, rank=info.rank, device=device)
        finally:
            if found is not None:
                found.source.close()
        path = header["path"]
        lacked = False
        if self.node_local:
            path = self._layout.dir_of(step).path
            lacked = found_step < step
        manifest = Manifest.from_json(header["manifest"], where=header["path"])
        if manifest.sharded is not None:  # every rank reads its own ranges
            try:
                state = read_sharded(self._layout, StepDir(step, header["path"]), manifest,
                                     state, into=_template(into), gather=self._gather)
            except CheckpointCorruptError as e:  # raised alike on every rank
                raise _ShardsCorrupt(step) from e
        # only now verified: a step whose shards prove corrupt never counts as verified
        # (retention would count it towards keep_last)
        self._newest_verified = max(self._newest_verified, found_step)
        return LoadedCheckpoint.from_manifest(path, manifest, state=state, lacked_locally=lacked)

    def keep_copy(self, loaded: LoadedCheckpoint | None) -> bool:
        """Commit a checkpoint that :meth:`load` broadcast from another node here too.

        With ``node_local=True`` a node whose own storage lacked the newest step
        received it from the node that held it; this writes it to this node's storage
        (on the node's writer; other ranks return at once), so the node holds it
        after the holder is gone. :meth:`load` itself only reads; the
        :class:`~elastic_kit.Checkpointer` and :func:`~elastic_kit.load_checkpoint`
        call this after it. Best effort and not collective: the state is already
        loaded, so a failure is logged (and costs only a later restore).

        Returns:
            True when a copy was committed.
        """
        if loaded is None or not loaded.lacked_locally or not self.is_writer:
            return False
        header = {"metadata": loaded.metadata, "world_size": loaded.world_size}
        try:
            path, _ = self._layout.commit(prepare_state(loaded.state, copy=False),
                                          step=loaded.step, checksum=self.checksum,
                                          metadata=header["metadata"],
                                          world_size=header["world_size"])
        except Exception as e:
            log.warning("node %d could not write its local copy of checkpoint step %d to %s: "
                        "%r", self.info.node_rank, loaded.step, self.url, e)
            return False
        self._newest_verified = max(self._newest_verified, loaded.step)
        log.info("node %d lacked checkpoint step %d: local copy written to %s",
                 self.info.node_rank, loaded.step, path)
        self._retain(loaded.step)
        return True


class _ShardsCorrupt(Exception):
    """A sharded checkpoint's shards proved corrupt when read (on every rank alike)."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


def _template(into: Any) -> Any:
    """The state tree to load sharded tensors into: ``into``, or what it returns."""
    return into() if callable(into) else into
