"""The manifest of a sharded checkpoint lists every chunk (a tensor per rank that
holds a shard of it): for an 8 B-parameter model with AdamW under FSDP2 at 64 ranks
that is 55k chunks. Such a manifest must load; one too large to ever load is refused
when saved, not committed and then skipped at every load as corrupt."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from elastic_kit.store import CheckpointStore
from elastic_kit.store import _manifest
from elastic_kit.store._manifest import FileEntry, Manifest
from elastic_kit.store._shard_index import Chunk, ShardedTensor, ShardIndex
from elastic_kit.store._tensorfile import TensorEntry

_LAYERS = [f"model.layers.{layer}.{name}" for layer in range(32) for name in (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")]


def _fsdp_manifest(ranks: int) -> Manifest:
    """The manifest of a Llama-3-8B-like model + AdamW moments, dim-0 sharded."""
    paths = [f"['model']['{n}']" for n in _LAYERS] + [
        f"['optim']['state']['{n}']['{k}']" for n in _LAYERS for k in ("exp_avg", "exp_avg_sq")]
    rows = 4096 // ranks
    files = {f"shards-{r:05d}.0123456789ab.bin": FileEntry(size=len(paths) * rows * 4096 * 4,
                                                          checksum="0" * 32)
             for r in range(ranks)}
    names = sorted(files)
    files["state.pt"] = FileEntry(size=1 << 20, checksum="0" * 32)  # the replicated part
    tensors = [ShardedTensor(p, "float32", (4096, 4096), "(Shard(dim=0),)", (ranks,),
                             "0" * 16) for p in paths]
    chunks = [Chunk(i, names[r], (r * rows, 0),
                    TensorEntry(t.path, "float32", (rows, 4096), i * rows * 4096 * 4,
                                rows * 4096 * 4, "0" * 32))
              for i, t in enumerate(tensors) for r in range(ranks)]
    return Manifest(step=1000, files=files, checksum="xxh3_128", world_size=ranks,
                    sharded=ShardIndex(tensors, chunks))


def test_the_manifest_of_a_large_sharded_checkpoint_loads() -> None:
    m = _fsdp_manifest(64)
    assert len(m.sharded.chunks) == 864 * 64 == 55296
    t0 = time.perf_counter()
    text = m.to_json()
    back = Manifest.from_json(text, where="test")
    seconds = time.perf_counter() - t0
    assert back.step == 1000 and len(back.sharded.chunks) == 55296
    assert back.sharded.chunks[-1] == m.sharded.chunks[-1]
    assert len(text) < 20 << 20, len(text)  # compact: ~290 bytes a chunk
    print(f"{len(text) / 2**20:.1f} MiB, written and read in {seconds:.2f} s")


def test_a_manifest_too_large_to_load_is_refused_at_save(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(_manifest, "MAX_MANIFEST_BYTES", 4096)
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"w": torch.ones(2)}, step=1, metadata={"note": "small"})
    with pytest.raises(ValueError, match=r"manifest of checkpoint step 2 would be \d+ "
                                         r"bytes, more than the 4096 a manifest may have"):
        store.save({"w": torch.ones(2)}, step=2, metadata={"notes": "x" * 8192})
    assert [i.step for i in store.list()] == [1]
    store.close()
