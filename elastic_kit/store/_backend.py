"""The operations a storage backend performs below the layout rules.

:class:`~elastic_kit.store._layout.Layout` holds the rules of a store (names, scan
order, verification, commit order, retention, stale cleanup) once. What differs
between a local disk (a temporary directory, ``O_DIRECT``, fsync, rename) and an
object store (the payload PUT, then the manifest PUT) is behind :class:`Backend`: a
few operations, each with one implementation per backend and no rule of its own
beyond how that storage makes a write durable and atomic. A new kind of storage is a
new class here, not a branch in the rules.
"""

from __future__ import annotations

import io
from typing import IO, Any, Callable, Protocol, TypeVar

from elastic_kit.errors import CheckpointCorruptError
from elastic_kit.store._manifest import FileEntry, Manifest

__all__ = ["Backend", "Reader", "PayloadWrite", "Seal", "Fill", "check_size", "basename"]

T = TypeVar("T")

#: Runs a read with the store's retry policy (what to retry, backoff, budget):
#: ``read(fn, what)``. Backends get it from the layout so that retries are decided
#: in one place and separately from verdicts.
Reader = Callable[[Callable[[], Any], str], Any]

#: Serializes the state into an open payload file: ``write(f, path, fsync)``.
PayloadWrite = Callable[[IO[bytes], str, bool], FileEntry]

#: The manifest that commits a payload: ``seal(name, entry)``.
Seal = Callable[[str, FileEntry], Manifest]

#: Fills one file of a many-writer checkpoint: ``fill(f)`` writes into the open file
#: and returns whatever the writer needs afterwards (its index, size and checksum).
Fill = Callable[[IO[bytes]], T]


def basename(path: str) -> str:
    """The last component of a ``/``-separated path."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def check_size(path: str, size: int, max_bytes: int | None) -> None:
    """Refuse a file larger than a reader will take (a hostile manifest's size)."""
    if max_bytes is not None and size > max_bytes:
        raise CheckpointCorruptError(f"{path} is {size} bytes, more than the "
                                     f"{max_bytes} a manifest may have")


class Backend(Protocol):
    """A store's storage, as the layout rules use it.

    Reading: :meth:`check_root`, :meth:`list_root`, :meth:`open_regular`,
    :meth:`kept_copy`, :meth:`is_dir`, :meth:`read_small`. Writing: :meth:`commit`
    (the one commit procedure, for first saves and re-saves alike),
    :meth:`create_once`. Removing: :meth:`remove_file`, :meth:`remove_step`,
    :meth:`leftovers`, :meth:`age`, :meth:`remove_tree`.
    """

    def check_root(self) -> None:
        """Raise when the root cannot hold a store.

        Raises:
            NotADirectoryError: the root is a file.
            FileNotFoundError: the root's bucket does not exist.
            CheckpointError: the store cannot be reached (after retries).
        """

    def list_root(self) -> list[tuple[str, bool]]:
        """(name, is a directory) of every entry at the root; empty when it is absent."""

    def open_regular(self, path: str, max_bytes: int | None) -> tuple[IO[bytes], int]:
        """A regular file opened for reading and its size.

        Raises:
            CheckpointCorruptError: not a regular file, or larger than ``max_bytes``.
            FileNotFoundError: it does not exist.
        """

    def kept_copy(self) -> io.BytesIO | None:
        """Where a payload kept for the caller is copied while it is verified: None
        when the open file itself stays readable (a local file survives a concurrent
        delete), else a buffer (a remote stream does not)."""

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is (still) a directory."""

    def read_small(self, path: str, limit: int) -> bytes:
        """At most ``limit`` bytes of a small regular file (FileNotFoundError if absent)."""

    def commit(self, directory: str, name: str, *, replacing: bool, write: PayloadWrite,
               seal: Seal) -> Manifest:
        """Write the payload ``name`` into ``directory``, then its manifest, last.

        ``replacing``: ``directory`` holds a committed manifest, which must stay in
        place (old or new, never absent) until it is switched to the new one in one
        atomic operation. Otherwise nothing in ``directory`` is committed. Returns the
        manifest that was committed; the replaced payload is left for the caller.
        """

    def begin_parts(self, directory: str, *, replacing: bool) -> str:
        """Where the files of a many-writer (sharded) checkpoint of ``directory`` are
        written: a fresh temporary directory on a local disk, the step directory
        itself on an object store or when ``replacing`` (new files get fresh names).
        Called by the one rank that commits; the others learn the path from it."""

    def write_part(self, staging: str, name: str, fill: Fill[T], *,
                   size_hint: int | None = None) -> T:
        """Create file ``name`` in ``staging`` (any rank), let ``fill`` write it, and
        make it durable (fsync, or the completed upload) before returning.
        ``size_hint``: about how many bytes ``fill`` writes (a small file then gets
        small staging buffers)."""

    def finish_parts(self, staging: str, directory: str, manifest: Manifest, *,
                     replacing: bool) -> None:
        """Commit what :meth:`begin_parts` staged: the manifest last (after every
        part is durable), atomically (rename, ``os.replace``, one PUT)."""

    def abort_parts(self, staging: str, names: list[str], *, replacing: bool) -> None:
        """Remove a failed many-writer save's files (best effort; never a committed
        file: ``names`` are only this save's fresh ones)."""

    def create_once(self, path: str, data: bytes) -> None:
        """Create a small file unless it exists (the first creator wins where the
        storage can tell)."""

    def remove_file(self, path: str) -> None:
        """Remove one file."""

    def remove_step(self, path: str) -> None:
        """Remove a step directory so that a crash half way never leaves it committed."""

    def leftovers(self) -> list[str]:
        """Temporary entries at the root that no store of this process is writing."""

    def age(self, path: str) -> float | None:
        """Seconds since anything in ``path`` changed (None: unknown).

        Raises:
            FileNotFoundError: ``path`` is gone.
        """

    def remove_tree(self, path: str) -> None:
        """Remove a leftover, ignoring errors."""

    def unfinished_uploads(self) -> list[tuple[str, str, float]]:
        """``(path, upload id, seconds since it last changed)`` of each multipart upload
        under the store's steps that was started and never completed nor aborted (its
        writer killed): invisible to a listing, its parts kept (and billed) for good."""

    def abort_upload(self, path: str, upload: str) -> None:
        """Abort one of :meth:`unfinished_uploads`, ignoring errors."""
