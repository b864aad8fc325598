"""Writing a local payload with ``O_DIRECT``, at what the disk itself sustains.

Why. A buffered write copies every byte into the page cache and leaves the disk idle
until the kernel's writeback (or our ``sync_file_range`` hints, or the final fsync)
gets to it; the dirty pages then compete with the training process for memory, and
the final fsync waits for whatever writeback has not caught up. Measured on a
512 MB save, that path reached 0.78x of ``dd bs=8M oflag=direct conv=fsync`` on the
same bytes. ``O_DIRECT`` sends the bytes from our memory straight to the device: no
page-cache copy, no dirty pages, no writeback to wait for, so the fsync at the end
only commits metadata and flushes the device cache.

How. ``O_DIRECT`` I/O must be aligned (memory address, length and file offset, to
the logical block size; the page size is a safe multiple). ``torch.save`` writes
arbitrary pieces at arbitrary offsets, so :class:`DirectFile` copies them into
page-aligned staging buffers (anonymous ``mmap``, which is page aligned) and writes
each buffer whole, at an aligned offset. There are two buffers: while one writer
thread ``pwrite``s a full buffer (which releases the GIL and keeps the disk busy)
the caller fills the other, so the memory copy overlaps with the disk instead of
adding to it (double buffering). The copy itself runs in numpy, without the GIL, so
the writer thread never waits for it to issue the next write. At
:meth:`DirectFile.finish` the aligned prefix of the last buffer goes out the same
way and its unaligned tail (under one page) through the page cache (``O_DIRECT``
cleared on the descriptor), then one fsync. The buffers are kept for the next file:
fresh memory would cost a page fault per 4 KiB on every save.

Fallbacks (correctness first): :func:`open_direct` returns None where the platform
has no ``O_DIRECT`` or the filesystem refuses it (the caller then writes buffered),
and on a memory filesystem (tmpfs, ramfs: the in-memory snapshots in ``/dev/shm``),
which accepts the flag but has no device behind its pages, so the staging copy would
only be a second copy of every byte;
a filesystem that accepts the flag but refuses the first aligned write (EINVAL) is
written through the page cache instead, transparently.
"""

from __future__ import annotations

import errno
import functools
import io
import logging
import mmap
import os
import queue
import threading
from typing import Any

import numpy as np

try:
    import ctypes
except ImportError:  # pragma: no cover - no ctypes in this build
    ctypes = None  # type: ignore[assignment]

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["DirectFile", "open_direct", "memory_filesystem", "BUFFER_SIZE", "ALIGN"]

log = logging.getLogger(__name__)

#: Alignment of every ``O_DIRECT`` write (address, length, offset): the page size,
#: a multiple of the logical block size of common devices (512 B or 4 KiB).
ALIGN = max(mmap.PAGESIZE, 4096)
#: Staging buffers per file: the caller fills one while the writer thread writes
#: another; a third absorbs the moments the writer waits for the GIL between requests.
BUFFERS = 3
#: Size of each staging buffer, so of each write request. Measured on the 2-core
#: machine's disk (512 MB saves, 9 shuffled rounds, three runs): 3 x 16 MiB reached
#: 0.94-1.00x an 8 MiB O_DIRECT ``dd``, 2 x 8 MiB 0.83-0.90x (the benchmark's
#: ceiling is the faster of 8 and 16 MiB requests).
BUFFER_SIZE = 16 << 20
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_NUMPY_MIN = 1 << 16  # smaller copies: a memoryview slice is cheaper than numpy's setup
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP))

# The write call, looked up at each use (tests replace it to inject errors).
_pwrite = os.pwrite


class _Buffer:
    """A page-aligned staging buffer: the mapping, a memoryview and a numpy view of it."""

    __slots__ = ("map", "view", "array")

    def __init__(self, size: int) -> None:
        # private anonymous memory, faulted in by one call where the flag exists
        flags = (getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
                 | getattr(mmap, "MAP_POPULATE", 0))
        self.map = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
        self.view = memoryview(self.map)
        self.array = np.frombuffer(self.view, dtype=np.uint8)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        try:
            self.view.release()
            self.map.close()
        except BufferError:  # pragma: no cover - a view still alive: the GC frees it
            pass


