"""A flat tensor file: raw tensor bytes at aligned offsets, read back by byte range.

Why not ``torch.save``. A zip of pickles must be read from its start to find any
tensor, and every reader holds the whole file's structure. Sharded checkpoints need
the opposite: a rank that now owns rows 100-199 of a tensor reads exactly those bytes
(``pread`` on a local disk, one ranged GET on an object store) and nothing else; and
the in-memory tier wants to copy tensors straight into a mapped file and hand out
zero-copy views of it. Here a file is only the tensors' bytes, each starting at a
multiple of :data:`ALIGN` (4096: ``O_DIRECT``-friendly, page aligned for ``mmap``),
zero padding between them, and no header: the *index* (one :class:`TensorEntry` per
tensor: key, dtype, shape, offset, byte count, checksum of its bytes) lives with the
caller, in the checkpoint's manifest. Nothing in the file is executable or parsed.

The module knows nothing of sharding or of checkpoints:

- :func:`plan` lays tensors out (offsets, total size);
- :func:`write_stream` writes them into any writable stream (a local file, an
  ``O_DIRECT`` :class:`~elastic_kit.store._direct.DirectFile`, an fsspec upload) and
  returns the index and the whole file's size and checksum;
- :func:`write_into` copies them into a preallocated buffer (an ``mmap`` of a file
  in ``/dev/shm``) at the planned offsets;
- :class:`RangeReader` reads byte ranges (``os.pread`` locally, ``fs.cat_file(path,
  start, end)`` elsewhere); :func:`read_tensor` reads and verifies one entry;
  :func:`map_file` and :func:`view` give zero-copy tensors over a mapped file.

Example::

    items = [("w", torch.randn(4, 3)), ("b", torch.zeros(3))]
    with open(path, "wb") as f:
        entries, size, digest = write_stream(f, items, checksum="xxh3_128")
    w = read_tensor(RangeReader.local(path), entries[0], checksum="xxh3_128")
"""

from __future__ import annotations

import errno
import math
import os
import stat
import re
from dataclasses import dataclass
from typing import IO, Any, Sequence

import fsspec
import torch

from elastic_kit.errors import CheckpointCorruptError
from elastic_kit.store._serialize import new_hasher

__all__ = ["ALIGN", "TensorEntry", "dtype_name", "dtype_from_name", "plan", "write_stream",
           "write_into", "RangeReader", "read_tensor", "tensor_from_bytes", "map_file", "view",
           "tensor_bytes"]

#: Every tensor starts at a multiple of this (the page size of common systems and the
#: logical block size of common disks).
ALIGN = 4096
_ZEROS = bytes(ALIGN)
_KEY_RE = re.compile(r"[^\x00-\x1f]{1,512}")
_DIGEST_LEN = {"xxh3_128": 32, "crc32": 8, "sha256": 64}
_HEX_RE = re.compile(r"[0-9a-f]+", re.ASCII)
_MAX_DIMS = 64
_MAX_BYTES = 1 << 50

