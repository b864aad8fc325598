"""Resolving checkpoint URLs to fsspec filesystems, retries, and write helpers.

Every storage access in the store package goes through an fsspec filesystem
obtained here, so a plain path, ``file://``, ``memory://``, ``s3://``, ``gs://`` and
``az://`` behave alike. What differs is how a checkpoint is *committed*: a local (or
NFS-mounted) filesystem renames a directory atomically, an object store has no
rename and the manifest, written last, is the commit. :func:`is_local` tells the two
apart; the calls particular to each are in ``_backend_local`` and ``_backend_object``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from typing import Any, Callable, NoReturn, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic_kit._checks import type_error
from elastic_kit.errors import CheckpointError, ElasticKitError

__all__ = [
    "EXTRAS",
    "named_write_error",
    "raise_named",
    "write_error",
    "resolve_url",
    "s3_timeout_options",
    "retrying",
    "is_local",
    "start_writeback",
    "join",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Which ``pip install elastic_kit[...]`` extra provides which protocol's filesystem.
EXTRAS: dict[str, str] = {
    "s3": "s3", "s3a": "s3",
    "gs": "gcs", "gcs": "gcs",
    "az": "azure", "abfs": "azure", "abfss": "azure", "adl": "azure",
}


#: The storage options fsspec's local filesystem uses (its own and its listing cache's);
#: it accepts any other keyword and ignores it, so a typo or an S3 credential given
#: for a local path would pass in silence.
_LOCAL_OPTIONS = frozenset({"auto_mkdir", "skip_instance_cache", "use_listings_cache",
                            "listings_expiry_time", "max_paths"})


def resolve_url(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
                *, io_timeout: float | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the root path inside it for a checkpoint URL.

    Args:
        url: a plain path (``str`` or :class:`os.PathLike`) or any fsspec URL
            (``file://``, ``memory://``, ``s3://``...).
        storage_options: passed to :func:`fsspec.core.url_to_fs` (credentials,
            endpoint, ...).
        io_timeout: seconds one request to a remote store may take (connect and
            read); applied to ``s3://`` unless ``storage_options`` sets its own
            timeouts. botocore's defaults (60 s each, several retries, inside
            s3fs's own retries) let one call to an unresponsive endpoint block for
            minutes, far past the collective timeout of the job.

    Raises:
        TypeError: the URL is not a str (or ``os.PathLike``).
        ValueError: the URL is empty or its protocol is unknown to fsspec.
        ImportError: the protocol needs a filesystem package that is not installed;
            the message names the ``elastic_kit[...]`` extra that installs it.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str):
        raise type_error("url", url, "a path (str or os.PathLike) or fsspec URL")
    if not url.strip():
        raise ValueError(f"checkpoint url={url!r} must be a non-empty path or fsspec URL")
    given = url  # as the caller wrote it, for messages
    scheme, _, rest = url.partition("://")
    if rest and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.:-]*", scheme):
        # schemes are case-insensitive (RFC 3986), fsspec's are lower case: "FILE:///x"
        # was the relative directory "FILE:/x" (chains too: "simplecache::S3://")
        url = f"{scheme.lower()}://{rest}"
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    options = dict(storage_options or {})
    if io_timeout is not None and protocol in ("s3", "s3a"):
        options = s3_timeout_options(options, io_timeout)
    try:
        if protocol == "file":
            unknown = sorted(set(options) - _LOCAL_OPTIONS)
            if unknown:  # fsspec's local filesystem would take them and ignore them
                raise TypeError(f"unknown option(s) {unknown}; the local filesystem "
                                f"takes {sorted(_LOCAL_OPTIONS)} (credentials and "
                                f"endpoints are options of remote stores)")
            # a local path as written: fsspec's URL chaining would read "a::b" as the
            # chain of "a" and "b", and store the checkpoints of run "exp::lr=0.1" in
            # "exp", beside every other run named "exp::..."
            fs = fsspec.filesystem("file", **options)
            root = fs._strip_protocol(url)
        else:
            fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        extra = EXTRAS.get(protocol)
        hint = (f"pip install 'elastic_kit[{extra}]'" if extra
                else f"install the fsspec implementation of {protocol!r}")
        raise ImportError(
            f"checkpoint url={given!r} needs the {protocol!r} filesystem, which is not "
            f"installed: {hint} ({e})"
        ) from e
    except ValueError as e:
        if "Protocol not known" in str(e):
            raise ValueError(
                f"checkpoint url={given!r}: unknown protocol {protocol!r}; expected a local "
                f"path or one of file://, memory://, s3://, gs://, az://, abfs:// "
                f"(or another fsspec protocol)"
            ) from e
        raise ValueError(f"checkpoint url={given!r}: {e}") from e
    except TypeError as e:  # an option the filesystem does not take
        raise TypeError(f"checkpoint url={given!r}: storage_options={storage_options!r} are "
                        f"not accepted by the {protocol!r} filesystem: {e}") from e
    if io_timeout is not None and protocol in ("s3", "s3a") and getattr(fs, "retries", 0) > 2:
        fs.retries = 2  # s3fs retries every timed-out request itself (5 times by default)
    return fs, root.rstrip("/") or root


def s3_timeout_options(options: dict[str, Any], io_timeout: float) -> dict[str, Any]:
    """``options`` with botocore timeouts of ``io_timeout`` s and few retries.

    What the caller already set wins. One request is then bounded by about
    ``io_timeout`` and a whole call by about twice that (botocore makes one attempt
    per request; s3fs's own retry count is lowered to 2 in :func:`resolve_url`).
    """
    out = dict(options)
    config = dict(out.get("config_kwargs") or {})
    config.setdefault("connect_timeout", io_timeout)
    config.setdefault("read_timeout", io_timeout)
    config.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    out["config_kwargs"] = config
    return out


def retrying(fn: Callable[[], T], *, what: str, attempts: int, backoff_s: float,
             give_up: tuple[type[BaseException], ...] = (),
             budget_s: float | None = None) -> T:
    """``fn()``, retried with exponential backoff on any error outside ``give_up``.

    Reads from remote stores fail transiently (403 from an expiring token, 500/503,
    a dropped connection). Such a failure proves nothing about the checkpoint, so it
    must never be mistaken for corruption: it is retried ``attempts`` times in all
    and then raised as :class:`CheckpointError` naming ``what`` and the last error.
    No new attempt starts once ``budget_s`` seconds have passed: an endpoint that
    does not answer at all (each attempt a timeout) fails in bounded time, while
    quick errors are still retried.
    """
    delay = backoff_s
    t0 = time.monotonic()
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except give_up:
            raise
        except (TypeError, ValueError, AttributeError, ImportError):
            raise  # a bad option or a bug: retrying cannot help
        except Exception as e:  # anything else is an I/O failure, not a verdict
            spent = time.monotonic() - t0
            if attempt == attempts or (budget_s is not None and spent + delay > budget_s):
                raise CheckpointError(
                    f"cannot read {what} after {attempt} attempt(s) in {spent:.0f} s: "
                    f"{type(e).__name__}: {e}") from e
            log.warning("reading %s failed (attempt %d of %d, retrying in %.1f s): %r",
                        what, attempt, attempts, delay, e)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
    raise AssertionError("unreachable")  # pragma: no cover


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True for the local filesystem (which includes NFS mounts): rename is atomic."""
    return isinstance(fs, LocalFileSystem)


def join(root: str, *parts: str) -> str:
    """Join path components with ``/`` (fsspec paths use ``/`` on every platform)."""
    return "/".join([root.rstrip("/"), *parts])




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




def named_write_error(e: BaseException, path: str) -> BaseException:
    """The failure ``e`` of a write of ``path`` as an error that names the file: an
    OSError keeps its type and errno (see :func:`write_error`); another library's own
    error (an object store client's HTTP error) becomes a :class:`CheckpointError`
    caused by it. ``e`` itself when it names the file already, is this library's, or
    is a builtin error other than OSError or torch's (a bug, a bad value, out of
    memory: kept as it is)."""
    if path in str(e) or isinstance(e, ElasticKitError):
        return e
    if isinstance(e, OSError):
        return write_error(e, path)
    if type(e).__module__.split(".")[0] in ("builtins", "torch"):
        return e  # a bug, a bad value, torch's own (out of memory): as it is
    return CheckpointError(f"cannot write checkpoint file {path}: {type(e).__name__}: {e}")


def raise_named(e: BaseException, path: str) -> NoReturn:
    """Raise :func:`named_write_error` of ``e`` (from ``e`` when it is another)."""
    named = named_write_error(e, path)
    if named is e:
        raise e
    raise named from e


def write_error(e: OSError, path: str) -> OSError:
    """An OSError that names the file and says plainly what happened."""
    what = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EFBIG: "file too large"}.get(e.errno or 0, e.strerror or str(e))
    if e.errno:
        return type(e)(e.errno, f"cannot write checkpoint file {path}: {what}")
    try:  # no errno (a client's TimeoutError): its type, when it is made like OSError
        return type(e)(f"cannot write checkpoint file {path}: {e}")
    except Exception:
        return OSError(f"cannot write checkpoint file {path}: {e}")

