"""Resolving checkpoint URLs to fsspec filesystems, and the local-disk durability calls.

Every storage access in the checkpoint package goes through an fsspec filesystem
obtained here, so a plain path, ``file://``, ``memory://``, ``s3://``, ``gs://`` and
``az://`` behave alike. What differs is how a checkpoint is *committed*:

- on a local (or NFS-mounted) filesystem a directory can be renamed atomically, so
  a checkpoint is written under a temporary name, fsync'ed and renamed;
- object stores have no directories and no rename, so the manifest, written last,
  is the commit.

:func:`is_local` tells the two apart.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "EXTRAS",
    "resolve_url",
    "is_local",
    "fsync_file",
    "fsync_dir",
    "start_writeback",
    "step_dir_name",
    "parse_step_dir",
    "TMP_PREFIX",
    "join",
]

log = logging.getLogger(__name__)

#: Which ``pip install elastic_kit[...]`` extra provides which protocol's filesystem.
EXTRAS: dict[str, str] = {
    "s3": "s3", "s3a": "s3",
    "gs": "gcs", "gcs": "gcs",
    "az": "azure", "abfs": "azure", "abfss": "azure", "adl": "azure",
}

#: Prefix of directories that hold a save in progress (local filesystems only).
#: They start with a dot so that globbing ``step-*`` never sees them.
TMP_PREFIX = ".tmp-"

_STEP_DIGITS = 12
_STEP_RE = re.compile(r"^step-(\d+)$")


def resolve_url(url: str, storage_options: dict[str, Any] | None = None
                ) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the root path inside it for a checkpoint URL.

    Args:
        url: a plain path or any fsspec URL (``file://``, ``memory://``, ``s3://``...).
        storage_options: passed to :func:`fsspec.core.url_to_fs` (credentials,
            endpoint, ...).

    Raises:
        ValueError: the URL is empty or its protocol is unknown to fsspec.
        ImportError: the protocol needs a filesystem package that is not installed;
            the message names the ``elastic_kit[...]`` extra that installs it.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"checkpoint url={url!r} must be a non-empty path or fsspec URL")
    protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        extra = EXTRAS.get(protocol)
        hint = (f"pip install 'elastic_kit[{extra}]'" if extra
                else f"install the fsspec implementation of {protocol!r}")
        raise ImportError(
            f"checkpoint url={url!r} needs the {protocol!r} filesystem, which is not "
            f"installed: {hint} ({e})"
        ) from e
    except ValueError as e:
        if "Protocol not known" in str(e):
            raise ValueError(
                f"checkpoint url={url!r}: unknown protocol {protocol!r}; expected a local "
                f"path or one of file://, memory://, s3://, gs://, az://, abfs:// "
                f"(or another fsspec protocol)"
            ) from e
        raise
    return fs, root.rstrip("/") or root


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local filesystem (which includes NFS mounts): rename is atomic."""
    return isinstance(fs, LocalFileSystem)


def join(root: str, *parts: str) -> str:
    """Join path components with ``/`` (fsspec paths use ``/`` on every platform)."""
    return "/".join([root.rstrip("/"), *parts])


def fsync_file(path: str) -> None:
    """Flush a local file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a local directory's entries (new names, renames) to disk.

    A rename is durable only once the directory holding the name is fsync'ed; some
    filesystems refuse fsync on a directory, which is then logged and ignored.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:  # pragma: no cover - platform dependent
        log.debug("cannot open directory %s to fsync it: %s", path, e)
        return
    try:
        os.fsync(fd)
    except OSError as e:  # pragma: no cover - platform dependent
        log.debug("fsync of directory %s failed: %s", path, e)
    finally:
        os.close(fd)


def step_dir_name(step: int) -> str:
    """``step-000000000012``: zero padded so that names sort like steps."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    return f"step-{step:0{_STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-<n>`` directory name (any path prefix), else None."""
    m = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait
_sync_file_range: Any = None  # resolved on first use; False when unavailable


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk.

    Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` (through libc; Python has no
    binding) queues the pages for writeback and returns: the disk then works while
    the rest of the file is still being written, and the final ``fsync`` only waits
    for the tail. A plain write+fsync leaves the disk idle until the fsync (here a
    500 MB save went from 0.60 s to 0.42 s). It is a hint, not a durability call:
    the fsync is still what makes the data durable. Returns False where it is not
    available (other systems), which costs nothing but the speed-up.
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError):  # not Linux/glibc
            log.debug("sync_file_range is not available: saves fsync at the end only")
    if _sync_file_range is False:
        return False
    return _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0
