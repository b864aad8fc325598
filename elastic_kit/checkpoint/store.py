"""CheckpointStore: crash-safe checkpoints on any fsspec URL, for every rank of a job.

Who does what:

- **Writers.** Only global rank 0 writes when the storage is shared
  (``node_local=False``); local rank 0 of every node writes its own directory when
  ``node_local=True``. Other ranks never touch storage on save.
- **Collective calls.** :meth:`CheckpointStore.save`, :meth:`~CheckpointStore.wait`,
  :meth:`~CheckpointStore.load` and :meth:`~CheckpointStore.close` must be called by
  every rank in the same order (like any collective). A blocking save ends with an
  all-reduce of "did the write fail" that doubles as a barrier: once ``save()``
  returns on *any* rank the checkpoint is committed, and if the write failed every
  rank raises.
- **Loading.** One rank reads (rank 0 on shared storage; on node-local storage the
  lowest rank holding the newest step any node has) and broadcasts the state tensor
  by tensor; nodes that lacked that step write a local copy.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from elastic_kit.checkpoint.asyncsave import BackgroundWriter
from elastic_kit.checkpoint.broadcast import agree_on_holder, broadcast_state, target_device
from elastic_kit.checkpoint.fs import join, resolve_url, step_dir_name
from elastic_kit.checkpoint.manifest import CHECKSUMS, Manifest
from elastic_kit.checkpoint.serialize import (
    copy_deferred, iter_tensors, load_payload, prepare_state, storage_keys, validate_state,
)
from elastic_kit.checkpoint.writer import (
    StepDir, clean_stale, delete_step, read_manifest, scan, verify,
    write_checkpoint,
)
from elastic_kit.distributed import (
    DistInfo, all_reduce_max, broadcast_object, get_dist_info, is_dist_ready,
)
from elastic_kit.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError

__all__ = ["CheckpointStore", "CheckpointInfo", "LoadedCheckpoint"]

log = logging.getLogger(__name__)


@dataclass
class LoadedCheckpoint:
    """What :meth:`CheckpointStore.load` returns.

    Attributes:
        step: the step it was saved at.
        state: the state dict (tensors on ``map_location``, CPU by default).
        metadata: the ``metadata`` given to ``save``.
        path: the ``step-<n>`` directory it came from (this node's copy when node-local).
    """

    step: int
    state: dict[str, Any]
    metadata: dict[str, Any]
    path: str


@dataclass
class CheckpointInfo:
    """A committed checkpoint as :meth:`CheckpointStore.list` describes it.

    ``time`` is the commit's wall time in seconds since the epoch.
    """

    step: int
    path: str
    metadata: dict[str, Any]
    size_bytes: int
    time: float
    epoch: int | None = None
    world_size: int = 1
    manifest: Manifest | None = field(default=None, repr=False)


class CheckpointStore:
    """Crash-safe checkpoints in ``url``: ``step-<n>/`` directories with a manifest.

    Args:
        url: a path or fsspec URL (``/ckpt``, ``file:///ckpt``, ``memory://run1``,
            ``s3://bucket/run1``, ``gs://...``, ``az://...``). The text ``{node_rank}``
            is replaced by this worker's node rank, so ``"/local/ckpt-{node_rank}"``
            gives every node of a one-machine test its own "local disk".
        keep_last: committed checkpoints to keep (``None``: keep all). Older ones are
            deleted only after a newer one is committed.
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

    Example::

        store = CheckpointStore("s3://bucket/run1", keep_last=3,
                                storage_options={"profile": "train"})
        loaded = store.load()
        start = loaded.step + 1 if loaded else 0
        if loaded:
            model.load_state_dict(loaded.state["model"])
        for step in range(start, steps):
            ...
            if step % 100 == 0:
                store.save({"model": model.state_dict()}, step=step, blocking=False)
        store.close()

    .. warning::
        With ``blocking=False`` and ``reuse_staging=True`` (the default) the writer
        ranks keep one CPU copy of the state alive between saves. Pass
        ``reuse_staging=False`` when host memory is tighter than save latency.

    .. warning::
        ``node_local=True`` means every node's local rank 0 writes: the URL must
        name storage that is private to the node (a local disk, or a shared path
        containing ``{node_rank}``), or the nodes overwrite each other's saves.

    .. warning::
        ``save``, ``wait``, ``load`` and ``close`` are collective when a process
        group exists: call them on every rank, never under ``if rank == 0``, or the
        job hangs in the barrier until the collective timeout.
    """

    def __init__(self, url: str, *, keep_last: int | None = 3, node_local: bool = False,
                 storage_options: dict[str, Any] | None = None, info: DistInfo | None = None,
                 checksum: str = "xxh3_128", reuse_staging: bool = True) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last={keep_last!r} must be an int >= 1 or None (keep all)")
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum={checksum!r} must be one of {CHECKSUMS}")
        self._info = info
        self.url = url.replace("{node_rank}", str(self.info.node_rank)) if isinstance(
            url, str) else url
        self.fs, self.root = resolve_url(self.url, storage_options)
        self.keep_last = keep_last
        self.node_local = node_local
        self.checksum = checksum
        self._bg = BackgroundWriter()
        self._pending_step: int | None = None
        self._janitor: threading.Thread | None = None
        self.reuse_staging = reuse_staging
        self._staging: dict[str, torch.Tensor] = {}
        self._staged: threading.Event | None = None  # set when deferred copies are done
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

    # ------------------------------------------------------------------ saving
    def save(self, state_dict: dict[str, Any], *, step: int, metadata: dict[str, Any] | None = None,
             blocking: bool = True, copy_later: Iterable[torch.Tensor] = ()) -> None:
        """Save ``state_dict`` as checkpoint ``step``. Collective: call on every rank.

        Args:
            state_dict: nested dicts/lists/tuples of tensors and Python primitives.
            step: the global step (``>= 0``); saving an existing step replaces it.
            metadata: small JSON-able dict recorded in the manifest (``epoch``...).
            blocking: when False, writers copy the tensors to CPU memory (inside
                ``save()``, except those in ``copy_later``) and write on a background
                thread. The next ``save``/``wait``/``load``/``close`` waits for it and
                raises its error.
            copy_later: with ``blocking=False``, tensors of ``state_dict`` (matched by
                storage, so parameters match their ``state_dict()`` views) that the
                caller promises not to modify until :meth:`wait_staged` returns: they
                are copied on the background thread, overlapping whatever the caller
                does next, instead of inside ``save()``. :class:`ElasticLoop` passes
                the parameters and optimizer state (they change only in
                ``optimizer.step()``) and calls :meth:`wait_staged` right before it,
                so the copy overlaps the next forward and backward pass. Ignored
                when blocking.

        Raises:
            TypeError: ``state_dict`` holds something weights-only loading cannot read
                (the message names the key path), or ``metadata`` is not JSON-able.
            CheckpointError: the write failed on a writer rank (raised on every rank).

        .. warning::
            A blocking save returns on every rank only once the checkpoint is
            committed. A non-blocking save commits later: a crash before the next
            ``wait()`` loses it (the previous checkpoint stays valid). Deleting the
            checkpoints beyond ``keep_last`` runs beside training after a blocking
            save and is joined by the next store call.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r} must be an int >= 0")
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metadata={metadata!r} must be JSON-serializable: {e}") from e
        if hasattr(state_dict, "state_dict") and not isinstance(state_dict, dict):
            state_dict = state_dict.state_dict()
        validate_state(state_dict)
        self._finish_pending()
        if blocking:
            err: BaseException | None = None
            if self.is_writer:
                try:
                    self._write(prepare_state(state_dict, copy=False), step, metadata)
                except Exception as e:  # every rank must learn about it, below
                    err = e
            self._agree(err, f"saving checkpoint step {step} to {self.url}")
            return
        if self.is_writer:
            used: dict[str, torch.Tensor] = {}
            deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
            staged = prepare_state(state_dict, copy=True,
                                   pool=self._staging if self.reuse_staging else None,
                                   used=used, later=storage_keys(copy_later),
                                   deferred=deferred)
            self._staging = used if self.reuse_staging else {}
            after = None
            if any(t.is_cuda for t in iter_tensors(state_dict)):
                if any(src.is_cuda for src, _ in deferred):
                    after = torch.cuda.Event()
                    after.record()  # the deferred copies wait for work issued so far
                torch.cuda.synchronize()  # the pinned copies were issued non_blocking
            self._staged = threading.Event() if deferred else None
            self._bg.start(self._stage_and_write, deferred, after, self._staged, staged, step,
                           metadata)
        self._pending_step = step

    def _stage_and_write(self, deferred: list[tuple[torch.Tensor, torch.Tensor]], after: Any,
                         staged: threading.Event | None, state: Any, step: int,
                         metadata: dict[str, Any]) -> None:
        if staged is not None:
            try:
                copy_deferred(deferred, after)
            finally:
                staged.set()  # also on failure: the error surfaces at the next store call
        self._write(state, step, metadata, True)

    def wait_staged(self) -> None:
        """Return once the in-flight save no longer reads the caller's tensors.

        After a non-blocking save with ``copy_later``, call this before modifying any
        of those tensors (:class:`ElasticLoop` calls it before ``optimizer.step()``).
        Returns at once when nothing is being staged. Not collective: only this
        rank's background copy is waited for, and a failure is raised later, by the
        next ``save``/``wait``/``load``/``close``.
        """
        if self._staged is not None:
            self._staged.wait()
            self._staged = None

    def _write(self, state: Any, step: int, metadata: dict[str, Any],
               in_background: bool = False) -> None:
        t0 = time.perf_counter()
        path, manifest = write_checkpoint(self.fs, self.root, state, step=step,
                                          checksum=self.checksum, metadata=metadata,
                                          world_size=self.info.world_size)
        self.last_save_s = time.perf_counter() - t0
        log.info("checkpoint step %d committed to %s (%.1f MB in %.2f s)", step, path,
                 manifest.size_bytes / 1e6, self.last_save_s)
        if in_background:
            self._retain(just_written=step)  # already off the training thread
        else:
            # deleting old checkpoints (GBs of unlink) need not block the caller: it runs
            # beside training and is joined before the next store operation
            self._join_janitor()
            self._janitor = threading.Thread(target=self._retain, kwargs={"just_written": step},
                                             name="ek-retention", daemon=True)
            self._janitor.start()

    def _join_janitor(self) -> None:
        if self._janitor is not None:
            self._janitor.join()
            self._janitor = None

    def _retain(self, *, just_written: int) -> None:
        try:
            clean_stale(self.fs, self.root, newest_committed=just_written)
            if self.keep_last is None:
                return
            committed = [i.step for i in self._committed()]
            newer = sorted((s for s in committed if s != just_written), reverse=True)
            # the one just written always counts as kept, whatever its number
            for s in newer[self.keep_last - 1:]:
                log.info("retention (keep_last=%d): deleting checkpoint step %d", self.keep_last, s)
                delete_step(self.fs, self.root, StepDir(s, self._dir(s)))
        except Exception as e:  # retention must never fail a save that committed
            log.warning("checkpoint retention in %s failed: %r", self.url, e)

    def _dir(self, step: int) -> str:
        return join(self.root, step_dir_name(step))

    def _agree(self, err: BaseException | None, what: str) -> None:
        """All ranks learn whether any writer failed; doubles as the save barrier."""
        failed = all_reduce_max(1 if err is not None else 0) if is_dist_ready() else int(
            err is not None)
        if err is not None:
            raise err
        if failed:
            raise CheckpointError(f"{what} failed on a writer rank (see its log)")

    def _join_pending(self) -> tuple[int, BaseException | None] | None:
        """Join the in-flight save on this rank: ``(step, error)``, or None if none."""
        self._join_janitor()
        if self._pending_step is None:
            return None
        step, self._pending_step = self._pending_step, None
        err = self._bg.join() if self.is_writer else None
        self._staged = None
        if err is not None:
            log.error("background save of checkpoint step %d to %s failed: %r", step,
                      self.url, err)
        return step, err

    def _finish_pending(self) -> None:
        joined = self._join_pending()
        if joined is not None:
            step, err = joined
            self._agree(err, f"background save of checkpoint step {step} to {self.url}")

    def wait(self) -> None:
        """Wait for the in-flight non-blocking save; re-raise its error. Collective."""
        self._finish_pending()

    def wait_local(self) -> None:
        """Join the in-flight save on this rank only, with no collective.

        For error paths: when one rank is failing on its own, its peers may be inside
        another collective (or gone), so the all-reduce of :meth:`wait` would be
        matched against the wrong operation or block until the timeout. A save that
        completes here is committed as usual; a failure is logged, not raised, so the
        error already propagating stays the one the user sees.
        """
        self._join_pending()

    def close(self) -> None:
        """Wait for the in-flight save (collective, like :meth:`wait`)."""
        self._finish_pending()

    # ------------------------------------------------------------------ reading
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints in this store (this node's, when node-local), oldest first.

        Committed means the manifest is present and parses; checksums are not read
        (see :meth:`verify`). Not collective.
        """
        self._join_janitor()
        return self._committed()

    def _committed(self) -> list[CheckpointInfo]:
        out = []
        for d in scan(self.fs, self.root):
            try:
                m = read_manifest(self.fs, d)
            except CheckpointCorruptError:
                continue
            out.append(CheckpointInfo(step=m.step, path=d.path, metadata=m.metadata,
                                      size_bytes=m.size_bytes, time=m.time, epoch=m.epoch,
                                      world_size=m.world_size, manifest=m))
        return out

    def latest_step(self) -> int | None:
        """The newest committed step in this store (not verified; not collective)."""
        infos = self.list()
        return infos[-1].step if infos else None

    def verify(self, *, deep: bool = True) -> list[tuple[int, str, str | None]]:
        """Check every ``step-<n>`` directory: ``(step, path, problem or None)``, oldest first.

        ``deep`` recomputes checksums (reads everything); otherwise sizes only.
        """
        self._join_janitor()
        out = []
        for d in scan(self.fs, self.root):
            try:
                verify(self.fs, d, deep=deep)
                out.append((d.step, d.path, None))
            except CheckpointCorruptError as e:
                out.append((d.step, d.path, str(e)))
        return out

    def _newest_verified(self) -> tuple[StepDir, Manifest, Any] | None:
        for d in reversed(scan(self.fs, self.root)):
            try:
                m, source = verify(self.fs, d, deep=True, keep=True)
                return d, m, source
            except CheckpointCorruptError as e:
                log.warning("skipping checkpoint %s, falling back to an older one: %s", d.path, e)
            except OSError as e:
                log.warning("skipping checkpoint %s (cannot read it: %r)", d.path, e)
        return None

    def load(self, *, map_location: Any = None) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies, or None. Collective: call on every rank.

        Corrupt or partial newer checkpoints are logged (warning) and skipped. With a
        process group, one rank reads and broadcasts the state tensor by tensor; with
        ``node_local=True`` nodes that lacked the step then commit a local copy.

        Args:
            map_location: as for :func:`torch.load`; with a process group it must be a
                device, a device string or a ``{"cpu": device}`` dict.

        Raises:
            UnsafeCheckpointError: the newest verified checkpoint holds pickled objects
                (it is refused, never executed, and no older one is used in its place).
        """
        self._finish_pending()
        if not (is_dist_ready() and self.info.world_size > 1):
            found = self._newest_verified()
            if found is None:
                return None
            d, m, source = found
            state = load_payload(source, map_location=map_location, where=d.path)
            return LoadedCheckpoint(step=d.step, state=state, metadata=m.metadata, path=d.path)
        return self._load_distributed(map_location)

    def _load_distributed(self, map_location: Any) -> LoadedCheckpoint | None:
        info = self.info
        device = target_device(map_location)
        found = self._newest_verified() if self.is_writer else None
        step, src = agree_on_holder(found[0].step if found else None, info.rank, info.world_size)
        if step is None:
            return None
        state, header = None, None
        if info.rank == src:
            assert found is not None
            d, m, source = found
            try:
                state = load_payload(source, map_location=device, where=d.path)
                header = {"ok": True, "metadata": m.metadata, "path": d.path}
            except Exception as e:
                header = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                broadcast_object(header, src=src)
                raise
        header = broadcast_object(header, src=src)
        if not header["ok"]:
            raise UnsafeCheckpointError(f"rank {src} could not load checkpoint step {step}: "
                                        f"{header['error']}")
        state = broadcast_state(state, src=src, rank=info.rank, device=device)
        path = header["path"]
        if self.node_local:
            err: BaseException | None = None
            if self.is_writer and (found is None or found[0].step < step):
                try:
                    path, _ = write_checkpoint(self.fs, self.root, prepare_state(state, copy=False),
                                               step=step, checksum=self.checksum,
                                               metadata=header["metadata"],
                                               world_size=info.world_size)
                    log.info("node %d lacked checkpoint step %d: local copy written to %s",
                             info.node_rank, step, path)
                    self._retain(just_written=step)
                except Exception as e:
                    err = e
            path = self._dir(step)
            self._agree(err, f"copying checkpoint step {step} to {self.url}")
        return LoadedCheckpoint(step=step, state=state, metadata=header["metadata"], path=path)

