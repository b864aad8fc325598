"""The manifest's index of a sharded checkpoint: which bytes hold which part of what.

A sharded checkpoint is one replicated payload (``state.pt``: everything but the
DTensors, which are replaced by placeholders) plus one tensor file per writing rank
(:mod:`._tensorfile`). This index, part of the manifest, says for every sharded
tensor its key path, dtype, global shape, the placements it was saved with (for
people and tools; loading does not need them) and its layout-independent digest
(:mod:`._digest`); and for every saved chunk which tensor it belongs to, its offset
in the global tensor and where its bytes are (a :class:`TensorEntry`).

Like the rest of the manifest it is input from storage: :meth:`ShardIndex.from_json`
checks every field and that each tensor's chunks lie inside it and add up to it, so
that a hostile index fails as :class:`ValueError` (the manifest turns it into
``CheckpointCorruptError``) and never makes a reader allocate or read out of bounds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from elastic_kit.errors import CheckpointCorruptError
from elastic_kit.store._digest import ALGORITHM
from elastic_kit.store._tensorfile import TensorEntry, dtype_from_name

__all__ = ["PLACEHOLDER", "placeholder", "placeholder_id", "ShardedTensor", "Chunk",
           "ShardIndex"]

#: Prefix of the string that stands for sharded tensor ``i`` in the replicated payload.
PLACEHOLDER = "\x00elastic_kit.sharded:"
_MAX_TENSORS = 1 << 20
_MAX_CHUNKS = 1 << 22
_HEX16 = re.compile(r"[0-9a-f]{16}", re.ASCII)


def placeholder(i: int) -> str:
    return f"{PLACEHOLDER}{i}"


def placeholder_id(value: Any) -> int | None:
    """The tensor id a placeholder names, else None."""
    if isinstance(value, str) and value.startswith(PLACEHOLDER):
        tail = value[len(PLACEHOLDER):]
        if tail.isascii() and tail.isdigit():
            return int(tail)
    return None


@dataclass(frozen=True)
class ShardedTensor:
    """One DTensor of the state, as saved."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    placements: str
    mesh: tuple[int, ...]
    digest: str


@dataclass(frozen=True)
class Chunk:
    """One saved shard: tensor ``tensor``'s box at ``offsets``, in ``file``."""

    tensor: int
    file: str
    offsets: tuple[int, ...]
    entry: TensorEntry


