"""A digest of a tensor's *global* content that every sharding of it computes alike.

Why. A resharded load reads each rank's new shard from pieces of several saved
shards; per-file checksums prove the files are intact but not that the pieces were
put together right (an off-by-one row offset, a swapped shard, a dtype misread all
leave every file intact). This digest is a function of the global tensor alone,
computed from the shards at save time and again from the *new* shards after a load,
without gathering any tensor: equal digests mean the loaded global content is the
saved one.

How. The tensor's bytes in C order are read as 32-bit words (elements narrower than
4 bytes are widened to one word each; wider ones are 2 or 4 words), numbered by their
global position ``i``. The digest is two 32-bit lanes, each the sum over all words of
``M(i // B) * W(i % B) * word_i (mod 2**32)``, with ``B = 65536`` and odd pseudo-random
weights ``W`` and block multipliers ``M`` derived by splitmix64 from fixed seeds.
Being a sum, it splits over any partition of the words: each rank adds up the words
it holds (one ``numpy`` dot product per block piece, about 3 GB/s per lane on one
core) and the ranks' partial sums are added. Block boundaries depend only on global
positions, never on the sharding. Changing any one word by any amount changes each
lane (the weights are odd, so the product is never 0 mod 2**32); moving words to
other positions changes it unless the weighted sums collide (probability about
2**-64). It detects corruption and misassembly, not a deliberate forgery (the
per-file xxh3 checksums and the manifest's trust rules are about storage).
"""

from __future__ import annotations

import functools
import math
from typing import Iterator, Sequence

import numpy as np
import torch

__all__ = ["ALGORITHM", "BLOCK", "Partial", "partial", "combine", "runs"]

ALGORITHM = "elastic_kit.wsum32x2/1"
BLOCK = 1 << 16
_MASK = (1 << 32) - 1
_M64 = (1 << 64) - 1

#: Two 32-bit lane sums (mod 2**32).
Partial = tuple[int, int]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=1)
def _weights() -> tuple[np.ndarray, np.ndarray]:
    z = np.arange(BLOCK, dtype=np.uint64) + np.uint64(0x5EED)
    z = z * np.uint64(0x9E3779B97F4A7C15)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    lo = (z & np.uint64(_MASK)).astype(np.uint32) | np.uint32(1)
    hi = (z >> np.uint64(32)).astype(np.uint32) | np.uint32(1)
    return lo, hi


def _multipliers(block: int) -> tuple[int, int]:
    z = _splitmix64(block ^ 0xB10C)
    return (z & _MASK) | 1, (z >> 32) | 1


def _words(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """The tensor's bytes as a flat numpy array of words, and words per element.

    Elements of 4, 8 or 16 bytes are 1, 2 or 4 ``uint32`` words; narrower elements
    stay ``uint8``/``uint16`` here (one word each, widened per block when summed).
    """
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    if size >= 4:
        return flat.view(torch.int32).numpy().view(np.uint32), size // 4
    narrow = torch.uint8 if size == 1 else torch.int16
    return flat.view(narrow).numpy().view(np.uint8 if size == 1 else np.uint16), 1


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


def partial(local: torch.Tensor, offsets: Sequence[int],
            global_shape: Sequence[int]) -> Partial:
    """This shard's share of the digest of the global tensor it is a box of.

    ``local`` is the shard (any strides; read in C order), ``offsets`` its position
    in the global tensor of ``global_shape``. Shards of one tensor that together
    cover it exactly once give partials whose :func:`combine` is the digest.
    """
    if local.numel() == 0:
        return 0, 0
    words, per = _words(local)
    w_lo, w_hi = _weights()
    lane_lo = lane_hi = 0
    for local_start, global_start, length in runs(tuple(local.shape), offsets, global_shape):
        a, g, end = local_start * per, global_start * per, (local_start + length) * per
        while a < end:
            block, pos = divmod(g, BLOCK)
            take = min(BLOCK - pos, end - a)
            piece = words[a:a + take]
            if piece.dtype != np.uint32:
                piece = piece.astype(np.uint32)
            m_lo, m_hi = _multipliers(block)
            lane_lo += m_lo * int(np.dot(piece, w_lo[pos:pos + take]))
            lane_hi += m_hi * int(np.dot(piece, w_hi[pos:pos + take]))
            a += take
            g += take
    return lane_lo & _MASK, lane_hi & _MASK


def combine(partials: Sequence[Partial]) -> str:
    """The digest (16 hex digits) from every shard's :func:`partial`."""
    lo = sum(p[0] for p in partials) & _MASK
    hi = sum(p[1] for p in partials) & _MASK
    return f"{hi:08x}{lo:08x}"
