"""The per-user snapshot tree: directories that only this user can have put there.

Shared memory (``/dev/shm``) is writable by every user of the host, so anything found
below it may have been planted: a directory pre-created by another user with a
snapshot in it, a symlink that sends this user's writes elsewhere, a directory others
can write into. Every directory on the way from the root to a snapshot is therefore
opened without following symlinks (``O_NOFOLLOW | O_DIRECTORY``, relative to its
parent's descriptor, so a rename between two checks cannot swap a path) and checked
on the open descriptor (``fstat``): owned by this user, not writable by group or
others. A missing directory is created 0700. The root itself is the exception: it
may be world-writable when it is sticky (``/dev/shm`` is root-owned 1777), since the
sticky bit stops others from renaming or removing this user's entries.

A tree that fails the check is not used: the caller switches snapshots off with a
warning naming the path and the reason (a fresh directory under another name would
not be found again by the restarted workers, which is the point of the tier).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Sequence

__all__ = ["UnsafeTreeError", "check_root", "private_dir", "is_private_entry", "user_dir_name"]


class UnsafeTreeError(PermissionError):
    """A directory of the snapshot tree that this user cannot trust (the message names
    the path and why)."""


def user_dir_name() -> str:
    """The per-user directory below the root: ``elastic_kit-<uid>``."""
    return f"elastic_kit-{os.geteuid()}"


def check_root(root: str) -> None:
    """The root (``/dev/shm`` or ``$ELASTIC_KIT_SNAPSHOT_DIR``) may hold a private tree:
    a directory owned by root or this user, writable by others only when sticky.

    Raises:
        FileNotFoundError / NotADirectoryError: it does not exist / is not a directory.
        UnsafeTreeError: another user could move this user's entries in it.
    """
    st = os.stat(root)  # the root is configuration: a symlink to it is fine
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{root} is not a directory", root)
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeTreeError(f"{root} is owned by uid {st.st_uid}, expected root or this "
                              f"user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeTreeError(f"{root} is writable by others ({stat.filemode(st.st_mode)}) "
                              f"without the sticky bit")


def _check_fd(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeTreeError(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeTreeError(f"{path} is owned by uid {st.st_uid}, not by this user "
                              f"(uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeTreeError(f"{path} is writable by group or others "
                              f"({stat.filemode(st.st_mode)}), expected drwx------")
    if st.st_mode & 0o077:
        os.fchmod(fd, 0o700)  # this user's own directory, readable by others: close it


_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def private_dir(base: str, parts: Sequence[str], *, create: bool = True,
                check_base: bool = False) -> str:
    """``base/parts[0]/.../parts[-1]``, each part opened without following symlinks,
    created 0700 when missing (``create``), and checked to be this user's alone.

    ``base`` is trusted as it is (the root, checked by :func:`check_root`) unless
    ``check_base``. Returns the path.

    Raises:
        UnsafeTreeError: a part is a symlink, not a directory, another user's, or
            writable by group or others.
        FileNotFoundError: a part is missing and ``create`` is False.
    """
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    path = base
    try:
        if check_base:
            _check_fd(fd, base)
        for part in parts:
            if not part or part in (".", "..") or "/" in part:
                raise ValueError(f"snapshot path part {part!r} must be one plain name")
            path = os.path.join(path, part)
            if create:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, _FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeTreeError(f"{path} is a symbolic link or not a directory, "
                                          f"expected a directory of this user's") from e
                raise
            os.close(fd)
            fd = child
            _check_fd(fd, path)
    finally:
        os.close(fd)
    return path


def is_private_entry(path: str) -> bool:
    """Whether ``path`` is a real directory (not a symlink) of this user's that group
    and others cannot write: for entries found inside the tree (replicas, steps)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
