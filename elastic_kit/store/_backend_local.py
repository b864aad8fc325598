"""The local-disk backend (and NFS mounts): temporary names, fsync, rename.

A first save of a step writes its payload and manifest into
``.tmp-step-<n>-<owner>-<id>/``, fsyncs both files and the directory, renames the
directory to ``step-<n>/`` and fsyncs the parent: the step appears whole or not at
all. A re-save writes the new payload beside the old one and switches the manifest
with ``os.replace``. Payloads are written with ``O_DIRECT`` (:mod:`._direct`: the
disk's full speed, no page cache) where the filesystem takes it.

A temporary name carries a random owner token (no pid or hostname, which collide
across PID namespaces and containers); the names this process is writing are kept in
a process-wide set so that another store object (or the CLI's prune run in-process)
never removes them as leftovers.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from typing import IO, TypeVar

from elastic_kit.store._backend import Fill, PayloadWrite, Seal, basename, check_size
from elastic_kit.store._direct import ALIGN, BUFFER_SIZE, DirectFile, open_direct
from elastic_kit.store._fs import join, write_error
from elastic_kit.store._manifest import MANIFEST_NAME, Manifest
from elastic_kit.errors import CheckpointConflictError, CheckpointCorruptError

__all__ = ["TMP_PREFIX", "LocalBackend", "fsync_dir", "open_regular_local"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Prefix of directories that hold a save in progress or a deletion (local disks).
#: They start with a dot so that globbing ``step-*`` never sees them.
TMP_PREFIX = ".tmp-"

# Names of temporary directories some store of this process is writing right now.
_LIVE_TMP: set[str] = set()
_LIVE_LOCK = threading.Lock()


def fsync_dir(path: str, *, committed: bool = False) -> None:
    """Flush a local directory's entries (new names, renames) to disk.

    A rename is durable only once the directory holding the name is fsync'ed; some
    filesystems refuse fsync on a directory, which is then logged and ignored. Any
    other failure (NFS's EIO) raises, so that a save does not report a commit that
    may not last, unless ``committed``: after the commit's rename, whose undoing would
    lose more, it is logged as a warning instead.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:  # pragma: no cover - platform dependent
        log.debug("cannot open directory %s to fsync it: %s", path, e)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            log.debug("fsync of directory %s is not supported here: %s", path, e)
        elif committed:
            log.warning("fsync of directory %s failed after a commit, which may not "
                        "survive a crash of the host: %r", path, e)
        else:
            raise
    finally:
        os.close(fd)


def open_regular_local(path: str) -> IO[bytes]:
    """Open a local file for reading only if it is a regular file (never a FIFO,
    device or symlink, which could hang the reader or leak another file)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointCorruptError(f"{path} is a symbolic link, expected a regular "
                                         f"file") from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointCorruptError(f"{path} is not a regular file "
                                     f"(mode {stat.filemode(st.st_mode)})")
    return os.fdopen(fd, "rb")


def _open_payload(path: str, mode: str) -> IO[bytes]:
    """A new payload file: ``O_DIRECT`` where the filesystem takes it, else an ordinary
    buffered file."""
    f = open_direct(path, mode)
    return f if f is not None else open(path, mode)  # type: ignore[return-value]


def _write_manifest(path: str, manifest: Manifest) -> None:
    """Write and fsync a manifest file (a disk-full error names the file)."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(e, path) from e


def _world_writable_sticky(path: str) -> bool:
    """Whether ``path`` is a directory every user may create entries in, each keeping
    its own (``/tmp``, ``/var/tmp``, ``/dev/shm``)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_IWOTH and mode & stat.S_ISVTX)


def _refuse_planted(root: str, url: str) -> None:
    """Refuse a store directory other users can put checkpoints in: ``root`` itself
    writable by every user (``/tmp`` as the store), an ancestor writable by every user
    without the sticky bit (anyone may replace what it holds), or ``root`` or an
    ancestor owned by another user (not root) in a world-writable sticky directory
    (made there first). Its checkpoints would be theirs to plant (a run resumes from
    them) and to read.

    Raises:
        PermissionError: naming the directory, and its owner and parent or its mode.
    """
    me = os.geteuid()
    path = os.path.abspath(root)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    if mode & stat.S_IWOTH:
        raise PermissionError(
            errno.EPERM, f"checkpoint url={url!r}: {path} is writable by every user "
            f"(mode {stat.filemode(mode)}): any of them could put checkpoints there that "
            f"a run resumes from; use a directory of its own inside it, or make it "
            f"writable by you (and your group) only", path)
    while os.path.dirname(path) != path:
        parent = os.path.dirname(path)
        try:
            parent_mode = os.stat(parent).st_mode
        except OSError:
            parent_mode = 0
        if parent_mode & stat.S_IWOTH and not parent_mode & stat.S_ISVTX:
            raise PermissionError(
                errno.EPERM, f"checkpoint url={url!r}: {parent} is writable by every user "
                f"without the sticky bit (mode {stat.filemode(parent_mode)}): any of them "
                f"could replace {path} with checkpoints of theirs; use a directory "
                f"elsewhere, or chmod o-w (or +t) it", parent)
        try:
            owner = os.lstat(path).st_uid
        except FileNotFoundError:
            path = parent
            continue
        if owner not in (me, 0) and parent_mode & stat.S_IWOTH and parent_mode & stat.S_ISVTX:
            raise PermissionError(
                errno.EPERM, f"checkpoint url={url!r}: {path} belongs to uid {owner}, not "
                f"to this user (uid {me}), and sits in the world-writable {parent}: another "
                f"user could have made it first to plant checkpoints a run resumes from, "
                f"or to read them; use a directory of your own", path)
        path = parent


class LocalBackend:
    """A store on a local (or NFS) filesystem.

    Args:
        root: the store's directory.
        url: the store's URL, for messages.
        writer_id: the owning store's random id (in temporary names).
        private: directories are created 0700 and files 0600 (the snapshot tier's
            stores in shared memory, which other users of the host must not read).
    """

    #: A step's files are written in a private directory renamed into place: a first
    #: save's files keep their plain names.
    in_place = False

    def __init__(self, root: str, *, url: str, writer_id: str, private: bool = False) -> None:
        self.root = root
        self.url = url
        self.writer_id = writer_id
        self.private = private

    # ------------------------------------------------------------------ read
    def check_root(self) -> None:
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise NotADirectoryError(errno.ENOTDIR, f"checkpoint url={self.url!r} is a "
                                     f"file, expected a directory (or nothing yet)", self.root)
        _refuse_planted(self.root, self.url)

    def _make_root(self) -> None:
        """Create the store's directory (and missing parents). One made directly in a
        world-writable sticky directory (``/tmp``) is this user's alone (0700), so no
        other user can read the checkpoints or plant steps in it; one another user
        made there first is refused (:func:`_refuse_planted`). None is made writable
        by every user, whatever the umask (0775 at most). An existing root was checked
        by :meth:`check_root`, which every save calls first."""
        mode = 0o700 if self.private else 0o775
        missing = []
        path = os.path.abspath(self.root)
        while not os.path.lexists(path) and os.path.dirname(path) != path:
            missing.append(path)
            path = os.path.dirname(path)
        if not missing:
            return
        for p in reversed(missing):
            try:
                os.mkdir(p, 0o700 if _world_writable_sticky(os.path.dirname(p)) else mode)
            except FileExistsError:
                pass  # made meanwhile: by this job's other ranks, or checked below
        _refuse_planted(self.root, self.url)

    def list_root(self) -> list[tuple[str, bool]]:
        try:
            with os.scandir(self.root) as it:
                return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            self.check_root()
            raise

    def open_regular(self, path: str, max_bytes: int | None) -> tuple[IO[bytes], int]:
        f = open_regular_local(path)
        size = os.fstat(f.fileno()).st_size
        try:
            check_size(path, size, max_bytes)
        except BaseException:
            f.close()
            raise
        return f, size

    def kept_copy(self) -> io.BytesIO | None:
        return None  # an open file stays readable even if retention deletes it

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def read_small(self, path: str, limit: int) -> bytes:
        with open_regular_local(path) as f:
            return f.read(limit)

    # ------------------------------------------------------------------ write
    def _tmp_name(self, what: str) -> str:
        return f"{TMP_PREFIX}{what}-{self.writer_id[:16]}-{uuid.uuid4().hex[:8]}"

    def _restrict(self, *paths: str) -> None:
        """Private stores: the files are this user's alone (before they are committed)."""
        if self.private:
            for p in paths:
                os.chmod(p, 0o600)

    def commit(self, directory: str, name: str, *, replacing: bool, write: PayloadWrite,
               seal: Seal) -> Manifest:
        if replacing:
            return self._switch_manifest(directory, name, write, seal)
        return self._rename_into_place(directory, name, write, seal)

    def _rename_into_place(self, directory: str, name: str, write: PayloadWrite,
                           seal: Seal) -> Manifest:
        """First save: build the step in a temporary directory, then rename it."""
        self._make_root()
        tmp_name = self._tmp_name(basename(directory))
        tmp = join(self.root, tmp_name)
        with _LIVE_LOCK:
            _LIVE_TMP.add(tmp_name)
        try:
            os.mkdir(tmp, 0o700 if self.private else 0o775)
            payload = join(tmp, name)
            with _open_payload(payload, "wb") as f:
                entry = write(f, payload, True)
            manifest = seal(name, entry)
            _write_manifest(join(tmp, MANIFEST_NAME), manifest)
            self._restrict(payload, join(tmp, MANIFEST_NAME))
            fsync_dir(tmp)
            trash = [self._move_leftover(directory)]
            try:
                os.rename(tmp, directory)
            except OSError as e:
                # another process made the step directory since the check above: the
                # conflict if it committed it, else its leftover moved away too
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                trash.append(self._move_leftover(directory))
                os.rename(tmp, directory)
            fsync_dir(self.root, committed=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            with _LIVE_LOCK:
                _LIVE_TMP.discard(tmp_name)
        for moved in trash:
            if moved is not None:
                shutil.rmtree(moved, ignore_errors=True)
        return manifest

    def _move_leftover(self, directory: str) -> str | None:
        """Move an uncommitted leftover of the step out of ``directory``'s way (its
        new path, for removal once the step is in place; None: there is none).

        Raises:
            CheckpointConflictError: the step was committed meanwhile, by another
                writer of the same store (a stale process of an earlier restart):
                its checkpoint stays, this save is dropped.
        """
        if not os.path.lexists(directory):
            return None
        if os.path.lexists(join(directory, MANIFEST_NAME)):
            raise CheckpointConflictError(
                f"{directory} was committed by another writer while this process saved "
                f"the same step: its checkpoint is kept, this save is dropped (two jobs, "
                f"or a stale process of an earlier restart, save to {self.url})")
        trash = join(self.root, self._tmp_name("old-" + basename(directory)))
        os.rename(directory, trash)
        return trash

    def _switch_manifest(self, directory: str, name: str, write: PayloadWrite,
                         seal: Seal) -> Manifest:
        """Re-save: the new payload beside the old one, then ``os.replace`` of the
        manifest (the atomic switch)."""
        payload = join(directory, name)
        tmp_manifest = join(directory, f".{MANIFEST_NAME}.{uuid.uuid4().hex[:12]}")
        try:
            with _open_payload(payload, "xb") as f:
                entry = write(f, payload, True)
            manifest = seal(name, entry)
            _write_manifest(tmp_manifest, manifest)
            self._restrict(payload, tmp_manifest)
            fsync_dir(directory)
            os.replace(tmp_manifest, join(directory, MANIFEST_NAME))
            fsync_dir(directory, committed=True)
        except BaseException:
            for p in (payload, tmp_manifest):
                try:
                    os.remove(p)
                except OSError:
                    pass
            raise
        return manifest

    # ------------------------------------------------------------------ many writers
    def begin_parts(self, directory: str, *, replacing: bool) -> str:
        """A fresh ``.tmp-step-<n>-...`` directory (kept out of the stale cleanup
        while this process commits it), or the step directory when ``replacing``."""
        if replacing:
            return directory
        self._make_root()
        tmp_name = self._tmp_name(basename(directory))
        with _LIVE_LOCK:
            _LIVE_TMP.add(tmp_name)
        tmp = join(self.root, tmp_name)
        os.mkdir(tmp, 0o700 if self.private else 0o775)
        return tmp

    def write_part(self, staging: str, name: str, fill: Fill[T], *,
                   size_hint: int | None = None) -> T:
        """``O_DIRECT`` where the filesystem takes it, then fsync; never replaces a file.
        A file smaller than one staging buffer gets buffers of its size (rounded up to
        a power of two), so a small shard costs no 16 MiB buffers. A failed write
        removes its partial file (in a re-save's committed directory nothing else
        would)."""
        path = join(staging, name)
        kw = {}
        if size_hint is not None and size_hint < BUFFER_SIZE:
            kw["buffer_size"] = max(ALIGN, 1 << max(size_hint - 1, 1).bit_length())
        f = open_direct(path, "xb", **kw) or open(path, "xb")
        try:
            with f:
                out = fill(f)
                if isinstance(f, DirectFile):
                    f.finish(fsync=True)
                else:
                    f.flush()
                    os.fsync(f.fileno())
            self._restrict(path)
        except BaseException as e:
            try:
                os.remove(path)
            except OSError:
                pass
            if isinstance(e, OSError):
                raise write_error(e, path) from e
            raise
        return out

    def finish_parts(self, staging: str, directory: str, manifest: Manifest, *,
                     replacing: bool) -> None:
        """Manifest into the staging directory, fsync, rename into place (a re-save:
        ``os.replace`` of the manifest, as for one writer)."""
        if replacing:
            tmp_manifest = join(directory, f".{MANIFEST_NAME}.{uuid.uuid4().hex[:12]}")
            try:
                _write_manifest(tmp_manifest, manifest)
                self._restrict(tmp_manifest)
                fsync_dir(directory)
                os.replace(tmp_manifest, join(directory, MANIFEST_NAME))
                fsync_dir(directory, committed=True)
            except BaseException:
                try:
                    os.remove(tmp_manifest)
                except OSError:
                    pass
                raise
            return
        _write_manifest(join(staging, MANIFEST_NAME), manifest)
        self._restrict(join(staging, MANIFEST_NAME))
        fsync_dir(staging)
        trash = self._move_leftover(directory)
        os.rename(staging, directory)
        fsync_dir(self.root, committed=True)
        with _LIVE_LOCK:
            _LIVE_TMP.discard(basename(staging))
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def abort_parts(self, staging: str, names: list[str], *, replacing: bool) -> None:
        if replacing:
            for n in names:
                try:
                    os.remove(join(staging, n))
                except OSError:
                    pass
            return
        shutil.rmtree(staging, ignore_errors=True)
        with _LIVE_LOCK:
            _LIVE_TMP.discard(basename(staging))

    def create_once(self, path: str, data: bytes) -> None:
        """Written under a temporary name and linked into place: ``link`` fails if the
        name exists, so the first creator wins."""
        self._make_root()
        tmp = join(self.root, f"{TMP_PREFIX}{basename(path)}-{uuid.uuid4().hex[:8]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if self.private else 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replaces
            fsync_dir(self.root, committed=True)
        except FileExistsError:
            pass
        finally:
            os.remove(tmp)

    # ------------------------------------------------------------------ remove
    def remove_file(self, path: str) -> None:
        os.remove(path)

    def remove_step(self, path: str) -> None:
        """Renamed away first (a crash half way leaves a ``.tmp-`` leftover, never a
        half-deleted committed step), then removed."""
        trash = join(self.root, self._tmp_name("del-" + basename(path)))
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def leftovers(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        with _LIVE_LOCK:
            return [join(self.root, n) for n in names
                    if n.startswith(TMP_PREFIX) and n not in _LIVE_TMP]

    def age(self, path: str) -> float | None:
        """The directory's own mtime or any direct entry's, whichever is newest (a
        writer keeps its payload's mtime fresh while writing)."""
        newest = os.lstat(path).st_mtime
        try:
            with os.scandir(path) as it:
                for e in it:
                    try:
                        newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
                    except FileNotFoundError:
                        pass
        except NotADirectoryError:
            pass
        return time.time() - newest

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def unfinished_uploads(self) -> list[tuple[str, str, float]]:
        return []  # a file being written is a leftover of its own (see leftovers)

    def abort_upload(self, path: str, upload: str) -> None:
        pass  # none listed
