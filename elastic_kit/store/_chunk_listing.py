"""A flat tensor file's checksum: a digest of its chunks' checksums.

Why. A flat file (one writer's tensors, see :mod:`._flat_commit`) is hashed chunk by
chunk, each chunk on a thread of its own, so a snapshot of gigabytes commits in the
time of a fraction of one pass over it. A checksum of the whole file's bytes would
need one more pass on one thread (measured: 1.1 s for 4.8 GB, most of a snapshot's
commit). So the file's checksum in the manifest is instead the digest of its chunk
listing (the file's size, then each chunk's offset, size and checksum, in file
order), and the file is verified by checking each chunk's bytes against its
checksum and the listing against the file's. The bytes between chunks (alignment
padding, which no reader uses) are not covered.

Only flat steps (every tensor's placements :data:`FLAT_PLACEMENT`, one tensor file)
use it; any other file's checksum is of its bytes.

Verifying a tensor file. :func:`verify_tensor_file` checks a tensor file of any
sharded or flat step in one pass, in file order, against what a load of it checks:
its chunks lie inside it without overlapping, each chunk's bytes match the chunk's
checksum, and each chunk's share of its tensor's layout-independent digest
(:mod:`._digest`) is computed from the same bytes; :func:`check_digests` then
compares the shares, summed over the files, with each tensor's recorded digest. So a
manifest whose index was damaged while every file's own checksum still matches (a
chunk's checksum, offset or shape, a tensor's digest) fails verification as it fails
a load, without a process group and without holding a file in memory.
"""

from __future__ import annotations

import errno
import math
from typing import IO, Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from elastic_kit.errors import CheckpointCorruptError
from elastic_kit.store._digest import BoxShare, Partial, combine
from elastic_kit.store._manifest import Manifest
from elastic_kit.store._serialize import new_hasher
from elastic_kit.store._shard_index import Chunk

__all__ = ["FLAT_PLACEMENT", "is_flat", "flat_file", "listing_digest", "check_listing",
           "check_chunk", "digest_mismatch", "verify_tensor_file", "check_digests"]

#: The placements recorded for a flat checkpoint's tensors (whole tensors, one writer).
FLAT_PLACEMENT = "flat"
#: Bytes read at a time when a flat file is verified from a stream.
_READ = 8 << 20


def is_flat(manifest: Manifest) -> bool:
    """Whether ``manifest`` is a flat checkpoint's (one tensor file, whole tensors)."""
    index = manifest.sharded
    return (index is not None and all(t.placements == FLAT_PLACEMENT for t in index.tensors)
            and len({c.file for c in index.chunks}) <= 1
            and len(manifest.files) <= 2)


def flat_file(manifest: Manifest) -> str | None:
    """The name of a flat checkpoint's tensor file (None: it holds no tensor)."""
    names = [n for n in manifest.files if n != manifest.payload]
    return names[0] if names else None


def listing_digest(size: int, chunks: Iterable[tuple[int, int, str]], checksum: str) -> str:
    """The flat file checksum of a file of ``size`` bytes whose chunks are
    ``(offset, nbytes, checksum)``: the ``checksum`` algorithm's digest of the
    listing, one line per chunk in file order after a line with the size."""
    h = new_hasher(checksum)
    h.update(f"{size}\n".encode())
    for offset, nbytes, digest in sorted(chunks):
        h.update(f"{offset} {nbytes} {digest}\n".encode())
    return str(h.hexdigest())


def check_listing(m: Manifest, name: str, *, where: str) -> list[tuple[int, int, str]]:
    """The chunks of flat tensor file ``name`` of ``m`` as ``(offset, nbytes,
    checksum)`` in file order, once their listing matches the file's checksum in the
    manifest and no chunk overlaps another or the file's end (checked before a byte
    is read: a chunk listed twice in place of another would otherwise pass every
    chunk's own check while the other's bytes are never verified).

    Raises:
        CheckpointCorruptError: naming the file and what does not match.
    """
    index = m.sharded
    assert index is not None
    entry = m.files[name]
    listed = sorted((c.entry.offset, c.entry.nbytes, c.entry.checksum)
                    for c in index.chunks if c.file == name)
    if listing_digest(entry.size, listed, m.checksum) != entry.checksum:
        raise CheckpointCorruptError(f"{where}: the chunks of {name} do not match its "
                                     f"{m.checksum} {entry.checksum} in the manifest")
    _check_places([(offset, nbytes) for offset, nbytes, _ in listed], entry.size, name,
                  where=where)
    return listed


def _check_places(spans: Sequence[tuple[int, int]], size: int, name: str, *,
                  where: str) -> None:
    """The ``(offset, nbytes)`` of the chunks of file ``name`` (of ``size`` bytes), in
    file order, lie inside it and overlap no other."""
    pos = 0
    for offset, nbytes in spans:
        if offset < pos or offset + nbytes > size:
            raise CheckpointCorruptError(f"{where}: chunk [{offset}, {offset + nbytes}) of "
                                         f"{name} overlaps another or the file's end")
        pos = offset + nbytes