# Staging buffers of finished files, kept for the next one: fresh memory costs a page
# fault per 4 KiB on first touch (measured here: 30 ms per 16 MiB, a tenth of a 500 MB
# save at disk speed); reused buffers cost nothing. At most _POOL_MAX per size.
_POOL: dict[int, list[_Buffer]] = {}
_POOL_LOCK = threading.Lock()
_POOL_MAX = 2 * BUFFERS


def _take_buffer(size: int) -> _Buffer:
    with _POOL_LOCK:
        free = _POOL.get(size)
        if free:
            return free.pop()
    return _Buffer(size)


def _give_buffer(b: _Buffer) -> None:
    size = len(b.map)
    with _POOL_LOCK:
        free = _POOL.setdefault(size, [])
        if len(free) < _POOL_MAX and size <= 4 * BUFFER_SIZE:
            free.append(b)
            return
    b.close()


class DirectIORefused(OSError):
    """The filesystem (or platform) does not accept ``O_DIRECT`` for this file."""


class DirectFile(io.RawIOBase):
    """A write-only file that writes ``path`` with ``O_DIRECT`` through two
    page-aligned buffers and one background writer thread.

    The bytes land in the file exactly as a buffered ``open(path, mode).write(...)``
    would put them (same content, exact size); they are durable only after
    :meth:`finish` (which fsyncs). A write error of the writer thread (ENOSPC, EIO,
    EFBIG...) is raised as that ``OSError`` by the next :meth:`write` or by
    :meth:`finish`. :meth:`flush` does nothing: a partial buffer cannot be written
    with ``O_DIRECT``; :meth:`close` without :meth:`finish` still writes everything
    (without fsync), like closing a buffered file.

    Args:
        path: the file to write.
        mode: ``"wb"`` (create or truncate) or ``"xb"`` (create, fail if it exists).
        buffer_size: bytes per staging buffer, a multiple of :data:`ALIGN`.
        buffers: how many staging buffers (2: one being filled, one being written).

    Raises:
        DirectIORefused: ``O_DIRECT`` is not available for this file (nothing is
            left behind by an ``"xb"`` open; ``"wb"`` leaves the truncated file).
        OSError: the file cannot be opened (as ``open`` would raise it).
    """

    def __init__(self, path: str | os.PathLike[str], mode: str = "wb", *,
                 buffer_size: int = BUFFER_SIZE, buffers: int = BUFFERS) -> None:
        super().__init__()
        if mode not in ("wb", "xb"):
            raise ValueError(f"mode={mode!r}: DirectFile only writes ('wb' or 'xb')")
        if buffer_size <= 0 or buffer_size % ALIGN:
            raise ValueError(f"buffer_size={buffer_size} must be a positive multiple of {ALIGN}")
        if buffers < 2:
            raise ValueError(f"buffers={buffers}: double buffering needs at least 2")
        self.name = os.fspath(path)
        self.mode = mode
        self._fd = -1
        self._bufs: list[_Buffer] = []
        self._views: list[memoryview] = []
        self._arrays: list[np.ndarray] = []
        self._thread: threading.Thread | None = None
        self._todo: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        if not _O_DIRECT or fcntl is None:
            raise DirectIORefused(errno.EOPNOTSUPP, "O_DIRECT is not available here", self.name)
        flags = (os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
                 | (os.O_EXCL if mode == "xb" else os.O_TRUNC))
        # Created without O_DIRECT (same semantics and errors as open()), then switched:
        # a refusal is then known with the file ours, so "xb" can remove it again.
        fd = os.open(self.name, flags, 0o666)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
        except OSError as e:
            os.close(fd)
            if mode == "xb":
                try:
                    os.unlink(self.name)
                except OSError:  # pragma: no cover - removed meanwhile
                    pass
            if e.errno in _REFUSED:
                raise DirectIORefused(e.errno, f"O_DIRECT refused: {e.strerror}",
                                      self.name) from e
            raise
        self._fd = fd
        self._size = buffer_size
        try:
            for _ in range(buffers):
                self._bufs.append(_take_buffer(buffer_size))
            self._views = [b.view for b in self._bufs]
            self._arrays = [b.array for b in self._bufs]
        except BaseException:
            self._release()
            raise
        self._direct = True          # the descriptor has O_DIRECT set now
        self._direct_worked = False  # an O_DIRECT write has succeeded on this file
        self._cur = 0            # the buffer the caller fills
        self._pos = 0            # bytes in it
        self._offset = 0         # file offset of its first byte
        self.size = 0            # bytes accepted by write()
        for i in range(1, buffers):
            self._free.put(i)
        self._error: BaseException | None = None
        self._busy = False       # inside write(): an interrupted write leaves a mess
        self._finished = False

    # ------------------------------------------------------------- io interface
    @property
    def direct_io(self) -> bool:
        """Whether bytes went to the device with ``O_DIRECT`` (False until the first
        write and after a fallback to the page cache)."""
        return self._direct_worked

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        self._check_closed()
        return self._fd

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        """Nothing to do (see the class docstring); kept for the file interface."""
        self._check_closed()

    def write(self, b: Any) -> int:  # type: ignore[override]
        """Copy ``b`` into the staging buffers; full ones go to the writer thread.

        Raises the writer thread's OSError, if it had one.
        """
        self._check_closed()
        if self._error is not None:
            raise self._error
        if self._finished:
            raise ValueError(f"write to {self.name} after finish()")
        mv = memoryview(b)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = mv.nbytes
        # numpy copies without holding the GIL: the writer thread's next pwrite (and
        # the checksum thread) need not wait for a large copy to end
        src = np.frombuffer(mv, dtype=np.uint8) if n >= _NUMPY_MIN else None
        self._busy = True
        i = 0
        while i < n:
            k = min(n - i, self._size - self._pos)
            if src is not None and k >= _NUMPY_MIN:
                self._arrays[self._cur][self._pos:self._pos + k] = src[i:i + k]
            else:
                self._views[self._cur][self._pos:self._pos + k] = mv[i:i + k]
            self._pos += k
            i += k
            if self._pos == self._size:
                self._hand_off()
        self._busy = False
        self.size += n
        return n

    def finish(self, *, fsync: bool = True) -> int:
        """Write what is left, wait for the writer thread, fsync; returns the size.

        Raises the first write error (the writer thread's or the final writes').
        """
        self._check_closed()
        if self._finished:
            return self.size
        if self._error is not None:
            raise self._error
        self._stop_writer()
        if self._error is not None:
            raise self._error
        try:
            view = self._views[self._cur]
            aligned = self._pos - self._pos % ALIGN
            if aligned:
                self._write_at(view[:aligned], self._offset)
            if self._pos > aligned:  # under one page: through the page cache
                self._set_direct(False)
                self._write_at(view[aligned:self._pos], self._offset + aligned)
            if fsync:
                os.fsync(self._fd)
        except BaseException as e:
            self._error = e
            raise
        self._finished = True
        return self.size

    def close(self) -> None:
        """Write anything not yet written (no fsync) unless a write failed; release."""
        if self.closed:
            return
        try:
            if not self._finished and self._error is None and not self._busy:
                self.finish(fsync=False)
        finally:
            self._release()
            super().close()

    # ------------------------------------------------------------- internals
    def _check_closed(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")

    def _hand_off(self) -> None:
        """Queue the full buffer for the writer thread; take the other one (waiting
        while the writer still writes it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="ek-direct-write",
                                            daemon=True)
            self._thread.start()
        self._todo.put((self._cur, self._offset))
        self._offset += self._size
        self._cur = self._free.get()
        self._pos = 0
        if self._error is not None:
            raise self._error

    def _write_loop(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            idx, offset = item
            try:
                if self._error is None:  # after an error, only hand buffers back
                    self._write_at(self._views[idx], offset)
            except BaseException as e:
                self._error = e
            finally:
                self._free.put(idx)

    def _stop_writer(self) -> None:
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None

    def _set_direct(self, on: bool) -> None:
        if self._direct == on:
            return
        assert fcntl is not None
        fl = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, (fl | _O_DIRECT) if on else (fl & ~_O_DIRECT))
        self._direct = on

    def _write_at(self, mv: memoryview, offset: int) -> None:
        """``pwrite`` all of ``mv`` at ``offset`` (one thread at a time)."""
        done, n = 0, mv.nbytes
        while done < n:
            if self._direct and (offset + done) % ALIGN:
                self._set_direct(False)  # a short write left the rest unaligned
            try:
                w = _pwrite(self._fd, mv[done:], offset + done)
            except OSError as e:
                if e.errno in _REFUSED and self._direct and not self._direct_worked:
                    # accepted at open, refused at the first write (some FUSE, overlay)
                    log.debug("O_DIRECT write refused on %s (%s): writing it buffered",
                              self.name, e)
                    self._set_direct(False)
                    continue
                raise
            if w <= 0:  # pragma: no cover - pwrite of a non-empty buffer returns >0 or fails
                raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset + done}",
                              self.name)
            if self._direct:
                self._direct_worked = True
            done += w

    def _release(self) -> None:
        """Stop the writer thread, close the descriptor, unmap the buffers."""
        try:
            self._stop_writer()
        finally:
            if self._fd >= 0:
                fd, self._fd = self._fd, -1
                os.close(fd)
            self._views, self._arrays = [], []
            bufs, self._bufs = self._bufs, []
            for b in bufs:
                _give_buffer(b)

    def __del__(self) -> None:
        # io.IOBase.__del__ would call close(), which writes the rest: only release here.
        if not getattr(self, "closed", True):
            try:
                self._release()
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


# statfs(2) f_type of the filesystems whose pages are the storage itself.
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def memory_filesystem(directory: str | os.PathLike[str]) -> str | None:
    """``"tmpfs"`` or ``"ramfs"`` when ``directory`` is on one, else None (also where
    ``statfs`` is not available). One ``statfs`` call."""
    statfs = _libc_statfs()
    if statfs is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on x86-64
    if statfs(os.fsencode(os.path.abspath(os.fspath(directory))), buf) != 0:
        return None
    # f_type is the first member, a native long on Linux
    return _MEMORY_FS.get(ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF)


@functools.lru_cache(maxsize=None)
def _libc_statfs() -> Any:
    """libc's ``statfs``, from the symbols this process has loaded already.

    Not through ``ctypes.util.find_library``, which runs ``ldconfig`` in a subprocess:
    called first from a save's background thread while the training thread forks a
    DataLoader worker, the worker inherited the pipe on which ``subprocess`` waits for
    the child's ``exec``, and the save hung for as long as that worker lived."""
    if ctypes is None or not hasattr(os, "O_DIRECT"):  # Linux only (where O_DIRECT is)
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.statfs
    except (OSError, AttributeError):  # pragma: no cover - no libc statfs
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def open_direct(path: str | os.PathLike[str], mode: str = "wb", *,
                buffer_size: int = BUFFER_SIZE, buffers: int = BUFFERS) -> DirectFile | None:
    """A :class:`DirectFile` on ``path``, or None where ``O_DIRECT`` is refused (no
    such flag on this platform, or a filesystem that does not support it at open)
    or pointless (a memory filesystem: :func:`memory_filesystem`); the caller then
    writes through an ordinary buffered file. Other open errors (exists, permission)
    are raised as ``open(path, mode)`` would raise them.
    """
    kind = memory_filesystem(os.path.dirname(os.path.abspath(path)))
    if kind is not None:
        log.debug("not using O_DIRECT for %s: on %s", os.fspath(path), kind)
        return None
    try:
        return DirectFile(path, mode, buffer_size=buffer_size, buffers=buffers)
    except DirectIORefused as e:
        log.debug("not using O_DIRECT for %s: %s", os.fspath(path), e)
        return None