# The dtypes a file may hold, by name: a hostile index cannot name anything else.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool)
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``; ValueError for a dtype files do not hold."""
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} cannot be stored in a tensor file; expected one of "
                         f"{sorted(_DTYPES)}")
    return name


def dtype_from_name(name: Any) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ValueError for any other name."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"dtype {name!r:.40} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in a tensor file, and their checksum.

    ``nbytes`` is ``numel * itemsize`` of ``shape`` and ``dtype`` (C order);
    ``offset`` a multiple of :data:`ALIGN`; ``checksum`` a hex digest of exactly
    those bytes, with the algorithm the caller recorded beside the index.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes, "checksum": self.checksum}

    @classmethod
    def from_json(cls, d: Any, *, checksum: str, file_size: int | None = None) -> TensorEntry:
        """Validate one entry of an index read from storage (input anyone may have
        edited): types, ranges, alignment, byte count against dtype and shape, and
        (given ``file_size``) that the bytes lie inside the file.

        Raises:
            ValueError: naming the field and what was expected.
        """
        if not isinstance(d, dict):
            raise ValueError(f"tensor entry must be an object, got {d!r:.60}")
        key = d.get("key")
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"tensor entry key {key!r:.60} must be a printable string of "
                             f"1 to 512 characters")
        dtype = dtype_from_name(d.get("dtype"))
        shape = d.get("shape")
        if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
                or any(type(s) is not int or not 0 <= s <= _MAX_BYTES for s in shape)):
            raise ValueError(f"tensor {key!r}: shape {shape!r:.60} must be a list of at most "
                             f"{_MAX_DIMS} ints >= 0")
        offset, nbytes = d.get("offset"), d.get("nbytes")
        for name, v in (("offset", offset), ("nbytes", nbytes)):
            if type(v) is not int or not 0 <= v <= _MAX_BYTES:
                raise ValueError(f"tensor {key!r}: {name}={v!r:.40} must be an int in "
                                 f"[0, 2**50]")
        assert isinstance(offset, int) and isinstance(nbytes, int)
        if offset % ALIGN:
            raise ValueError(f"tensor {key!r}: offset {offset} is not a multiple of {ALIGN}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if nbytes != math.prod(shape) * itemsize:
            raise ValueError(f"tensor {key!r}: nbytes={nbytes} but shape {shape} of "
                             f"{d['dtype']} is {math.prod(shape) * itemsize} bytes")
        if file_size is not None and offset + nbytes > file_size:
            raise ValueError(f"tensor {key!r}: bytes [{offset}, {offset + nbytes}) lie "
                             f"beyond the file's {file_size} bytes")
        digest = d.get("checksum")
        if (not isinstance(digest, str) or len(digest) != _DIGEST_LEN.get(checksum, -1)
                or not _HEX_RE.fullmatch(digest)):
            raise ValueError(f"tensor {key!r}: checksum {digest!r:.80} is not a {checksum} "
                             f"hex digest")
        return cls(key=key, dtype=d["dtype"], shape=tuple(shape), offset=offset,
                   nbytes=nbytes, checksum=digest)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in C order, without a copy when it is contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def plan(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
    """Offsets of ``items`` in a file and the file's size (aligned starts, no trailing
    padding).

    Raises:
        ValueError: a tensor's dtype is not one a file holds (:func:`dtype_name`),
            found here, before a writer opens its file or writes a byte.
    """
    offsets, pos = [], 0
    for _, t in items:
        dtype_name(t.dtype)
        pos = _align(pos)
        offsets.append(pos)
        pos += t.numel() * t.element_size()
    return offsets, pos


def _entry(key: str, t: torch.Tensor, offset: int, mv: memoryview, checksum: str) -> TensorEntry:
    h = new_hasher(checksum)
    h.update(mv)
    return TensorEntry(key=key, dtype=dtype_name(t.dtype), shape=tuple(t.shape),
                       offset=offset, nbytes=mv.nbytes, checksum=str(h.hexdigest()))


def write_stream(f: IO[bytes], items: Sequence[tuple[str, torch.Tensor]], *,
                 checksum: str = "xxh3_128") -> tuple[list[TensorEntry], int, str]:
    """Write ``items`` (key, CPU or CUDA tensor) into ``f`` from its current position 0.

    Returns the index, the file's size and the checksum of all its bytes (padding
    included), so the file verifies like any other payload. ``f`` only needs
    ``write``: an ``O_DIRECT`` file, a buffered file or an fsspec upload stream.
    """
    offsets, _ = plan(items)
    whole = new_hasher(checksum)
    entries, pos = [], 0
    for (key, t), offset in zip(items, offsets):
        if offset > pos:
            pad = memoryview(_ZEROS)[:offset - pos]
            _write_all(f, pad)
            whole.update(pad)
            pos = offset
        mv = tensor_bytes(t)
        entries.append(_entry(key, t, offset, mv, checksum))
        _write_all(f, mv)
        whole.update(mv)
        pos += mv.nbytes
    return entries, pos, str(whole.hexdigest())


def _write_all(f: IO[bytes], mv: memoryview) -> None:
    done = 0
    while done < mv.nbytes:
        n = f.write(mv[done:])
        done += mv.nbytes - done if n is None else n


def write_into(buf: memoryview | torch.Tensor, items: Sequence[tuple[str, torch.Tensor]], *,
               checksum: str = "xxh3_128") -> list[TensorEntry]:
    """Copy ``items`` into a preallocated byte buffer at the :func:`plan` offsets.

    ``buf`` is a writable memoryview or a ``uint8`` tensor (an ``mmap`` of a file in
    ``/dev/shm``, :func:`map_file`); it must hold at least :func:`plan`'s size. CUDA
    tensors are copied by ``Tensor.copy_`` straight into the buffer's pages.
    """
    offsets, size = plan(items)
    dst = buf if isinstance(buf, torch.Tensor) else torch.frombuffer(buf, dtype=torch.uint8)
    if dst.dtype != torch.uint8 or dst.dim() != 1 or dst.numel() < size:
        raise ValueError(f"buffer of {dst.numel()} {dst.dtype} elements cannot take "
                         f"{size} bytes; expected a 1-D uint8 buffer of at least that size")
    entries = []
    for (key, t), offset in zip(items, offsets):
        n = t.numel() * t.element_size()
        if n:
            target = dst[offset:offset + n].view(t.dtype).view(t.shape)
            target.copy_(t.detach())
        entries.append(_entry(key, t, offset, tensor_bytes(dst[offset:offset + n]), checksum))
    return entries


class RangeReader:
    """Reads byte ranges of one file: ``os.pread`` on a local file, a ranged
    ``fs.cat_file(path, start, end)`` on any other fsspec filesystem."""

    def __init__(self, path: str, *, fs: fsspec.AbstractFileSystem | None = None,
                 fd: int | None = None) -> None:
        self.path = path
        self._fs = fs
        self._fd = fd

    @classmethod
    def local(cls, path: str) -> RangeReader:
        """A reader of a local regular file (opened once, never following a symlink)."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CheckpointCorruptError(f"{path} is a symbolic link, expected a regular "
                                             f"file") from e
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointCorruptError(f"{path} is not a regular file")
        return cls(path, fd=fd)

    def read(self, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` in a new writable buffer (tensors may be made over it
        without a copy).

        Raises:
            CheckpointCorruptError: the file is shorter (a local file at its end, or a
                remote object whose size, asked again, is less than ``end``).
            OSError: a remote read gave fewer bytes while the object is long enough
                (a dropped connection: ``errno.EIO``, which the caller retries).
        """
        if end <= start:
            return bytearray()
        if self._fd is not None:
            data = bytearray(end - start)
            mv, got = memoryview(data), 0
            while got < len(data):
                n = os.preadv(self._fd, [mv[got:]], start + got)
                if n <= 0:
                    break
                got += n
            if got != len(data):
                del mv
                data = data[:got]
        else:
            assert self._fs is not None
            data = bytearray(self._fs.cat_file(self.path, start=start, end=end))
            if len(data) != end - start:
                self._short_remote_read(start, end, len(data))
        if len(data) != end - start:
            raise CheckpointCorruptError(f"{self.path}: bytes [{start}, {end}) gave "
                                         f"{len(data)} bytes (the file is shorter)")
        return data

    def _short_remote_read(self, start: int, end: int, got: int) -> None:
        """A ranged GET answered with ``got`` bytes: proof of a short object only when
        the object's size, asked again, says so (then this returns and the caller
        raises corruption); else a read error (an answer cut short), raised as a
        retryable OSError."""
        assert self._fs is not None
        self._fs.invalidate_cache(self.path)  # a listing cache would answer the old size
        size = self._fs.info(self.path).get("size")
        if isinstance(size, int) and size < end:
            return
        raise OSError(errno.EIO, f"{self.path}: a read of bytes [{start}, {end}) gave {got} "
                                 f"bytes while the object holds {size} (an answer cut short)")

    def read_into(self, start: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes from ``start`` on (``preadv`` straight into it on
        a local file: no intermediate buffer).

        Raises:
            CheckpointCorruptError: the file is shorter.
            OSError: a remote read was cut short (see :meth:`read`).
        """
        n = out.nbytes
        if self._fd is None:
            out[:] = self.read(start, start + n)
            return
        got = 0
        while got < n:
            k = os.preadv(self._fd, [out[got:]], start + got)
            if k <= 0:
                raise CheckpointCorruptError(f"{self.path}: bytes [{start}, {start + n}) "
                                             f"gave {got} bytes (the file is shorter)")
            got += k

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def tensor_from_bytes(data: bytearray | memoryview, dtype: torch.dtype,
                      shape: Sequence[int]) -> torch.Tensor:
    """A tensor over the writable buffer ``data``, without a copy."""
    if len(data) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.frombuffer(data, dtype=torch.uint8)
    return raw.view(dtype).view(tuple(shape))


def read_tensor(reader: RangeReader, entry: TensorEntry, *, checksum: str) -> torch.Tensor:
    """Read one whole entry and verify its checksum.

    Raises:
        CheckpointCorruptError: the bytes do not match the entry's checksum.
    """
    data = reader.read(entry.offset, entry.offset + entry.nbytes)
    h = new_hasher(checksum)
    h.update(data)
    if h.hexdigest() != entry.checksum:
        raise CheckpointCorruptError(
            f"{reader.path}: tensor {entry.key!r} has {checksum} {h.hexdigest()} but the "
            f"index says {entry.checksum} (corrupt bytes)")
    return tensor_from_bytes(data, dtype_from_name(entry.dtype), entry.shape)


def map_file(path: str, nbytes: int, *, shared: bool = True) -> torch.Tensor:
    """A 1-D ``uint8`` tensor over a file's first ``nbytes`` (``mmap``; created and
    sized when absent with ``shared``). Writes go to the file when ``shared``."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    storage = torch.UntypedStorage.from_file(path, shared, nbytes)
    return torch.tensor([], dtype=torch.uint8).set_(storage)


def view(mapped: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """A zero-copy tensor of ``entry`` inside a :func:`map_file` mapping."""
    raw = mapped[entry.offset:entry.offset + entry.nbytes]
    if raw.numel() != entry.nbytes:
        raise CheckpointCorruptError(f"tensor {entry.key!r} lies beyond the mapping "
                                     f"({mapped.numel()} bytes)")
    return raw.view(dtype_from_name(entry.dtype)).view(entry.shape)

