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
"""

from __future__ import annotations

from typing import IO, Any, Iterable

from elastic_kit.errors import CheckpointCorruptError
from elastic_kit.store._manifest import Manifest
from elastic_kit.store._serialize import new_hasher

__all__ = ["FLAT_PLACEMENT", "is_flat", "flat_file", "listing_digest", "check_listing",
           "verify_flat_file"]

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
    pos = 0
    for offset, nbytes, _ in listed:
        if offset < pos or offset + nbytes > entry.size:
            raise CheckpointCorruptError(f"{where}: chunk [{offset}, {offset + nbytes}) of "
                                         f"{name} overlaps another or the file's end")
        pos = offset + nbytes
    return listed


def verify_flat_file(f: IO[bytes], m: Manifest, name: str, *, where: str) -> None:
    """Check flat tensor file ``name`` of ``m``, read from ``f`` (at its start): the
    chunk listing (:func:`check_listing`), then each chunk's bytes against its
    checksum.

    Raises:
        CheckpointCorruptError: naming the file and what does not match.
    """
    pos = 0
    for offset, nbytes, digest in check_listing(m, name, where=where):
        _skip(f, offset - pos, name=name, where=where)
        h = new_hasher(m.checksum)
        left = nbytes
        while left:
            data = f.read(min(_READ, left))
            if not data:
                raise CheckpointCorruptError(f"{where}: {name} ends inside the chunk at "
                                             f"offset {offset} (truncated)")
            h.update(data)
            left -= len(data)
        if str(h.hexdigest()) != digest:
            raise CheckpointCorruptError(
                f"{where}: bytes [{offset}, {offset + nbytes}) of {name} have {m.checksum} "
                f"{h.hexdigest()} but the manifest says {digest} (corrupt payload)")
        pos = offset + nbytes


def _skip(f: Any, n: int, *, name: str, where: str) -> None:
    while n > 0:
        data = f.read(min(_READ, n))
        if not data:
            raise CheckpointCorruptError(f"{where}: {name} is shorter than its chunks "
                                         f"(truncated)")
        n -= len(data)