@dataclass
class ShardIndex:
    """Every sharded tensor and every chunk of it (see the module docstring)."""

    tensors: list[ShardedTensor]
    chunks: list[Chunk]
    digest: str = ALGORITHM
    _by_tensor: dict[int, list[Chunk]] = field(default_factory=dict, repr=False,
                                                 compare=False)

    def chunks_of(self, i: int) -> list[Chunk]:
        if not self._by_tensor:
            for c in self.chunks:
                self._by_tensor.setdefault(c.tensor, []).append(c)
        return self._by_tensor.get(i, [])

    def placed(self, path: str, value: Any, *, where: str) -> int | None:
        """The sharded tensor that ``value``, the leaf at ``path`` of the replicated
        payload, stands for (None: ``value`` is no placeholder).

        Raises:
            CheckpointCorruptError: the placeholder names a tensor that the index does
                not hold at ``path`` (a load cannot put it back in place).
        """
        i = placeholder_id(value)
        if i is None:
            return None
        if i >= len(self.tensors) or self.tensors[i].path != path:
            raise CheckpointCorruptError(f"{where}: payload placeholder at {path} names "
                                         f"sharded tensor {i}, which the manifest does not "
                                         f"hold at that path")
        return i

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "tensors": [{"path": t.path, "dtype": t.dtype, "shape": list(t.shape),
                         "placements": t.placements, "mesh": list(t.mesh),
                         "digest": t.digest} for t in self.tensors],
            "chunks": [{"tensor": c.tensor, "file": c.file, "offsets": list(c.offsets),
                        "entry": c.entry.to_json()} for c in self.chunks],
        }

    @classmethod
    def from_json(cls, d: Any, *, files: dict[str, int], checksum: str) -> ShardIndex:
        """Validate an index read from storage. ``files``: listed file -> size.

        Raises:
            ValueError: naming the field and what was expected.
        """
        if not isinstance(d, dict):
            raise ValueError(f"sharded must be an object, got {d!r:.60}")
        if d.get("digest") != ALGORITHM:
            raise ValueError(f"sharded.digest={d.get('digest')!r:.60}, expected {ALGORITHM!r}")
        raw_t, raw_c = d.get("tensors"), d.get("chunks")
        if not isinstance(raw_t, list) or len(raw_t) > _MAX_TENSORS:
            raise ValueError(f"sharded.tensors must be a list of at most {_MAX_TENSORS}")
        if not isinstance(raw_c, list) or len(raw_c) > _MAX_CHUNKS:
            raise ValueError(f"sharded.chunks must be a list of at most {_MAX_CHUNKS}")
        tensors = [_tensor(t, i) for i, t in enumerate(raw_t)]
        chunks = [_chunk(c, tensors, files, checksum) for c in raw_c]
        index = cls(tensors=tensors, chunks=chunks)
        index.check_coverage()
        return index

    def check_coverage(self) -> None:
        """Every chunk lies inside its tensor and each tensor's chunks add up to it
        without overlapping one another, so they cover it exactly once: what a load
        requires (checked at parse time, and before a commit).

        Raises:
            ValueError: naming the tensor.
        """
        covered = [0] * len(self.tensors)
        boxes: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = [
            [] for _ in self.tensors]
        for c in self.chunks:
            if not 0 <= c.tensor < len(self.tensors):
                raise ValueError(f"sharded chunk tensor={c.tensor} must index the "
                                 f"{len(self.tensors)} sharded tensors")
            t = self.tensors[c.tensor]
            if (c.entry.dtype != t.dtype or len(c.offsets) != len(t.shape)
                    or len(c.entry.shape) != len(t.shape)
                    or any(o + s > g for o, s, g in zip(c.offsets, c.entry.shape, t.shape))):
                raise ValueError(f"chunk of {t.path} at {list(c.offsets)}, "
                                 f"{c.entry.dtype}{list(c.entry.shape)}, does not lie inside "
                                 f"{t.dtype}{list(t.shape)}")
            covered[c.tensor] += math.prod(c.entry.shape)
            boxes[c.tensor].append((c.offsets, c.entry.shape))
        for i, t in enumerate(self.tensors):
            if covered[i] != math.prod(t.shape):
                raise ValueError(f"sharded tensor {t.path}: its chunks hold {covered[i]} "
                                 f"elements, the tensor {math.prod(t.shape)}")
            both = _overlap(boxes[i])
            if both is not None:
                (ao, ashape), (bo, bshape) = both
                raise ValueError(f"the chunks of {t.path} at {list(ao)} of shape "
                                 f"{list(ashape)} and at {list(bo)} of shape {list(bshape)} "
                                 f"overlap (then some of the tensor is in no chunk)")


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
             ) -> tuple[tuple[tuple[int, ...], tuple[int, ...]],
                        tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Two of the boxes ``(offsets, shape)`` that overlap, else None. A sweep along the
    dimension whose offsets differ most (the sharded one: each box then meets the few
    boxes of the same slab, not all of them)."""
    boxes = [b for b in boxes if all(b[1])]  # an empty box overlaps nothing
    if len(boxes) < 2:
        return None
    dims = len(boxes[0][0])
    if dims == 0:  # two boxes of a scalar
        return boxes[0], boxes[1]
    d = max(range(dims), key=lambda k: len({o[k] for o, _ in boxes}))
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in sorted(boxes, key=lambda b: b[0][d]):
        o, shape = box
        active = [a for a in active if a[0][d] + a[1][d] > o[d]]
        for a in active:
            if all(a[0][k] < o[k] + shape[k] and o[k] < a[0][k] + a[1][k]
                   for k in range(dims)):
                return a, box
        active.append(box)
    return None


def _ints(v: Any, what: str, *, max_len: int = 64) -> tuple[int, ...]:
    if (not isinstance(v, list) or len(v) > max_len
            or any(type(x) is not int or not 0 <= x < 1 << 50 for x in v)):
        raise ValueError(f"{what}={v!r:.60} must be a list of at most {max_len} ints >= 0")
    return tuple(v)


def _tensor(d: Any, i: int) -> ShardedTensor:
    if not isinstance(d, dict):
        raise ValueError(f"sharded.tensors[{i}] must be an object, got {d!r:.60}")
    path, placements, digest = d.get("path"), d.get("placements"), d.get("digest")
    for name, v in (("path", path), ("placements", placements)):
        if not isinstance(v, str) or len(v) > 4096:
            raise ValueError(f"sharded.tensors[{i}].{name}={v!r:.60} must be a string")
    if not isinstance(digest, str) or not _HEX16.fullmatch(digest):
        raise ValueError(f"sharded.tensors[{i}].digest={digest!r:.60} must be 16 hex digits")
    dtype_from_name(d.get("dtype"))
    return ShardedTensor(path=path, dtype=d["dtype"],
                         shape=_ints(d.get("shape"), f"sharded.tensors[{i}].shape"),
                         placements=placements,
                         mesh=_ints(d.get("mesh"), f"sharded.tensors[{i}].mesh"),
                         digest=digest)


def _chunk(d: Any, tensors: list[ShardedTensor], files: dict[str, int],
           checksum: str) -> Chunk:
    if not isinstance(d, dict):
        raise ValueError(f"sharded chunk must be an object, got {d!r:.60}")
    i, name = d.get("tensor"), d.get("file")
    if type(i) is not int or not 0 <= i < len(tensors):
        raise ValueError(f"sharded chunk tensor={i!r:.40} must index sharded.tensors "
                         f"(0 to {len(tensors) - 1})")
    if not isinstance(name, str) or name not in files:
        raise ValueError(f"sharded chunk file={name!r:.60} is not a listed file")
    entry = TensorEntry.from_json(d.get("entry"), checksum=checksum, file_size=files[name])
    t = tensors[i]
    offsets = _ints(d.get("offsets"), "sharded chunk offsets")
    if entry.dtype != t.dtype:
        raise ValueError(f"chunk of {t.path} is {entry.dtype}, the tensor {t.dtype}")
    if len(offsets) != len(t.shape) or len(entry.shape) != len(t.shape) or any(
            o + s > g for o, s, g in zip(offsets, entry.shape, t.shape)):
        raise ValueError(f"chunk of {t.path} at {list(offsets)} of shape "
                         f"{list(entry.shape)} does not lie inside {list(t.shape)}")
    return Chunk(tensor=i, file=name, offsets=offsets, entry=entry)
