"""One writer's flat checkpoint: a state's tensors in one tensor file, mapped in place.

Why. The in-memory tier wants one copy per snapshot: the tensors are copied straight
into a file in shared memory (mapped once and reused), hashed in parallel, and the
step committed around that file as it is, without a second copy through
``torch.save``. Restoring maps the file and hands out zero-copy views of it.

Format. Nothing new: the file is a :mod:`._tensorfile` (raw bytes at
:data:`~._tensorfile.ALIGN`-aligned offsets) and the step is committed with the
manifest of a sharded checkpoint (:mod:`._shard_index`) written by one rank: the
payload (``state.pt``) holds everything but the tensors, each replaced by a
placeholder; the index lists every tensor (placements ``"flat"``, its
layout-independent digest) and its chunks (a large tensor is split along its first
dimension into chunks of about :data:`CHUNK_BYTES` at aligned offsets, each with its
own xxh3, so hashing and verifying run on several threads). A tensor's chunks are
contiguous in the file, so a whole tensor is one view. Because the manifest is the
sharded one, :meth:`~elastic_kit.CheckpointStore.load`, ``verify``, the CLI and
retention treat a flat step like any other; the commit rules are the store's (the
manifest is written last, by the local backend's staging directory and rename).

The functions, in the order a writer and a reader use them:

- :func:`split_state` / :func:`plan_flat`: the tensors of a state and their layout;
- :func:`hash_flat`: every chunk's checksum, the file's (a digest of the chunks'
  checksums, :mod:`._chunk_listing`) and the tensors' digests, on a small thread pool
  (xxhash and numpy release the GIL);
- :func:`commit_flat`: move the written file into the step directory with the
  payload and the manifest; :func:`release_flat` un-commits a step and moves its file
  back out, for reuse;
- :func:`open_flat`: map a committed flat step, verify its chunks in parallel and
  build the state from views of the mapping.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import stat
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from elastic_kit.errors import CheckpointCorruptError
from elastic_kit.store._chunk_listing import (
    FLAT_PLACEMENT, check_listing, flat_file, is_flat, listing_digest,
)
from elastic_kit.store._digest import combine, partial_bytes
from elastic_kit.store._fs import is_local, join
from elastic_kit.store._layout import Layout, StepDir
from elastic_kit.store._manifest import (
    MANIFEST_NAME, PAYLOAD_NAME, FileEntry, Manifest, check_file_name,
)
from elastic_kit.store._serialize import load_payload, new_hasher, prepare_state, save_into
from elastic_kit.store._shard_index import (
    Chunk, ShardedTensor, ShardIndex, placeholder, placeholder_id,
)
from elastic_kit.store._tensorfile import (
    ALIGN, TensorEntry, dtype_from_name, dtype_name, tensor_bytes,
)
from elastic_kit.store._tree import map_tree

__all__ = ["FLAT_NAME", "FLAT_PLACEMENT", "CHUNK_BYTES", "FlatPlan", "FlatHashes",
           "FlatCheckpoint", "split_state", "storable", "pool_cpu_seconds", "plan_flat", "tensor_views", "hash_flat",
           "commit_flat", "release_flat", "flat_file", "is_flat", "open_flat", "copy_tensors",
           "zero_bytes"]

log = logging.getLogger(__name__)

#: The tensor file's name in a step directory (first save of the step).
FLAT_NAME = "tensors.bin"
#: Target bytes per checksummed chunk: large enough that a chunk's hash dwarfs the
#: thread hand-off, small enough that a few threads share a large tensor.
CHUNK_BYTES = 32 << 20
_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """The hashing threads, shared by every writer and reader of the process."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1)),
                                       thread_name_prefix="ek-flat-hash")
        return _POOL


_POOL_CPU_S = 0.0  # CPU seconds the pool's tasks took, all of them (pool_cpu_seconds)
_POOL_CPU_LOCK = threading.Lock()


def pool_cpu_seconds() -> float:
    """CPU seconds the shared thread pool's tasks have taken so far in this process
    (every writer's and reader's): a background writer's CPU cost is its own
    thread's and the difference of this over its write."""
    return _POOL_CPU_S


def _timed(fn: Callable[..., Any], *args: Any) -> Any:
    global _POOL_CPU_S
    t0 = time.thread_time()
    try:
        return fn(*args)
    finally:
        took = time.thread_time() - t0
        with _POOL_CPU_LOCK:
            _POOL_CPU_S += took


