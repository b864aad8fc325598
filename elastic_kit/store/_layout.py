"""The on-storage layout of a store: names, scan, verify, commit, prune.

The rules below hold in one place, for every kind of storage; how a write is made
durable and atomic on a given storage is a :class:`~elastic_kit.store._backend.Backend`
(``_backend_local``: a local disk or NFS; ``_backend_object``: object stores and any
other fsspec filesystem), chosen once when a :class:`Layout` is made.

Names. A checkpoint is the directory ``step-`` + exactly 12 ASCII digits. Nothing else
counts (not ``step-5``, not Unicode digits, not a trailing newline) and retention
deletes exactly the directories it scanned. Inside, a manifest names plain files
only (:func:`~elastic_kit.store._manifest.check_file_name`) and only regular
files are opened (a FIFO or ``/dev/zero`` would hang a reader).

Commit. *A checkpoint exists only once its manifest is in place, and the manifest is
the last thing written.* Commit is monotonic: once a step is committed, no later save
of it un-commits it at any moment, on any backend:

- first save of a step, local / NFS: payload and manifest go into
  ``.tmp-step-<n>-<owner>-<id>/``, both files and the directory are fsync'ed, the
  directory is renamed to ``step-<n>/`` and the parent fsync'ed;
- first save, object stores (and ``memory://``): the payload is uploaded into
  ``step-<n>/`` and the manifest after it;
- a *re-save* of a committed step (any backend) writes the new payload beside the
  old one under a fresh name (``state.<id>.pt``) and then replaces the manifest in
  one atomic operation (``os.replace`` locally, one PUT on object stores). Before the
  switch the old manifest describes the old, intact payload; after it, the new one.
  Only then is the old payload removed.

Reading. Only proven corruption skips a checkpoint: a manifest that does not
validate, a size or checksum mismatch of fully read bytes, a listed file that is
absent while the manifest that lists it is unchanged. A failed read (403, 500/503,
a dropped connection, a timeout) is retried with backoff and then raised. A reader
that finds a file gone because a concurrent saver's retention or re-save moved it
rescans and reads the newest again.

Leftovers. A ``.tmp-*`` directory is named after a random owner token (no pid or
hostname, which collide across PID namespaces and containers); it is stale only
when no store of this process writes it and nothing in it changed for
``stale_after_s`` (a writer keeps the payload's mtime fresh while writing, so the
age works as a lease). An uncommitted ``step-<n>`` directory on an object store is
removed on the same age rule, and only below the newest committed step.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator

import fsspec

from elastic_kit.store._backend import Backend
from elastic_kit.store._backend_local import LocalBackend
from elastic_kit.store._backend_object import ObjectBackend
from elastic_kit.store._chunk_listing import check_digests, verify_tensor_file
from elastic_kit.store._fs import is_local, join, retrying
from elastic_kit.store._manifest import (
    MANIFEST_NAME, MAX_MANIFEST_BYTES, PAYLOAD_NAME, FileEntry, Manifest, check_file_name,
    run_id,
)
from elastic_kit.store._serialize import hash_stream, load_payload, save_into
from elastic_kit.store._tree import leaves
from elastic_kit.errors import (
    CheckpointConflictError, CheckpointCorruptError, CheckpointError, UnsafeCheckpointError,
)

__all__ = ["STEP_DIGITS", "step_dir_name", "parse_step_dir", "StepDir",
           "Found", "Layout"]

log = logging.getLogger(__name__)

STEP_DIGITS = 12
_STEP_RE = re.compile(r"step-([0-9]{12})", re.ASCII)
_CHUNK = 8 << 20
#: Names a script's own ``torch.save`` files usually end with (hinted at, never read).
_TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".tar", ".ckpt")
#: The locks of the commits in progress in this process, by step directory (see
#: ``commit``), with the number of commits holding or awaiting each; reentrant: a
#: storage callback (a fault-injecting filesystem's) may commit as another writer
#: would, on the committing thread. One per directory: a commit (its whole write)
#: never waits for another directory's.
_COMMIT_LOCKS: dict[str, tuple[threading.RLock, int]] = {}
_COMMIT_LOCKS_LOCK = threading.Lock()


@contextlib.contextmanager
def _commit_lock(path: str) -> Iterator[None]:
    """Hold the lock of commits of the step directory ``path``."""
    with _COMMIT_LOCKS_LOCK:
        lock, users = _COMMIT_LOCKS.get(path, (None, 0))
        lock = threading.RLock() if lock is None else lock
        _COMMIT_LOCKS[path] = (lock, users + 1)
    try:
        with lock:
            yield
    finally:
        with _COMMIT_LOCKS_LOCK:
            users = _COMMIT_LOCKS[path][1] - 1
            if users:
                _COMMIT_LOCKS[path] = (lock, users)
            else:
                del _COMMIT_LOCKS[path]


def step_dir_name(step: int) -> str:
    """``step-000000000012``: zero padded so that names sort like steps."""
    if type(step) is not int or not 0 <= step < 10**STEP_DIGITS:
        raise ValueError(f"step={step!r} must be an int in [0, {10**STEP_DIGITS - 1}]")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a canonical ``step-<12 ASCII digits>`` name, else None."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StepDir:
    """A ``step-<n>`` directory, committed or not."""

    step: int
    path: str


@dataclass
class Found:
    """A checkpoint whose manifest and every listed file verified.

    ``source`` is what :func:`torch.load` reads: the payload's bytes (remote) or an
    open file (local: an open file stays readable even if a concurrent retention
    deletes the directory). The caller closes it.
    """

    dir: StepDir
    manifest: Manifest
    source: IO[bytes]


class _Vanished(Exception):
    """A file disappeared while being read because the checkpoint changed: rescan."""


#: ``on_delete(path, step, leftover)``: told of a deletion before it happens (``step``
#: None for a ``.tmp-*`` leftover; ``leftover`` True for what an interrupted save left).
OnDelete = Callable[[str, "int | None", bool], None]


class _ManifestMissing(CheckpointCorruptError):
    """A step directory without a manifest: a save that did not finish, or (on an
    object store) one not committed yet, or one whose retention began."""


class Layout:
    """One store's files: every storage access of the checkpoint package goes here.

    Args:
        fs, root: the filesystem and the store's root path in it.
        url: the store's URL, for messages.
        writer_id: a random id of the owning store (in manifests and temp names).
        read_attempts, backoff_s: retries of a failed read before it is raised.
        read_budget_s: no retry starts after this many seconds of trying.
        stale_after_s: age after which another writer's leftovers may be removed.
        private: local directories are created 0700 and files 0600 (the snapshot
            tier's stores in shared memory, which other users of the host must not
            read).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, url: str,
                 writer_id: str | None = None, read_attempts: int = 4,
                 backoff_s: float = 0.2, stale_after_s: float = 600.0,
                 read_budget_s: float | None = None, private: bool = False) -> None:
        self.fs = fs
        self.private = private
        self.root = root
        self.url = url
        self.writer_id = writer_id or uuid.uuid4().hex
        self.read_attempts = read_attempts
        self.backoff_s = backoff_s
        self.stale_after_s = stale_after_s
        self.read_budget_s = read_budget_s
        self.backend: Backend = (
            LocalBackend(root, url=url, writer_id=self.writer_id, private=private)
            if is_local(fs) else ObjectBackend(fs, root, url=url, read=self._read))
        self._warned_older = False  # a save older than the newest committed was logged
        self._warned_late = False  # a late commit of an earlier worker group was logged
        self._warned_entries: set[str] = set()  # step-<n> names that are no directory
        # steps a load of this layout skipped as corrupt: retention does not count them
        self.found_corrupt: set[int] = set()

    # ------------------------------------------------------------------ helpers
    def _read(self, fn: Callable[[], Any], what: str,
              give_up: tuple[type[BaseException], ...] = ()) -> Any:
        return retrying(fn, what=what, attempts=self.read_attempts, backoff_s=self.backoff_s,
                        budget_s=self.read_budget_s,
                        give_up=(FileNotFoundError, CheckpointCorruptError, _Vanished,
                                 NotADirectoryError, *give_up))

    def reading(self, fn: Callable[[], Any], what: str) -> Any:
        """Run the read ``fn`` with the store's retry policy (``what`` names it)."""
        return self._read(fn, what)

    def reading_listed(self, fn: Callable[[], Any], what: str, d: StepDir,
                       m: Manifest) -> Any:
        """Run the read ``fn`` of a file the manifest ``m`` of ``d`` lists, with the
        store's retry policy, retrying a not-found too while the manifest is
        unchanged: one 404 (a lagging gateway or cache) proves nothing, while a file
        still missing after the retries under the same manifest is damage, which the
        caller then reports. Raises the last :class:`FileNotFoundError` at once when
        the manifest changed or vanished (the step was saved again or deleted)."""
        delay = self.backoff_s
        for attempt in range(1, self.read_attempts + 1):
            try:
                return self._read(fn, what)
            except FileNotFoundError as e:
                try:
                    changed = self.read_manifest(d) != m
                except CheckpointCorruptError:
                    changed = True
                if changed or attempt == self.read_attempts:
                    raise
                log.warning("%s, which the manifest of %s lists, was not found (attempt %d "
                            "of %d, looking again in %.1f s): %s", what, d.path, attempt,
                            self.read_attempts, delay, e)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")  # pragma: no cover

    def looks_again(self) -> Iterator[None]:
        """Yield once before each further look of the retry policy (``read_attempts``
        - 1 of them, at least one), after sleeping its backoff: for a caller that
        must not decide on one answer of an object store."""
        delay = self.backoff_s
        for _ in range(max(self.read_attempts - 1, 1)):
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            yield

    def dir_of(self, step: int) -> StepDir:
        return StepDir(step, join(self.root, step_dir_name(step)))

    def check_root(self) -> None:
        """Raise a clear error when the root cannot hold a store (a file, no bucket).

        Raises:
            NotADirectoryError: the root is a file.
            FileNotFoundError: the root's bucket does not exist.
            CheckpointError: the store cannot be reached (after retries).
        """
        self.backend.check_root()

    # ------------------------------------------------------------------ scan
    def scan(self) -> list[StepDir]:
        """Every canonical ``step-<n>`` directory, oldest first (committed or not)."""
        entries = self.backend.list_root()
        out = []
        for name, is_dir in entries:
            step = parse_step_dir(name)
            if step is not None and is_dir:
                out.append(StepDir(step, join(self.root, name)))
            elif step is not None and name not in self._warned_entries:
                # never followed (a link planted in a shared directory would make the
                # store read, and retention delete, whatever it names), but not in silence
                self._warned_entries.add(name)
                log.warning("%s in %s is not a directory (a symbolic link, or a file): not "
                            "read as checkpoint step %d", name, self.url, step)
        if not out:
            self._hint_foreign_files(entries)
        return sorted(out, key=lambda d: d.step)

    def _hint_foreign_files(self, entries: list[tuple[str, bool]]) -> None:
        """Say once that a file a script saved itself is not read (an empty store
        beside it means "no checkpoint to restore", and training starts over)."""
        for name, is_dir in entries:
            if (is_dir or not name.endswith(_TORCH_SAVE_SUFFIXES)
                    or name in self._warned_entries):
                continue
            self._warned_entries.add(name)
            log.warning("%s in %s is not an elastic_kit checkpoint (a torch.save file?): "
                        "a store reads only its own step-<n>/ directories; \"Coming from "
                        "torch.save\" in docs/checkpoints.md carries such a run over",
                        name, self.url)

    # ------------------------------------------------------------------ read
    def _manifest_text(self, d: StepDir) -> bytes:
        path = join(d.path, MANIFEST_NAME)

        def read() -> bytes:
            f, size = self.backend.open_regular(path, MAX_MANIFEST_BYTES)
            with f:
                text = f.read(MAX_MANIFEST_BYTES + 1)
            if len(text) != size:
                # not the bytes of the file just measured (a read cut short, or the
                # manifest replaced in between): read again, never parse a fragment
                raise OSError(errno.EIO, f"{path}: reading it gave {len(text)} bytes, "
                                         f"but its size is {size} (a read cut short)")
            return text

        try:
            return self._read(read, path)
        except FileNotFoundError as e:
            raise _ManifestMissing(
                f"{d.path}: {MANIFEST_NAME} is missing (a save that did not finish?)") from e

    def read_manifest(self, d: StepDir) -> Manifest:
        """The validated manifest of ``d``.

        Raises:
            CheckpointCorruptError: missing, malformed, or for another step.
            CheckpointError: it cannot be read (after retries).
        """
        path = join(d.path, MANIFEST_NAME)
        m = Manifest.from_json(self._manifest_text(d), where=path)
        if m.step != d.step:
            raise CheckpointCorruptError(
                f"{path}: manifest says step {m.step} but the directory is step {d.step}")
        return m

    def _check_file(self, d: StepDir, m: Manifest, name: str, *, deep: bool,
                    keep: bool, shares: dict[int, int] | None = None) -> IO[bytes] | None:
        """Verify one listed file; with ``keep`` return its verified bytes as a source.

        ``shares`` (a tensor file of a sharded step, deep and not kept): the file is
        checked as a load checks it (its chunks' places and checksums, see
        :func:`~._chunk_listing.verify_tensor_file`) and its chunks' digest shares are
        added to ``shares`` (tensor index -> share) once it verified."""
        entry = m.files[name]
        path = join(d.path, check_file_name(name))
        found: dict[int, int] = {}

        def read() -> IO[bytes] | None:
            f, size = self.backend.open_regular(path, None)
            try:
                if size != entry.size:
                    raise CheckpointCorruptError(
                        f"{d.path}: {name} is {size} bytes but the manifest says "
                        f"{entry.size} (truncated or partially written)")
                if not deep:
                    return None
                if shares is not None:
                    # one pass: the chunks' checksums and digest shares, and the whole
                    # file's checksum (a flat file's is of its chunks', _chunk_listing)
                    found.clear()
                    found.update(verify_tensor_file(f, m, name, where=d.path, path=path))
                    return None
                buf = self.backend.kept_copy() if keep else None
                n, digest = hash_stream(f, m.checksum, chunk=_CHUNK,
                                        sink=buf.write if buf is not None else None)
                if n != entry.size:
                    # The size just matched: a stream that ends early is a read cut
                    # short (a dropped connection), which proves nothing. It is retried,
                    # and the retry's fresh size check above is what proves a file
                    # really shorter (or longer) than the manifest says.
                    raise OSError(errno.EIO,
                                  f"{path}: reading it gave {n} bytes, but its size is "
                                  f"{entry.size} as the manifest says (a read cut short)")
                if digest != entry.checksum:
                    raise CheckpointCorruptError(
                        f"{d.path}: {name} has {m.checksum} {digest} but the manifest says "
                        f"{entry.checksum} (corrupt payload)")
                if not keep:
                    return None
                if buf is not None:
                    buf.seek(0)
                    return buf
                f.seek(0)
                out, f = f, None  # handed to the caller, kept open
                return out
            finally:
                if f is not None:
                    f.close()

        try:
            got = self.reading_listed(read, path, d, m)
            for i, share in found.items():
                assert shares is not None
                shares[i] = shares.get(i, 0) + share
            return got
        except FileNotFoundError as e:
            # Absent because the checkpoint was re-saved or deleted meanwhile? Then the
            # manifest changed or vanished: read the store again. Else it is damage.
            try:
                now = self.read_manifest(d)
            except CheckpointCorruptError:
                raise _Vanished(d.path) from e
            if now != m:
                raise _Vanished(d.path) from e
            raise CheckpointCorruptError(
                f"{d.path}: the manifest names {name}, which does not exist") from e

    def verify(self, d: StepDir, *, deep: bool = True, keep: bool = False) -> Found | Manifest:
        """Check ``d`` against its manifest: every listed file's type, size and (deep)
        checksum; deep and without ``keep``, a sharded (or flat) step's index too, as a
        load checks it: every chunk's place in its file and checksum, and every
        tensor's digest (:func:`~._chunk_listing.verify_tensor_file`, one pass over
        each file). Returns a :class:`Found` (payload source kept open) when ``keep``,
        else the manifest.

        Raises:
            CheckpointCorruptError: naming the directory and what does not match.
            CheckpointError: a read failed after retries.
        """
        m = self.read_manifest(d)
        source = None
        # A sharded (or flat) step checked in full: each tensor file once, as a load
        # checks what it reads (every chunk's place and checksum, and its share of its
        # tensor's digest), then every tensor's digest. The files' own checksums do
        # not cover the index: a manifest whose chunk checksum, offset or shape, or
        # tensor digest, was damaged would verify while no load of it succeeds.
        shares: dict[int, int] | None = (
            {} if deep and not keep and m.sharded is not None else None)
        try:
            for name in m.files:
                # With ``keep`` (a load): loading a sharded checkpoint reads each shard
                # file by ranges, on the ranks that own them, and verifies what it reads
                # there (chunk checksums, the global digest): here only their sizes are
                # checked.
                deep_file = deep and (not keep or m.sharded is None or name == m.payload)
                got = self._check_file(d, m, name, deep=deep_file,
                                       keep=(keep or shares is not None) and name == m.payload,
                                       shares=shares if name != m.payload else None)
                if got is not None:
                    source = got
            if shares is not None:
                check_digests(m, shares, where=d.path)
                # and the payload's placeholders name the index's tensors where they are
                assert source is not None and m.sharded is not None
                try:
                    replicated = load_payload(source, map_location="cpu", where=d.path)
                except UnsafeCheckpointError as e:  # what a load refuses: not a good step
                    raise CheckpointCorruptError(str(e)) from e
                for path, value in leaves(replicated):
                    m.sharded.placed(path, value, where=d.path)
        except BaseException:
            if source is not None:
                source.close()
            raise
        if keep:
            assert source is not None
            return Found(d, m, source)
        if source is not None:
            source.close()
        return m

    def newest_verified(self, *, below: int | None = None) -> Found | None:
        """The newest checkpoint that fully verifies; corrupt newer ones are logged and
        skipped. Rescans when a concurrent save or retention changed what it read.
        ``below``: only steps below it (the one before a checkpoint whose shards
        proved corrupt when read)."""
        for _ in range(20):
            rescan = False
            found: Found | None = None
            # Steps without a manifest: unfinished saves, or (on an object store, where
            # a step's objects are not one rename) one being uploaded that commits
            # while older steps are read, and whose retention may delete the step
            # read next before its payload. Such a step committed meanwhile is read.
            unfinished: list[StepDir] = []
            for d in reversed(self.scan()):
                if below is not None and d.step >= below:
                    continue
                try:
                    found = self.verify(d, deep=True, keep=True)
                    assert isinstance(found, Found)
                    break
                except _Vanished:
                    log.info("checkpoint %s changed while being read: reading the store again",
                             d.path)
                    rescan = True
                    break
                except CheckpointCorruptError as e:
                    if not self._exists_dir(d):
                        rescan = True  # deleted meanwhile, not damaged
                        break
                    log.warning("skipping checkpoint %s, falling back to an older one: %s",
                                d.path, e)
                    if isinstance(e, _ManifestMissing):
                        unfinished.append(d)  # not committed (yet): not damage
                    else:
                        self.found_corrupt.add(d.step)
            if not rescan and any(self._manifest_present(d) for d in unfinished):
                log.info("a checkpoint was committed while the store was read: reading it "
                         "again")
                rescan = True
            if not rescan:
                return found
            if found is not None:
                found.source.close()
        raise CheckpointError(f"checkpoints in {self.url} kept changing while being read "
                              f"(20 attempts): is another job writing this URL?")

    def _manifest_present(self, d: StepDir) -> bool:
        """Whether ``d`` has a manifest now (its text is read; whether it validates
        is the next walk's question)."""
        try:
            self._manifest_text(d)
        except Exception:
            return False
        return True

    def _exists_dir(self, d: StepDir) -> bool:
        return self.backend.is_dir(d.path)

    def committed(self) -> Iterator[tuple[StepDir, Manifest]]:
        """Every directory whose manifest validates, oldest first (payload not read)."""
        for d in self.scan():
            try:
                yield d, self.read_manifest(d)
            except CheckpointCorruptError as e:
                log.debug("not committed: %s", e)

    # ------------------------------------------------------------------ write
    def _manifest_for(self, step: int, name: str, entry: FileEntry, checksum: str,
                      metadata: dict[str, Any], world_size: int) -> Manifest:
        epoch = metadata.get("epoch")
        return Manifest(step=step, files={name: entry}, payload=name, checksum=checksum,
                        metadata=metadata,
                        epoch=epoch if type(epoch) is int and epoch >= 0 else None,
                        world_size=world_size, writer=self.writer_id)

    def committed_manifest(self, d: StepDir) -> Manifest | None:
        """The manifest of ``d`` when it is committed, else None."""
        return self._committed_manifest(d)

    def existing(self, d: StepDir) -> tuple[Manifest | None, bool]:
        """What a save of ``d`` finds there: its committed manifest (or None), and
        whether the save goes beside what is there and switches the manifest last
        (the re-save path): ``d`` is committed, or holds a manifest that does not
        validate (damage, a newer release's format). Such a manifest is no other
        writer's commit: the save replaces it, as it replaces a committed one, instead
        of failing as though the step had been committed meanwhile."""
        try:
            return self.read_manifest(d), True
        except CheckpointCorruptError as e:  # none there, or one that does not validate
            return None, not isinstance(e, _ManifestMissing)

    def _manifest_missing(self, d: StepDir) -> bool:
        """Whether ``d`` has no manifest at all: a save that did not finish. One that is
        there but does not validate (a format of a newer release, damage) is not a
        leftover: the step is skipped at load, never deleted as one."""
        try:
            self._manifest_text(d)
        except CheckpointCorruptError as e:
            return isinstance(e, _ManifestMissing)
        except Exception:
            return False
        return False

    def _committed_manifest(self, d: StepDir) -> Manifest | None:
        try:
            return self.read_manifest(d)
        except CheckpointCorruptError:
            return None

    def commit(self, state: Any, *, step: int, checksum: str, metadata: dict[str, Any],
               world_size: int) -> tuple[str, Manifest]:
        """Write and commit ``state`` as ``step-<n>``; returns (path, manifest).

        A committed checkpoint of the same step is replaced monotonically (see the
        module docstring): it stays committed, old or new, at every moment.
        """
        self.check_root()
        d = self.dir_of(step)
        # two stores of one process saving one step (a script's own export to the
        # checkpointer's URL): one after the other, the second a re-save
        with _commit_lock(d.path):
            return self._commit(d, state, step=step, checksum=checksum, metadata=metadata,
                                world_size=world_size)

    def _commit(self, d: StepDir, state: Any, *, step: int, checksum: str,
                metadata: dict[str, Any], world_size: int) -> tuple[str, Manifest]:
        old, replacing = self.existing(d)
        # A re-save's payload gets a fresh name: the old one stays intact (and named by
        # the manifest in place) until the backend switches the manifest. So does every
        # save where files are written in place (an object store): see its backend.
        fresh = replacing or getattr(self.backend, "in_place", False)
        name = f"state.{uuid.uuid4().hex[:12]}.pt" if fresh else PAYLOAD_NAME
        if old is not None and name in old.files:  # pragma: no cover - 48 random bits
            raise AssertionError(name)

        def write(f: IO[bytes], path: str, fsync: bool) -> FileEntry:
            return save_into(f, path, state, checksum, fsync=fsync)

        def seal(name: str, entry: FileEntry) -> Manifest:
            return self._manifest_for(step, name, entry, checksum, metadata, world_size)

        manifest = self.backend.commit(d.path, name, replacing=replacing, write=write,
                                       seal=seal)
        if old is not None:  # only now is the replaced payload unreferenced
            for old_name in set(old.files) - set(manifest.files):
                try:
                    self.backend.remove_file(join(d.path, old_name))
                except Exception as e:
                    log.debug("could not remove the replaced %s: %r", old_name, e)
        return d.path, manifest

    # ------------------------------------------------------------------ delete
    def delete(self, d: StepDir) -> None:
        """Delete one scanned directory so that a crash half way never leaves it
        committed (locally it is renamed away first; remotely the manifest goes first)."""
        self.backend.remove_step(d.path)

    def retain(self, keep_last: int, *, just_written: int, newest_verified: int,
               started: float) -> list[int]:
        """Delete committed checkpoints beyond the newest ``keep_last``; returns the steps.

        ``keep_last`` counts from the newest committed step, not from the one just
        written: a save of an older step (a loop that restarted from scratch after a
        load failed) is committed beside the newer ones, which stay.

        Never deleted: ``just_written``; anything newer than ``just_written`` (a save
        never deletes a newer step); anything newer than ``newest_verified`` (the
        newest step this store wrote or fully verified: a newer one that a read error
        hid is still the real newest); anything another store committed since
        ``started`` (then :class:`CheckpointConflictError` reports the second writer).

        A step a load of this layout found corrupt (:attr:`found_corrupt`) and nobody
        has saved again since is not counted: it stays while newer than the oldest kept
        step (as :meth:`prune` keeps one) and goes once older, so ``keep_last`` steps
        that load are kept, never a damaged one in place of the last good one.
        """
        self.found_corrupt.discard(just_written)
        committed = list(self.committed())
        foreign = [(d, m) for d, m in committed
                   if m.writer and m.writer != self.writer_id and m.time > started]
        run = run_id()
        late = [d.step for d, m in foreign if run and m.run == run and d.step < just_written]
        if late:
            # a process of an earlier worker group of this run (a node taken for dead
            # that was alive after all: woken from a freeze) committed the save it had
            # in flight: an older step of this same job, not another job's
            foreign = [(d, m) for d, m in foreign if d.step not in late]
            if not self._warned_late:
                self._warned_late = True
                log.warning("checkpoint step(s) %s in %s were committed late by a process of "
                            "an earlier worker group of this run (a node taken for dead that "
                            "was alive after all); retention treats them as older steps. If "
                            "another job was launched with the same --rdzv-id and URL, stop "
                            "one: the run id cannot tell the two apart", late, self.url)
        if foreign:
            d, m = foreign[-1]
            raise CheckpointConflictError(
                f"another job is writing checkpoints to {self.url}: {d.path} was committed "
                f"by store {m.writer[:16]} at {m.time:.0f}, after this store "
                f"({self.writer_id[:16]}) started at {started:.0f}; give each job its own "
                f"URL (nothing was deleted)")
        counted = sorted((d for d, _ in committed
                          if d.step <= max(newest_verified, just_written)),
                         key=lambda d: d.step, reverse=True)
        bad = self.found_corrupt
        kept = {d.step for d in [d for d in counted if d.step not in bad][:keep_last]}
        kept.add(just_written)
        oldest_kept = min(kept)
        newer = [d.step for d, _ in committed if d.step > just_written]
        if newer and not self._warned_older:
            self._warned_older = True  # once per store: a restarted loop saves many
            log.warning("checkpoint step %d was saved beside the newer step %d in %s, which "
                        "stays (retention counts keep_last=%d from the newest step)",
                        just_written, max(newer), self.url, keep_last)
        deleted = []
        for d in counted:
            if d.step in kept or d.step > just_written or (d.step in bad
                                                           and d.step > oldest_kept):
                continue
            log.info("retention (keep_last=%d): deleting checkpoint step %d", keep_last, d.step)
            self.delete(d)
            deleted.append(d.step)
        return deleted

    def prune(self, keep: int, *, dry_run: bool = False,
              on_delete: OnDelete | None = None) -> list[StepDir]:
        """Delete the committed checkpoints older than the newest ``keep`` that fully
        verify, then stale leftovers; returns the deleted (or, dry, the doomed)
        directories. ``on_delete(path, step, leftover)`` is called before each deletion
        (dry: for each that would happen), leftovers of interrupted saves included.

        Walks back from the newest step, reading and checksumming each, until ``keep``
        pass. A manifest alone does not count: a corrupt step newer than the oldest
        kept one is not counted and stays (load skips it, ``verify`` lists it), and
        with fewer than ``keep`` steps that verify nothing is deleted, so prune never
        deletes the loadable state and keeps a damaged newest step for inspection.

        Raises:
            CheckpointError: a read failed after retries (one of a checkpoint: before
                anything is deleted).
        """
        committed, oldest_kept = self._prune_walk(keep)
        doomed = ([d for d in committed if d.step < oldest_kept]
                  if oldest_kept is not None else [])
        for d in doomed:
            if on_delete is not None:
                on_delete(d.path, d.step, False)
            if not dry_run:
                log.info("prune (keep=%d): deleting checkpoint step %d", keep, d.step)
                self.delete(d)
        if committed:
            self.clean_stale(newest_committed=committed[-1].step, dry_run=dry_run,
                             on_delete=on_delete)
        return doomed

    def _prune_walk(self, keep: int) -> tuple[list[StepDir], int | None]:
        """The committed directories (oldest first) and the oldest of the newest ``keep``
        that fully verify (None when fewer do). Corrupt ones on the way are logged.
        Rescans when a concurrent save or retention changed what it read."""
        for _attempt in range(20):
            committed = [d for d, _ in self.committed()]
            verified = 0
            rescan = False
            for d in reversed(committed):
                try:
                    self.verify(d, deep=True)
                except _Vanished:
                    rescan = True
                    break
                except CheckpointCorruptError as e:
                    if not self._exists_dir(d):
                        rescan = True  # deleted meanwhile, not damaged
                        break
                    log.warning("prune: checkpoint step %d does not verify, so it is not "
                                "counted and stays (load skips it): %s", d.step, e)
                    continue
                verified += 1
                if verified == keep:
                    return committed, d.step
            if not rescan:
                return committed, None
        raise CheckpointError(f"checkpoints in {self.url} kept changing while being read "
                              f"(20 attempts): is another job writing this URL?")

    def clean_stale(self, *, newest_committed: int, dry_run: bool = False,
                    on_delete: OnDelete | None = None) -> int:
        """Remove leftovers of crashed saves; returns how many were removed (dry: would
        be). ``on_delete(path, step, True)`` is called before each removal.

        Local disks: ``.tmp-*`` directories no store of this process is writing and
        nothing in which changed for ``stale_after_s``. S3: multipart uploads under the
        steps never completed nor aborted (a killed writer's), unchanged for as long.
        Any storage: ``step-<n>`` directories without a manifest (not one with a
        manifest that does not validate) below ``newest_committed`` unchanged for as
        long.
        """
        removed = 0
        for path in self.backend.leftovers():
            try:
                age = self.backend.age(path)
            except FileNotFoundError:
                continue
            if age is not None and age >= self.stale_after_s:
                if on_delete is not None:
                    on_delete(path, None, True)
                if not dry_run:
                    log.info("removing the leftover of an interrupted save (unchanged for "
                             "%.0f s): %s", age, path)
                    self.backend.remove_tree(path)
                removed += 1
        for path, upload, age in self.backend.unfinished_uploads():
            if age < self.stale_after_s:
                continue  # a live writer's (its newest part is recent)
            if on_delete is not None:
                on_delete(path, None, True)
            if not dry_run:
                log.info("aborting the unfinished upload of an interrupted save (unchanged "
                         "for %.0f s): %s", age, path)
                self.backend.abort_upload(path, upload)
            removed += 1
        for d in self.scan():
            if d.step >= newest_committed or not self._manifest_missing(d):
                continue
            try:
                age = self.backend.age(d.path)
            except FileNotFoundError:
                continue
            if age is not None and age >= self.stale_after_s and self._manifest_gone(d):
                if on_delete is not None:
                    on_delete(d.path, d.step, True)
                if not dry_run:
                    log.info("removing the leftover of an interrupted save: %s", d.path)
                    self.delete(d)
                removed += 1
        return removed

    def _manifest_gone(self, d: StepDir) -> bool:
        """Whether ``d``'s manifest, missing at a first look, is still missing at each
        of the retry policy's further looks: a committed step is deleted for a missing
        manifest, so one 404 (a lagging gateway or listing cache) must not decide it.
        On a local disk the first look decides: a step's directory gets its manifest
        before it is renamed into place, and a deletion renames it away first."""
        if is_local(self.fs):
            return True
        for _ in self.looks_again():
            if not self._manifest_missing(d):
                log.warning("the manifest of %s was not found at a first look but is there: "
                            "the step is kept", d.path)
                return False
        return True
