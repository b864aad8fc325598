"""Turning a state dict into payload bytes and back, checked both ways.

Three jobs, one concern (the payload's bytes):

- :func:`prepare_state` walks the state once before saving: it refuses anything
  ``torch.load(weights_only=True)`` could not read back (naming the key path, so the
  user learns at save time rather than at restore time) and copies tensors to CPU
  when asked (the staging of a non-blocking save).
- :class:`HashingWriter` computes the checksum while ``torch.save`` writes, so the
  file is never read a second time; a helper thread hashes behind the writes and
  overlaps with the final fsync (xxhash, zlib, hashlib and file writes release the
  GIL). On a local file written through the page cache it also starts the disk's
  writeback every few MB (``_fs.start_writeback``), so the fsync at the end only
  waits for the tail; a :class:`~elastic_kit.store._direct.DirectFile`
  (``O_DIRECT``, the usual local case) needs neither.
- :func:`load_payload` reads with ``weights_only=True`` and turns the refusal of a
  pickled object into :class:`UnsafeCheckpointError`.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import io
import os
import pickle
import queue
import threading
import zlib
from typing import IO, Any, Callable, Iterable, Iterator

import numpy as np

import torch

from elastic_kit.store._direct import DirectFile
from elastic_kit.store._fs import raise_named, start_writeback
from elastic_kit.store._tree import (
    PRIMITIVES, TENSOR_TYPES, iter_tensors, map_tree, refuse, validate_state,
)
from elastic_kit.store._manifest import FileEntry
from elastic_kit.errors import UnsafeCheckpointError

__all__ = ["save_into", "WRITEBACK_EVERY", "prepare_state", "stage_tensor", "validate_state",
           "storage_keys", "copy_deferred", "cuda_devices", "HashingWriter", "iter_tensors", "torch_zip_crc_off", "new_hasher",
           "hash_stream", "load_payload", "pinned_copy"]

_ASYNC_MIN = 1 << 16  # smaller chunks are copied: cheaper than locating their memory
#: ``torch.save`` writes every tensor as several small pieces (a zip header, the
#: bytes, the padding): a state of many small tensors made hundreds of thousands of
#: calls to :meth:`HashingWriter.write`, each a Python call, a hand-off to the hash
#: thread and a write. :func:`save_into` puts a C :class:`io.BufferedWriter` of this
#: size in front, which joins pieces up to this size and passes larger ones through
#: unchanged (the same memory, so a large tensor is still hashed without a copy).
COALESCE_BYTES = _ASYNC_MIN
#: A file's first bytes, up to this many, are hashed on the writing thread: a file
#: that small is not worth the helper thread's start.
_INLINE_MAX = 1 << 20
WRITEBACK_EVERY = 8 << 20  # local files: start the disk's writeback every 8 MiB written


def prepare_state(state: Any, *, copy: bool, path: str = "",
                  pool: dict[str, torch.Tensor] | None = None,
                  used: dict[str, torch.Tensor] | None = None,
                  later: frozenset[int] = frozenset(),
                  deferred: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """Validate ``state`` for weights-only loading and return what to serialize.

    Args:
        state: nested dicts/lists/tuples/sets of tensors and Python primitives.
        copy: copy every tensor to CPU memory (staging for a background write, so
            training may mutate the originals). Without it only CUDA tensors are
            copied to CPU (files then load on any machine) and views of a much larger
            storage are cloned (``torch.save`` would otherwise write the whole storage).
        path: the key path of ``state`` in the caller's structure, for messages.
        pool: staging buffers by key path, reused when shape and dtype match (and
            refilled with the new ones). Copying into pages that are already mapped
            is several times faster than allocating fresh memory, which is what
            keeps a non-blocking save's blocked time small.
        used: receives the buffers this call used (the caller keeps it as the next
            ``pool``, so buffers of keys that disappeared are freed).
        later: storage addresses (``untyped_storage().data_ptr()``) of tensors whose
            copy is deferred: with ``copy``, their staging buffer is allocated (or
            reused) but not filled; ``(source, buffer)`` goes to ``deferred`` for the
            caller to copy later (:func:`copy_deferred`).
        deferred: receives those pairs.

    Raises:
        TypeError: naming the key path and type of the first value that
            ``torch.load(weights_only=True)`` would refuse (a numpy scalar, a custom
            class, a namedtuple, ...).
    """
    # A tensor that appears twice (tied weights: two keys of a state dict, each a
    # detached view of the same parameter) is staged once, so it is copied and
    # written once, as torch.save does for the originals.
    staged: dict[tuple[Any, ...], torch.Tensor] = {}

    def leaf(p: str, value: Any) -> Any:
        if type(value) in TENSOR_TYPES:
            dense = _is_dense(value)
            same = _view_key(value, dense)
            if same is not None and same in staged:
                return staged[same]
            out = stage_tensor(value, p, copy=copy, pool=pool, used=used, later=later,
                               deferred=deferred, dense=dense)
            if same is not None:
                staged[same] = out
            return out
        if type(value) in PRIMITIVES:
            return value
        raise refuse(value, p)

    return map_tree(state, leaf, path=path)


def _is_dense(x: torch.Tensor) -> bool:
    """A plain strided tensor: one storage, of a shape and dtype ``torch.empty`` makes
    (not quantized, not nested)."""
    return x.layout == torch.strided and not x.is_quantized and not x.is_nested


def _view_key(x: torch.Tensor, dense: bool | None = None) -> tuple[Any, ...] | None:
    """What makes two tensors the same values (device, address of the first element,
    shape, strides, dtype, and the conjugate and negative bits: ``z.conj()`` shares
    ``z``'s bytes but not its values), for a dense non-empty one; None for any other.
    ``dense``: :func:`_is_dense` of ``x``, when the caller knows it."""
    if not (_is_dense(x) if dense is None else dense) or not x.numel():
        return None
    return (x.data_ptr(), x.device, x.shape, x.stride(), x.dtype, x.is_conj(), x.is_neg())


def stage_tensor(x: torch.Tensor, path: str, *, copy: bool,
                 pool: dict[str, torch.Tensor] | None, used: dict[str, torch.Tensor] | None,
                 later: frozenset[int] = frozenset(),
                 deferred: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 dense: bool | None = None) -> torch.Tensor:
    """One tensor of :func:`prepare_state` (its arguments, for the tensor at ``path``;
    ``dense``: :func:`_is_dense` of ``x``, when the caller knows it).

    Runs once per tensor of every save: a state of many small tensors spends its
    time here, so each property is read once (``is_cuda`` and ``is_cpu`` rather than
    ``device.type``, which builds a device object per call).
    """
    x = x.detach()
    # quantized and nested tensors are strided too, but torch.empty cannot make their
    # like (a quantizer, per-component sizes): they are copied whole below
    if dense is None:
        dense = _is_dense(x)
    cuda = x.is_cuda
    defer = (copy and deferred is not None and dense and bool(later)
             and x.untyped_storage().data_ptr() in later)
    if copy and (pool is not None or defer) and dense:
        buf = pool.get(path) if pool is not None else None
        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
            buf = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=cuda)
            if pool is not None:
                pool[path] = buf
        if defer:
            assert deferred is not None
            deferred.append((x, buf))
        else:
            buf.copy_(x, non_blocking=cuda)
        if used is not None:
            used[path] = buf
        return buf
    if cuda and dense:
        return pinned_copy(x)
    cpu = x.is_cpu
    if copy or not cpu:
        return x.to("cpu", copy=True) if cpu else x.to("cpu")
    # an empty view too: torch.save writes a view's whole storage
    if ((dense or (x.layout == torch.strided and not x.is_nested))
            and x.untyped_storage().nbytes() > 2 * x.nbytes):
        return x.clone()
    return x


def pinned_copy(x: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the CUDA tensor ``x`` in pinned memory, complete on return.

    A copy into pageable memory goes through a driver bounce buffer at a fraction of
    the bus's speed (2.97 s against 0.088 s for 4.83 GB on an H100), which made a
    synchronous save from CUDA tensors a third of the disk's speed; torch's caching
    host allocator keeps the pinned blocks for the next save's copies.
    """
    buf = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    buf.copy_(x)
    return buf


def storage_keys(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The storage addresses of ``tensors``: the ``later`` set of :func:`prepare_state`.

    Matching by storage rather than by object finds a parameter through the
    ``param.detach()`` views that ``state_dict()`` returns.
    """
    return frozenset(t.untyped_storage().data_ptr() for t in tensors
                     if isinstance(t, torch.Tensor) and _is_dense(t))


def cuda_devices(state: Any) -> set[torch.device]:
    """The CUDA devices ``state``'s tensors are on (empty: none on CUDA)."""
    return {t.device for t in iter_tensors(state) if t.is_cuda}


def copy_deferred(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                  after: dict[torch.device, Any] | None = None) -> None:
    """Fill the staging buffers that :func:`prepare_state` left empty, in order.

    Runs on the background save thread. CUDA sources are copied on a side stream of
    their device that first waits for that device's event in ``after`` (recorded on
    the device's current stream when the caller called ``save``, so the copy sees
    every update issued before it), synchronized before returning.
    """
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for src, dst in pairs:
        if src.device.type != "cuda":
            dst.copy_(src)
        else:
            by_device.setdefault(src.device, []).append((src, dst))
    streams = []
    for device, cuda in by_device.items():
        stream = torch.cuda.Stream(device=device)
        event = None if after is None else after.get(device)
        if event is not None:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            for src, dst in cuda:
                dst.copy_(src, non_blocking=True)
        streams.append(stream)
    for stream in streams:
        stream.synchronize()


def new_hasher(algorithm: str) -> Any:
    """A hasher object with ``update(bytes)`` and ``hexdigest()`` for ``algorithm``."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        try:
            import xxhash  # a dependency; checked when a store is built (CheckpointStore)
        except ImportError as e:
            raise ImportError(
                "checksum='xxh3_128' needs the xxhash package, a dependency of elastic_kit: "
                "pip install xxhash (or choose checksum='crc32' or 'sha256')") from e
        return xxhash.xxh3_128()
    if algorithm == "crc32":
        return _Crc32()
    raise ValueError(f"checksum={algorithm!r} must be 'xxh3_128', 'crc32' or 'sha256'")


class _Crc32:
    """zlib.crc32 with hashlib's interface (checkpoints written before xxh3_128 became
    the default use it)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class HashingWriter(io.RawIOBase):
    """A write-only file wrapper that counts and checksums the bytes passing through.

    Hashing runs on a helper thread, in order, *behind* the writes: ``write()``
    returns as soon as the bytes are in the file, and the caller's ``fsync`` (disk
    time, no CPU) overlaps with the hashing of the tail. The first
    :data:`_INLINE_MAX` bytes are hashed in ``write()`` itself: a small file is not
    worth starting the thread. ``torch.save`` hands over
    tensor storages as zero-copy memoryviews; a large chunk is queued without a
    copy only when its memory lies inside one of the ``stable`` tensors' storages
    (which the caller keeps alive and unchanged until :meth:`finish`); every other
    chunk is copied first, since its buffer may be freed when ``write`` returns.

    Example::

        with open(path, "wb") as f:
            w = HashingWriter(f, "xxh3_128", stable=tensors)
            torch.save(state, w)
            f.flush()
            os.fsync(f.fileno())     # overlaps with the hashing
            size, digest = w.finish()
    """

    def __init__(self, raw: IO[bytes], algorithm: str = "xxh3_128", *,
                 stable: Iterable[torch.Tensor] = (),
                 writeback_every: int | None = None,
                 stable_above: int = _ASYNC_MIN - 1) -> None:
        super().__init__()
        self._raw = raw
        self._hasher = new_hasher(algorithm)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # the storages' ranges, found at the first chunk large enough to be queued
        # without a copy (a state of small tensors never asks: no walk over them)
        self._stable: Iterable[torch.Tensor] | None = stable
        self._ranges: list[tuple[int, int]] = []
        self._starts: list[int] = []
        #: chunks of at most this many bytes are copied without asking whether their
        #: memory is stable (behind a buffer of that size, only larger ones can be)
        self._stable_above = max(int(stable_above), _ASYNC_MIN - 1)
        #: set after a failed save: further writes (a buffer's flush on the way out)
        #: are dropped, so that nothing is written after the error was raised
        self.discard = False
        self.on_first_write: Callable[[], None] | None = None
        self.size = 0
        self._writeback_every = writeback_every
        self._written_back = 0
        #: the error a write of the underlying file raised (ENOSPC, EFBIG, EIO, an
        #: object store client's HTTP error)
        self.write_error: Exception | None = None

    def writable(self) -> bool:
        return True

    def _is_stable(self, mv: memoryview) -> bool:
        if self._stable is not None:
            self._ranges = _storage_ranges(self._stable)
            self._starts = [r[0] for r in self._ranges]
            self._stable = None
        if not self._ranges:
            return False
        addr = int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + mv.nbytes <= self._ranges[i][0] + self._ranges[i][1]

    def _hash_loop(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                self._hasher.update(item)
        except BaseException as e:  # pragma: no cover - hashing bytes does not fail
            self._error = e

    def write(self, b: Any) -> int:  # type: ignore[override]
        if self.on_first_write is not None:
            cb, self.on_first_write = self.on_first_write, None
            cb()
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if self.discard:
            return n
        if self.write_error is not None:  # the file failed: never written again
            raise self.write_error
        if self._thread is None and self.size + n <= _INLINE_MAX:
            # a small file (a payload, a snapshot's state without its tensors): hashed
            # here, cheaper than starting the helper thread for it
            self._hasher.update(mv)
        else:
            if self._thread is None:  # from here on, in order, behind the writes
                self._thread = threading.Thread(target=self._hash_loop, name="ek-hash",
                                                daemon=True)
                self._thread.start()
            self._queue.put(mv if n > self._stable_above and self._is_stable(mv) else bytes(mv))
        try:
            written = self._raw.write(mv)
            # Raw (unbuffered) files may write less than asked; buffered ones never do.
            while written is not None and written < n:
                written += self._raw.write(mv[written:])
        except Exception as e:
            # torch.save's zip writer swallows the exception and reports only
            # "unexpected pos ..."; the caller re-raises this one instead.
            self.write_error = e
            raise
        self.size += n
        if self._writeback_every and self.size - self._written_back >= self._writeback_every:
            self._raw.flush()
            if not start_writeback(self._raw.fileno(), self._written_back,
                                   self.size - self._written_back):
                self._writeback_every = None  # unavailable here: stop asking
            self._written_back = self.size
        return n

    def flush(self) -> None:
        self._raw.flush()

    def finish(self) -> tuple[int, str]:
        """Wait for the hashing to catch up; ``(size, hexdigest)`` of all bytes written."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        return self.size, str(self._hasher.hexdigest())

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        super().close()


def _storage_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    ranges = {}
    for t in tensors:
        if t.device.type == "cpu" and t.layout == torch.strided:
            st = t.untyped_storage()
            if st.nbytes():
                ranges[st.data_ptr()] = st.nbytes()
    return sorted(ranges.items())


@contextlib.contextmanager
def torch_zip_crc_off(writer: HashingWriter) -> Iterator[None]:
    """Skip torch.save's own per-record CRC32 for one save into ``writer``.

    Our checksum already covers every byte, so torch's zip CRC would be a second
    full pass over the data. The option is global and read once when torch.save
    opens its zip writer, so it is switched off just before and restored at the
    writer's first ``write`` (a lock keeps two of our saves from interleaving).

    .. warning::
        A ``torch.save`` in another thread that starts in that window (while this
        save pickles its structure, typically well under a millisecond) writes zip
        records with a zero CRC; ``torch.load`` reads such files normally.
    """
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:  # older torch: nothing to skip
        yield
        return
    _CRC_LOCK.acquire()
    prev = get()
    restored = False

    def restore() -> None:  # runs on this thread, at the first write or on exit
        nonlocal restored
        if not restored:
            restored = True
            set_(prev)
            _CRC_LOCK.release()

    set_(False)
    writer.on_first_write = restore
    try:
        yield
    finally:
        restore()


_CRC_LOCK = threading.Lock()


def hash_stream(f: IO[bytes], algorithm: str, *, chunk: int = 8 << 20,
                sink: Callable[[bytes], Any] | None = None) -> tuple[int, str]:
    """Size and checksum of a readable stream (``sink`` also receives each chunk)."""
    h = new_hasher(algorithm)
    size = 0
    while True:
        data = f.read(chunk)
        if not data:
            return size, str(h.hexdigest())
        h.update(data)
        size += len(data)
        if sink is not None:
            sink(data)


def load_payload(source: str | IO[bytes], *, map_location: Any = None, where: str = "") -> Any:
    """``torch.load(source, weights_only=True)``, refusing pickled objects loudly.

    Raises:
        UnsafeCheckpointError: the payload holds something other than tensors and
            plain containers (an arbitrary pickled object, whose code is *not* run).
    """
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln),
                      lines[-1] if lines else "")
        detail = detail.split(". Please use")[0]  # torch's advice is to allowlist: not ours
        raise UnsafeCheckpointError(
            f"{where}: refusing to load a checkpoint that holds objects other than tensors "
            f"and plain containers (torch.load(weights_only=True) rejected it: "
            f"{detail}); nothing in it was executed. Only load checkpoints you "
            f"trust, and store obj.state_dict() rather than objects"
        ) from e


def save_into(f: IO[bytes], path: str, state: Any, checksum: str, *, fsync: bool) -> FileEntry:
    """torch.save ``state`` into ``f`` while checksumming; fsync overlaps the hashing.

    A failed write (disk full, quota) is raised as that OSError naming ``path``:
    torch.save itself would only report ``unexpected pos``.

    ``f`` may be a :class:`DirectFile` (``O_DIRECT``): no page cache, hence no
    writeback to start; its :meth:`~DirectFile.finish` writes the tail and fsyncs.

    ``torch.save`` writes through a C :class:`io.BufferedWriter` of
    :data:`COALESCE_BYTES` in front of the checksumming writer: the small pieces it
    writes per tensor are joined without a Python call each, and pieces larger than
    the buffer reach the writer as they are (zero-copy hashing of large tensors).
    """
    direct = isinstance(f, DirectFile)
    w = HashingWriter(f, checksum, stable=iter_tensors(state),
                      writeback_every=WRITEBACK_EVERY if fsync and not direct else None,
                      stable_above=COALESCE_BYTES)
    buffered = io.BufferedWriter(w, buffer_size=COALESCE_BYTES)
    done = False
    try:
        try:
            with torch_zip_crc_off(w):
                torch.save(state, buffered)
            buffered.flush()  # torch.save flushed it; cheap, and says so here
            if direct:
                f.finish(fsync=fsync)
            else:
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
        except Exception as e:
            raise_named(w.write_error or e, path)
        size, digest = w.finish()
        done = True
    finally:
        # a failed save may leave bytes in the buffer: dropped, never written after
        # the error (the buffer would flush them when detached, or when collected)
        w.discard = not done
        with contextlib.suppress(Exception):
            buffered.detach()
        w.close()
    return FileEntry(size=size, checksum=digest)