def _submit(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` on the shared pool; run here when the pool takes no more work
    (interpreter shutdown: a snapshot written by an exit handler is hashed on the
    exiting thread)."""
    try:
        return _pool().submit(_timed, fn, *args)
    except RuntimeError:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as e:
            done.set_exception(e)
        return done


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def storable(x: Any) -> bool:
    """Whether ``x`` is a tensor a flat file holds (dense, of a dtype files hold): the
    tensors :func:`split_state` takes out of the payload. A nested tensor is strided
    but has no single shape: it stays in the payload."""
    if (not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_quantized
            or x.is_nested):
        return False
    known = _STORABLE_DTYPES.get(x.dtype)
    if known is None:
        try:
            dtype_name(x.dtype)
            known = True
        except ValueError:
            known = False
        _STORABLE_DTYPES[x.dtype] = known
    return known


_STORABLE_DTYPES: dict[torch.dtype, bool] = {}


def split_state(state: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """The state with each dense tensor replaced by a placeholder (the payload), and
    those tensors with their key paths, in tree order. Tensors a tensor file cannot
    hold (sparse, quantized, nested, other dtypes) stay in the payload."""
    found: list[tuple[str, torch.Tensor]] = []

    def leaf(path: str, value: Any) -> Any:
        if storable(value):
            found.append((path, value))
            return placeholder(len(found) - 1)
        return value

    return map_tree(state, leaf), found


@dataclass(frozen=True)
class FlatPlan:
    """Where each tensor and each chunk lies in a flat file.

    Attributes:
        keys: each tensor's key path.
        dtypes, shapes: each tensor's dtype and shape.
        offsets: each tensor's first byte (aligned; its chunks follow contiguously).
        chunks: ``(tensor, first row, rows, offset, nbytes)``: rows along dim 0 (a
            0-d tensor is one chunk of "1 row").
        size: the file's size in bytes.
    """

    keys: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    chunks: tuple[tuple[int, int, int, int, int], ...]
    size: int

    def nbytes(self, i: int) -> int:
        """The bytes of the plan's tensor ``i``."""
        return math.prod(self.shapes[i]) * self.dtypes[i].itemsize

    def fits(self, items: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether ``items`` have this plan's keys, dtypes and shapes (in order)."""
        return (len(items) == len(self.keys)
                and all(k == key and t.dtype == d and tuple(t.shape) == s
                        for (k, t), key, d, s in zip(items, self.keys, self.dtypes, self.shapes)))


def plan_flat(items: Sequence[tuple[str, torch.Tensor]], *,
              chunk_bytes: int = CHUNK_BYTES) -> FlatPlan:
    """Lay ``items`` out in a flat file: each tensor at an aligned offset, split along
    dim 0 into chunks of about ``chunk_bytes`` whose sizes are multiples of
    :data:`ALIGN` (so every chunk starts aligned and the tensor stays contiguous)."""
    if chunk_bytes < ALIGN:
        raise ValueError(f"chunk_bytes={chunk_bytes!r} must be at least {ALIGN}")
    offsets, chunks, pos = [], [], 0
    for i, (_, t) in enumerate(items):
        nbytes = t.numel() * t.element_size()
        start = _align(pos)
        offsets.append(start)
        rows = t.shape[0] if t.dim() else 1
        row_bytes = nbytes // rows if rows else 0
        step = rows
        if nbytes > chunk_bytes and row_bytes:
            unit = ALIGN // math.gcd(row_bytes, ALIGN)  # rows whose bytes are aligned
            step = max(unit, chunk_bytes // row_bytes // unit * unit)
        row = 0
        while True:
            n = min(step, rows - row)
            chunks.append((i, row, n, start + row * row_bytes, n * row_bytes))
            row += n
            if row >= rows:
                break
        pos = start + nbytes
    return FlatPlan(keys=tuple(k for k, _ in items), dtypes=tuple(t.dtype for _, t in items),
                    shapes=tuple(tuple(t.shape) for _, t in items), offsets=tuple(offsets),
                    chunks=tuple(chunks), size=max(pos, offsets[-1] if offsets else 0))


def tensor_views(mapped: torch.Tensor, plan: FlatPlan) -> list[torch.Tensor]:
    """Each planned tensor as a view of the 1-D ``uint8`` ``mapped`` (the file's bytes:
    a :func:`~._tensorfile.map_file` mapping); copy into them to write the file."""
    out = []
    for i, (dtype, shape, offset) in enumerate(zip(plan.dtypes, plan.shapes, plan.offsets)):
        n = plan.nbytes(i)
        if n == 0:
            out.append(torch.empty(shape, dtype=dtype))
        else:
            out.append(mapped[offset:offset + n].view(dtype).view(shape))
    return out


@dataclass(frozen=True)
class FlatHashes:
    """What :func:`hash_flat` computed: each chunk's checksum (plan order), the file's
    (of its chunk listing), and each tensor's layout-independent digest."""

    chunks: tuple[str, ...]
    file: str
    digests: tuple[str, ...]
    checksum: str


def copy_tensors(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                 piece_bytes: int = CHUNK_BYTES) -> None:
    """``dst.copy_(src)`` for each ``(dst, src)``, in pieces of about ``piece_bytes``
    on the shared thread pool (a copy releases the GIL): a snapshot staged while
    another was written is copied into its file at the machine's memory bandwidth,
    not one core's (torch's own copy uses one thread under torchrun, which sets
    ``OMP_NUM_THREADS=1``)."""
    futures = []
    for dst, src in pairs:
        if (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
                and dst.shape == src.shape and dst.numel()):
            d, s = dst.view(-1), src.view(-1)
            step = max(1, piece_bytes // d.element_size())
            futures += [_submit(_copy_range, d, s, a, min(a + step, d.numel()))
                        for a in range(0, d.numel(), step)]
        else:
            futures.append(_submit(dst.copy_, src))
    for f in futures:
        f.result()


def zero_bytes(mapped: torch.Tensor) -> None:
    """Zero the 1-D ``uint8`` ``mapped`` in pieces of :data:`CHUNK_BYTES` on the shared
    thread pool: the first touch of a new snapshot file's shared-memory pages, whose
    cost is the kernel's page allocation, which scales with the threads (measured: a
    GiB in 0.57 s on one thread, 0.30 s on two)."""
    n = mapped.numel()
    futures = [_submit(_zero_range, mapped, a, min(a + CHUNK_BYTES, n))
               for a in range(0, n, CHUNK_BYTES)]
    for f in futures:
        f.result()


def _zero_range(t: torch.Tensor, start: int, end: int) -> None:
    t[start:end].zero_()


def _copy_range(dst: torch.Tensor, src: torch.Tensor, start: int, end: int) -> None:
    dst[start:end].copy_(src[start:end])


def _hash(mv: memoryview, checksum: str) -> str:
    h = new_hasher(checksum)
    h.update(mv)
    return str(h.hexdigest())


def _hash_chunk(mapped: torch.Tensor, offset: int, nbytes: int, tensor_start: int,
                checksum: str) -> tuple[str, int]:
    """A chunk's checksum and its share of its tensor's digest, in one pass over its
    bytes (each piece hashed while the digest's dot product has it in the cache).
    ``tensor_start``: the chunk's first byte within its tensor."""
    h = new_hasher(checksum)
    share = partial_bytes(mapped[offset:offset + nbytes].numpy(), tensor_start, h.update)
    return str(h.hexdigest()), share


def hash_flat(mapped: torch.Tensor, plan: FlatPlan, *, checksum: str = "xxh3_128") -> FlatHashes:
    """Checksums of a written flat file, on the shared thread pool: every chunk's (one
    task each), the file's (the digest of its chunk listing, see
    :mod:`._chunk_listing`) and each tensor's layout-independent digest
    (:mod:`._digest`: the sum of its chunks' shares, computed in the same pass over
    each chunk as its checksum). ``mapped``: the file's bytes (1-D ``uint8``)."""
    if mapped.numel() < plan.size:
        raise ValueError(f"mapping of {mapped.numel()} bytes cannot hold the plan's "
                         f"{plan.size}; expected at least that many")
    futures = [_submit(_hash_chunk, mapped, offset, nbytes, offset - plan.offsets[i], checksum)
               for i, _, _, offset, nbytes in plan.chunks]
    done = [f.result() for f in futures]
    chunks = [h for h, _ in done]
    shares: list[list[int]] = [[] for _ in plan.keys]
    for (i, *_), (_, share) in zip(plan.chunks, done):
        shares[i].append(share)
    whole = listing_digest(plan.size, [(c[3], c[4], h) for c, h in zip(plan.chunks, chunks)],
                           checksum)
    return FlatHashes(chunks=tuple(chunks), file=whole,
                      digests=tuple(combine(s) for s in shares), checksum=checksum)


def _index(plan: FlatPlan, hashes: FlatHashes, name: str) -> ShardIndex:
    tensors = [ShardedTensor(path=k, dtype=dtype_name(d), shape=s, placements=FLAT_PLACEMENT,
                             mesh=(), digest=g)
               for k, d, s, g in zip(plan.keys, plan.dtypes, plan.shapes, hashes.digests)]
    chunks = []
    for (i, row, rows, offset, nbytes), digest in zip(plan.chunks, hashes.chunks):
        shape = plan.shapes[i]
        cshape = (rows, *shape[1:]) if shape else ()
        offsets = (row,) + (0,) * (len(shape) - 1) if shape else ()
        entry = TensorEntry(key=f"{i}@{row}", dtype=dtype_name(plan.dtypes[i]), shape=cshape,
                            offset=offset, nbytes=nbytes, checksum=digest)
        chunks.append(Chunk(tensor=i, file=name, offsets=offsets, entry=entry))
    return ShardIndex(tensors=tensors, chunks=chunks)


def commit_flat(layout: Layout, *, step: int, flat_path: str, plan: FlatPlan,
                hashes: FlatHashes, payload: Any, metadata: dict[str, Any],
                world_size: int = 1) -> tuple[str, Manifest]:
    """Commit ``step``: the written flat file at ``flat_path`` is *moved* (renamed, same
    inode, no copy) into the step directory, the payload (``payload``: the state from
    :func:`split_state`) written beside it, and the manifest last.

    A local store only (the file is renamed). On failure nothing is committed and the
    file is back at ``flat_path``. A committed step of the same number is replaced
    monotonically, as by any save. Returns ``(step directory, manifest)``.

    Raises:
        ValueError: ``layout`` is not on a local filesystem.
        OSError: a write failed (naming the file).
    """
    if not is_local(layout.fs):
        raise ValueError(f"commit_flat needs a local store, got {layout.url!r}")
    layout.check_root()
    d = layout.dir_of(step)
    old, replacing = layout.existing(d)
    suffix = "." + uuid.uuid4().hex[:12] if replacing else ""
    name, payload_name = f"tensors{suffix}.bin", f"state{suffix}.pt"
    if not replacing:
        assert name == FLAT_NAME and payload_name == PAYLOAD_NAME
    backend = layout.backend
    staging = backend.begin_parts(d.path, replacing=replacing)
    moved = False
    written: list[str] = []
    try:
        os.rename(flat_path, join(staging, name))
        moved = True
        written.append(name)
        prepared = prepare_state(payload, copy=False)
        entry = backend.write_part(
            staging, payload_name,
            lambda f: save_into(f, join(staging, payload_name), prepared, hashes.checksum,
                                fsync=True),
            size_hint=64 << 10)
        written.append(payload_name)
        epoch = metadata.get("epoch")
        manifest = Manifest(step=step, files={payload_name: entry,
                                              name: FileEntry(size=plan.size,
                                                              checksum=hashes.file)},
                            payload=payload_name, checksum=hashes.checksum, metadata=metadata,
                            epoch=epoch if type(epoch) is int and epoch >= 0 else None,
                            world_size=world_size, writer=layout.writer_id,
                            sharded=_index(plan, hashes, name))
        backend.finish_parts(staging, d.path, manifest, replacing=replacing)
    except BaseException:
        if moved:
            try:
                os.rename(join(staging, name), flat_path)
                written.remove(name)
            except OSError as e:
                log.warning("cannot move %s back after a failed commit: %r", flat_path, e)
        backend.abort_parts(staging, written, replacing=replacing)
        raise
    if old is not None:  # only now is the replaced step's content unreferenced
        for n in set(old.files) - set(manifest.files):
            try:
                backend.remove_file(join(d.path, n))
            except Exception as e:
                log.debug("could not remove the replaced %s: %r", n, e)
    return d.path, manifest


def release_flat(layout: Layout, d: StepDir, *, to: str, inode: int,
                 manifest: Manifest | None = None) -> bool:
    """Delete step ``d``, first moving its tensor file to ``to`` when that file is the
    inode ``inode`` (a writer's reused file); whether it was moved. ``manifest``: its
    manifest, when the caller has just read it (else it is read here).

    The manifest goes first, so the step stops existing before its file leaves it; a
    crash half way leaves an uncommitted directory the store's cleanup removes.
    """
    m = manifest if manifest is not None else layout.committed_manifest(d)
    name = flat_file(m) if m is not None and is_flat(m) else None
    moved = False
    if name is not None:
        path = join(d.path, check_file_name(name))
        try:
            if os.lstat(path).st_ino == inode:
                os.remove(join(d.path, MANIFEST_NAME))
                os.rename(path, to)
                moved = True
        except FileNotFoundError:
            pass
    layout.delete(d)
    return moved


@dataclass
class FlatCheckpoint:
    """A mapped flat checkpoint (see :func:`open_flat`)."""

    manifest: Manifest
    state: Any
    mapped: torch.Tensor
    path: str


def _check_chunk(mapped: torch.Tensor, c: Chunk, checksum: str, where: str) -> None:
    e = c.entry
    got = _hash(tensor_bytes(mapped[e.offset:e.offset + e.nbytes]), checksum)
    if got != e.checksum:
        raise CheckpointCorruptError(
            f"{where}: bytes [{e.offset}, {e.offset + e.nbytes}) of tensor "
            f"{e.key!r} have {checksum} {got} but the manifest says {e.checksum} "
            f"(corrupt snapshot)")


def _check_listing(m: Manifest, name: str | None, *, where: str) -> None:
    """Before a byte of a mapped flat file is read: every chunk lies in the tensor
    file ``name``, and its listing passes :func:`~._chunk_listing.check_listing`.

    Raises:
        CheckpointCorruptError: naming the file and what does not match.
    """
    index = m.sharded
    assert index is not None
    if any(c.file != name for c in index.chunks):
        raise CheckpointCorruptError(f"{where}: a chunk lies outside the tensor file {name}")
    if name is not None:
        check_listing(m, name, where=where)


def _map_private(path: str, size: int, *, where: str) -> mmap.mmap:
    """A private (copy-on-write) mapping of the regular file ``path`` of ``size``
    bytes: writes to it never reach the file."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise CheckpointCorruptError(f"{where}: cannot open {path}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise CheckpointCorruptError(f"{where}: {path} is not a regular file of the "
                                         f"manifest's {size} bytes")
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def open_flat(layout: Layout, d: StepDir, *, map_location: Any = None,
              verify: bool = True) -> FlatCheckpoint:
    """Map committed flat step ``d``, verify every chunk (in parallel) and return the
    state with each tensor a zero-copy view of the mapping (``map_location=None``).

    The mapping is private (copy-on-write): changing a returned tensor never changes
    the file. With a ``map_location`` the tensors are copied there instead.

    Raises:
        CheckpointCorruptError: not a flat checkpoint, the payload, the chunk listing
            or a chunk does not match the manifest, chunks overlap, or the file is
            shorter.
    """
    found = layout.verify(d, deep=True, keep=True)
    assert not isinstance(found, Manifest)
    m = found.manifest
    try:
        skeleton = load_payload(found.source, where=d.path)
    finally:
        found.source.close()
    if not is_flat(m):
        raise CheckpointCorruptError(f"{d.path}: not a flat checkpoint (format {m.format})")
    name = flat_file(m)
    _check_listing(m, name, where=d.path)
    size = m.files[name].size if name is not None else 0
    mapped = torch.empty(0, dtype=torch.uint8)
    mm: mmap.mmap | None = None
    if name is not None and size:
        mm = _map_private(join(d.path, check_file_name(name)), size, where=d.path)
        mapped = torch.frombuffer(mm, dtype=torch.uint8)
    index = m.sharded
    if verify:
        futures = [_submit(_check_chunk, mapped, c, m.checksum, d.path)
                   for c in index.chunks]
        for f in futures:
            f.result()
    tensors: dict[int, torch.Tensor] = {}
    for i, t in enumerate(index.tensors):
        first = index.chunks_of(i)
        dtype = dtype_from_name(t.dtype)
        n = math.prod(t.shape) * torch.empty((), dtype=dtype).element_size()
        if n == 0 or not first:
            x = torch.empty(t.shape, dtype=dtype)
        else:
            start = min(c.entry.offset for c in first)
            if sum(c.entry.nbytes for c in first) != n or any(
                    c.entry.offset != start + c.offsets[0] * (n // t.shape[0])
                    for c in first if t.shape):
                raise CheckpointCorruptError(f"{d.path}: tensor {t.path} is not contiguous "
                                             f"in {name}")
            # a storage of its own over the mapping (some consumers, like
            # torch.set_rng_state, ignore a view's offset into a larger storage)
            x = torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=start)
            x = x.view(dtype).view(t.shape)
        tensors[i] = x if map_location is None else x.to(map_location, copy=True)

    def leaf(path: str, value: Any) -> Any:
        i = placeholder_id(value)
        if i is None:
            return value
        if i not in tensors or index.tensors[i].path != path:
            raise CheckpointCorruptError(f"{d.path}: payload placeholder at {path} names "
                                         f"tensor {i}, which the manifest does not hold there")
        return tensors[i]

    return FlatCheckpoint(manifest=m, state=map_tree(skeleton, leaf), mapped=mapped,
                          path=d.path)
