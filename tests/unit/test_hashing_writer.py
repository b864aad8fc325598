"""The checksumming file wrapper every save writes through: the digest is of every
byte, in order, whether a chunk was hashed on the writing thread (a small file's
first bytes) or behind the writes on the helper thread."""

from __future__ import annotations

import io

import pytest
import torch

from elastic_kit.store._serialize import _INLINE_MAX, HashingWriter, new_hasher


def _digest(data: bytes, algorithm: str) -> str:
    h = new_hasher(algorithm)
    h.update(data)
    return str(h.hexdigest())


@pytest.mark.parametrize("algorithm", ["xxh3_128", "crc32"])
@pytest.mark.parametrize("sizes", [
    [10, 3, 4096],                                     # a small file: hashed inline
    [_INLINE_MAX],                                     # exactly the inline limit
    [100, _INLINE_MAX],                                # crosses it: the rest behind
    [_INLINE_MAX // 2, 700_000, 3 << 20, 5, 1 << 16],  # and onwards, several kinds
])
def test_the_digest_is_of_every_byte_in_order_however_it_was_hashed(
        algorithm: str, sizes: list[int]) -> None:
    g = torch.Generator().manual_seed(len(sizes))
    stable = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=g)
    raw = io.BytesIO()
    w = HashingWriter(raw, algorithm, stable=[stable])
    at, expected = 0, b""
    for i, n in enumerate(sizes):
        chunk = stable[at:at + n].numpy() if i % 2 else bytearray(stable[at:at + n].numpy())
        w.write(memoryview(chunk))
        expected += bytes(stable[at:at + n].numpy())
        at += n
    threaded = w._thread is not None
    size, digest = w.finish()
    assert size == len(expected) and raw.getvalue() == expected
    assert digest == _digest(expected, algorithm)
    assert threaded == (sum(sizes) > _INLINE_MAX)     # no thread for a small file
    w.close()