def check_chunk(c: Chunk, checksum: str, got: str, *, where: str) -> None:
    """A chunk whose bytes have the digest ``got`` (``checksum`` algorithm) must match
    the checksum the manifest records for it (what a load checks of a chunk it reads
    whole, and a verification of every chunk).

    Raises:
        CheckpointCorruptError: naming the file, the chunk and both digests.
    """
    if got != c.entry.checksum:
        raise CheckpointCorruptError(
            f"{where}: {c.file} bytes of {c.entry.key!r} [{c.entry.offset}, "
            f"{c.entry.offset + c.entry.nbytes}) have {checksum} {got} but the manifest "
            f"says {c.entry.checksum}")


def digest_mismatch(path: str, digest: str, *, where: str) -> CheckpointCorruptError:
    """The error of sharded tensor ``path`` whose content does not give its recorded
    ``digest``."""
    return CheckpointCorruptError(f"{where}: sharded tensor {path} does not match its "
                                  f"saved digest {digest}")


def check_digests(m: Manifest, shares: Mapping[int, Partial], *, where: str) -> None:
    """Every sharded tensor of ``m`` has the digest it records, given its chunks' shares
    summed over the files (``shares``: tensor index -> share, from
    :func:`verify_tensor_file` of every tensor file of ``m``; a tensor of no chunk
    has none).

    Raises:
        CheckpointCorruptError: naming the first tensor that does not match.
    """
    index = m.sharded
    assert index is not None
    for i, t in enumerate(index.tensors):
        if combine([shares.get(i, 0)]) != t.digest:
            raise digest_mismatch(t.path, t.digest, where=where)


def verify_tensor_file(f: IO[bytes], m: Manifest, name: str, *, where: str,
                       path: str | None = None) -> dict[int, Partial]:
    """Check tensor file ``name`` of sharded (or flat) checkpoint ``m``, read once from
    ``f`` (at its start) in file order, as a load checks what it reads:

    - its chunks lie inside it without overlapping (a flat file's also match the
      file's listing checksum, :func:`check_listing`), checked before a byte is read;
    - every chunk's bytes match the chunk's checksum (:func:`check_chunk`);
    - the whole file's bytes match the file's checksum (a flat file's checksum is of
      its listing, checked above).

    Reads at most :data:`_READ` bytes at a time. Returns each tensor's share of its
    digest from this file's chunks (tensor index -> share; sum them over the files
    and check them with :func:`check_digests`).

    ``path``: the file's path, for the message of a read cut short.

    Raises:
        CheckpointCorruptError: naming the file and what does not match.
        OSError: (``EIO``) the stream ended before the file's size in the manifest,
            which the caller checked: a read cut short, to retry, not corruption.
    """
    index = m.sharded
    assert index is not None
    entry = m.files[name]
    chunks = sorted((c for c in index.chunks if c.file == name), key=lambda c: c.entry.offset)
    flat = is_flat(m) and name == flat_file(m)
    if flat:
        check_listing(m, name, where=where)
    else:
        _check_places([(c.entry.offset, c.entry.nbytes) for c in chunks], entry.size, name,
                      where=where)
    whole = None if flat else new_hasher(m.checksum)
    stream = _Stream(f, whole, path or f"{where}/{name}", entry.size)
    shares: dict[int, Partial] = {}
    for c in chunks:
        e = c.entry
        for _ in stream.take(e.offset - stream.pos):
            pass
        h = new_hasher(m.checksum)
        box = BoxShare(e.shape, c.offsets, index.tensors[c.tensor].shape,
                       e.nbytes // max(1, math.prod(e.shape)), visit=h.update)
        for data in stream.take(e.nbytes):
            box.update(data)
        check_chunk(c, m.checksum, str(h.hexdigest()), where=where)
        shares[c.tensor] = shares.get(c.tensor, 0) + box.value
    if whole is not None:
        for _ in stream.take(entry.size - stream.pos):
            pass
        if f.read(1):
            raise OSError(errno.EIO, f"{stream.path}: reading it gave more than its size "
                                     f"{entry.size} bytes as the manifest says (it changed "
                                     f"while being read)")
        digest = str(whole.hexdigest())
        if digest != entry.checksum:
            raise CheckpointCorruptError(
                f"{where}: {name} has {m.checksum} {digest} but the manifest says "
                f"{entry.checksum} (corrupt payload)")
    return shares


class _Stream:
    """A file read once from its start, in pieces of at most :data:`_READ` bytes, every
    byte also fed to ``whole`` (the whole file's hasher, or None)."""

    def __init__(self, f: IO[bytes], whole: Any, path: str, size: int) -> None:
        self.f, self.whole, self.path, self.size = f, whole, path, size
        self.pos = 0

    def take(self, n: int) -> Iterator[np.ndarray]:
        """The next ``n`` bytes, as 1-D ``uint8`` arrays of at most :data:`_READ`."""
        while n > 0:
            data = self.f.read(min(_READ, n))
            if not data:
                # the file's size matched the manifest's: a stream that ends early is a
                # read cut short (a dropped connection), which proves nothing
                raise OSError(errno.EIO, f"{self.path}: reading it ended at byte {self.pos}, "
                                         f"but its size is {self.size} as the manifest says "
                                         f"(a read cut short)")
            if self.whole is not None:
                self.whole.update(data)
            self.pos += len(data)
            n -= len(data)
            yield np.frombuffer(data, dtype=np.uint8)
