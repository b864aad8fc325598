"""A digest of a tensor's *global* content that every sharding of it computes alike.

Why. A resharded load reads each rank's new shard from pieces of several saved
shards; per-file checksums prove the files are intact but not that the pieces were
put together right (an off-by-one row offset, a swapped shard, a dtype misread all
leave every file intact). This digest is a function of the global tensor alone,
computed from the shards at save time and again from the *new* shards after a load,
without gathering any tensor: equal digests mean the loaded global content is the
saved one.

How. The tensor's bytes in C order are read as 64-bit little-endian words, numbered
by their global position ``i`` (the last word zero-padded). The digest is the sum over
all words of ``M(i // B) * W(i % B) * word_i (mod 2**64)``, with ``B = 65536`` and odd
pseudo-random weights ``W`` and block multipliers ``M`` derived by splitmix64 from
fixed seeds. Being a sum, and linear in every byte, it splits over any partition of
the bytes: each rank adds up what it holds (one ``numpy`` dot product per block
piece, several GB/s on one core; a word split between two ranks' shards is added by
each as its own bytes with zeros elsewhere) and the ranks' partial sums are added.
Word and block boundaries depend only on global byte positions, never on the
sharding. Changing any one word by any amount changes the digest (the weights are
odd, so the product is never 0 mod 2**64); moving bytes to other positions changes it
unless the weighted sums collide (probability about 2**-64). It detects corruption
and misassembly, not a deliberate forgery (the per-file xxh3 checksums and the
manifest's trust rules are about storage).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

__all__ = ["ALGORITHM", "BLOCK", "Partial", "partial", "partial_bytes", "BoxShare", "combine",
           "runs"]

ALGORITHM = "elastic_kit.wsum64/1"
BLOCK = 1 << 16
_M64 = (1 << 64) - 1

#: A shard's share of a digest: a sum mod 2**64.
Partial = int


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=1)
def _weights() -> np.ndarray:
    z = np.arange(BLOCK, dtype=np.uint64) + np.uint64(0x5EED)
    z = z * np.uint64(0x9E3779B97F4A7C15)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z | np.uint64(1)


def _multiplier(block: int) -> int:
    return _splitmix64(block ^ 0xB10C) | 1


def runs(local_shape: Sequence[int], offsets: Sequence[int],
         global_shape: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """The contiguous runs of a local box of a C-ordered global tensor:
    ``(local flat start, global flat start, length)`` in elements."""
    n = math.prod(local_shape)
    if n == 0:
        return
    dims = len(global_shape)
    partial_dims = [d for d in range(dims) if local_shape[d] != global_shape[d]]
    if not partial_dims:
        yield 0, 0, n
        return
    d_star = partial_dims[-1]
    strides = [math.prod(global_shape[d + 1:]) for d in range(dims)]
    length = local_shape[d_star] * strides[d_star]
    outer = local_shape[:d_star]
    for r in range(math.prod(outer)):
        rem, start = r, offsets[d_star] * strides[d_star]
        for d in range(d_star - 1, -1, -1):
            idx = rem % outer[d]
            rem //= outer[d]
            start += (offsets[d] + idx) * strides[d]
        yield r * length, start, length


def _word(data: np.ndarray, start: int, end: int, global_start: int) -> int:
    """The contribution of bytes ``data[start:end]`` lying at global byte
    ``global_start`` inside one word (the word's other bytes counted as zero)."""
    value = int.from_bytes(data[start:end].tobytes(), "little") << (8 * (global_start % 8))
    i = global_start // 8
    return _multiplier(i // BLOCK) * int(_weights()[i % BLOCK]) * value


def partial(local: torch.Tensor, offsets: Sequence[int],
            global_shape: Sequence[int]) -> Partial:
    """This shard's share of the digest of the global tensor it is a box of.

    ``local`` is the shard (any strides; read in C order), ``offsets`` its position
    in the global tensor of ``global_shape``. Shards of one tensor that together
    cover it exactly once give partials whose :func:`combine` is the digest.
    """
    if local.numel() == 0:
        return 0
    flat = local.detach().contiguous().reshape(-1)
    size = flat.element_size()
    data = flat.view(torch.uint8).numpy()
    total = 0
    for local_start, global_start, length in runs(tuple(local.shape), offsets, global_shape):
        total += partial_bytes(data[local_start * size:(local_start + length) * size],
                               global_start * size)
    return total & _M64


def partial_bytes(data: np.ndarray, global_start: int,
                  visit: Callable[[np.ndarray], None] | None = None) -> Partial:
    """The digest's share of the bytes ``data`` (1-D ``uint8``) lying at global byte
    ``global_start`` of a tensor and on: a contiguous run of it.

    ``visit``, if given, is called with consecutive pieces of ``data`` (at most one
    block of 512 KiB each, in order, covering it exactly once) as each is added: a
    checksum of the same bytes can then be computed while the piece is in the
    cache, in the same pass over memory."""
    weights = _weights()
    total = 0
    lb, gb, ge = 0, global_start, global_start + len(data)
    if gb % 8 and gb < ge:  # a word shared with bytes before this run
        end = min(ge, gb - gb % 8 + 8)
        if visit is not None:
            visit(data[lb:lb + end - gb])
        total += _word(data, lb, lb + end - gb, gb)
        lb, gb = lb + end - gb, end
    body_end = max(gb, ge - ge % 8)
    while gb < body_end:
        word = gb // 8
        block, pos = divmod(word, BLOCK)
        take = min(BLOCK - pos, (body_end - gb) // 8)
        piece = data[lb:lb + 8 * take]
        if visit is not None:
            visit(piece)
        total += _multiplier(block) * int(np.dot(piece.view(np.uint64), weights[pos:pos + take]))
        lb, gb = lb + 8 * take, gb + 8 * take
    if gb < ge:  # a word shared with bytes after this run
        if visit is not None:
            visit(data[lb:lb + ge - gb])
        total += _word(data, lb, lb + ge - gb, gb)
    return total & _M64


class BoxShare:
    """A saved box's share of its tensor's digest, from the box's bytes as they are
    read (C order, in pieces of any size): what :func:`partial` gives for the box,
    without holding it whole (a shard file is verified as a stream).

    ``local_shape`` and ``offsets`` are the box's in the tensor of ``global_shape``,
    whose elements are ``itemsize`` bytes. ``visit``, if given, receives every byte
    once, in order, as :func:`partial_bytes` adds it (a checksum of the same bytes).
    """

    def __init__(self, local_shape: Sequence[int], offsets: Sequence[int],
                 global_shape: Sequence[int], itemsize: int,
                 visit: Callable[[np.ndarray], None] | None = None) -> None:
        self._runs = runs(local_shape, offsets, global_shape)
        self._item = itemsize
        self._visit = visit
        self._at = 0  # global byte of the next byte of the current run
        self._left = 0  # bytes left in the current run
        self._total = 0

    def update(self, data: np.ndarray) -> None:
        """Add the box's next bytes ``data`` (1-D ``uint8``).

        Raises:
            ValueError: more bytes than the box holds.
        """
        pos = 0
        while pos < len(data):
            if not self._left:
                run = next(self._runs, None)
                if run is None:
                    raise ValueError("more bytes than the box holds")
                self._at, self._left = run[1] * self._item, run[2] * self._item
            take = min(self._left, len(data) - pos)
            self._total += partial_bytes(data[pos:pos + take], self._at, self._visit)
            pos += take
            self._at += take
            self._left -= take

    @property
    def value(self) -> Partial:
        """The share of the bytes added so far (all of them: the box's share)."""
        return self._total & _M64


def combine(partials: Sequence[Partial]) -> str:
    """The digest (16 hex digits) from every shard's :func:`partial`."""
    return f"{sum(partials) & _M64:016x}"
