"""Tensors of unusual kinds through every save path: quantized and nested tensors in
non-blocking saves and flat snapshots, an empty view of a large tensor, a tensor
that appears under two keys (tied weights), and a dtype tensor files do not hold in a
sharded save.
"""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import fsspec
import pytest
import torch
import torch.distributed as dist

from elastic_kit.store import (
    CheckpointStore, Layout, commit_flat, copy_tensors, hash_flat, map_file, open_flat,
    plan_flat, split_state, storable, tensor_views,
)
from elastic_kit.store._tensorfile import plan
from elastic_kit.testing import FaultFileSystem


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided nested layout is a prototype
        return torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0) + 10])


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated
        return torch.quantize_per_tensor(torch.tensor([-1.0, 0.5, 2.0, 0.0, 1.2]), 0.1, 3,
                                         torch.qint8)


def _complex32(n: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental
        return torch.zeros(n, dtype=torch.complex32)


def _dir_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(root) for f in fs)


def _same_quantized(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.is_quantized and got.q_scale() == 0.1 and got.q_zero_point() == 3
    assert got.int_repr().tolist() == want.int_repr().tolist() == [-7, 8, 23, 3, 15]


def _same_nested(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.is_nested
    assert [t.tolist() for t in got.unbind()] == [[0.0, 1.0], [10.0, 11.0, 12.0]]


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("make, same", [(_quantized, _same_quantized), (_nested, _same_nested)],
                         ids=["quantized", "nested"])
def test_quantized_and_nested_tensors_round_trip_through_a_save(
        tmp_path: Path, blocking: bool, make: Any, same: Any) -> None:
    x = make()
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"x": x, "w": torch.ones(3)}, step=1, blocking=blocking).wait()
    loaded = store.load()
    store.close()
    assert loaded is not None
    same(loaded.state["x"], x)
    assert loaded.state["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_nested_tensor_stays_in_a_flat_snapshots_payload(tmp_path: Path) -> None:
    n = _nested()
    assert not storable(n) and storable(torch.ones(2))
    layout = Layout(fsspec.filesystem("file"), str(tmp_path / "store"),
                    url=str(tmp_path / "store"))
    payload, items = split_state({"n": n, "w": torch.arange(6.0)})
    assert [k for k, _ in items] == ["['w']"]
    flat = plan_flat(items)
    mapped = map_file(str(tmp_path / "slot.bin"), flat.size)
    copy_tensors([(v, t) for v, (_, t) in zip(tensor_views(mapped, flat), items)])
    commit_flat(layout, step=1, flat_path=str(tmp_path / "slot.bin"), plan=flat,
                hashes=hash_flat(mapped, flat), payload=payload, metadata={})
    state = open_flat(layout, layout.dir_of(1)).state
    assert state["n"].is_nested
    assert [t.tolist() for t in state["n"].unbind()] == [[0.0, 1.0], [10.0, 11.0, 12.0]]
    assert state["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("blocking", [True, False])
def test_an_empty_view_of_a_large_tensor_writes_none_of_its_storage(tmp_path: Path,
                                                                    blocking: bool) -> None:
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"e": big[5:5], "x": big[7:9]}, step=1, blocking=blocking).wait()
    loaded = store.load()
    store.close()
    assert _dir_bytes(tmp_path / "ck") < 64 << 10
    assert loaded is not None
    assert loaded.state["e"].shape == (0,) and loaded.state["e"].dtype == torch.float32
    assert loaded.state["x"].tolist() == [7.0, 8.0]


def test_tied_weights_are_written_once_by_a_non_blocking_save(tmp_path: Path) -> None:
    shared = torch.nn.Parameter(torch.arange(1 << 20, dtype=torch.float32))  # 4 MiB
    store = CheckpointStore(str(tmp_path / "ck"), keep_last=None)
    state = {"embed.weight": shared.detach(), "head.weight": shared.detach()}
    store.save(state, step=1, blocking=False).wait()
    one = _dir_bytes(tmp_path / "ck")
    assert 4 << 20 < one < 5 << 20  # once, as torch.save writes the live tensors
    # untied in the next save: each key gets its own bytes again
    other = torch.full((1 << 20,), 3.0)
    store.save({"embed.weight": shared.detach(), "head.weight": other}, step=2,
               blocking=False).wait()
    loaded = store.load()
    store.close()
    assert loaded is not None and loaded.step == 2
    assert torch.equal(loaded.state["embed.weight"], torch.arange(1 << 20, dtype=torch.float32))
    assert torch.equal(loaded.state["head.weight"], other)


def test_tied_weights_load_with_the_same_values_under_both_keys(tmp_path: Path) -> None:
    shared = torch.arange(12.0).reshape(3, 4)
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"a": shared, "b": shared.view(3, 4), "c": shared[1]}, step=1,
               blocking=False).wait()
    loaded = store.load()
    store.close()
    assert loaded is not None
    assert loaded.state["a"].tolist() == loaded.state["b"].tolist() == shared.tolist()
    assert loaded.state["c"].tolist() == [4.0, 5.0, 6.0, 7.0]


def test_a_file_plan_refuses_a_dtype_files_do_not_hold_before_anything_is_written() -> None:
    with pytest.raises(ValueError, match=r"complex32 cannot be stored in a tensor file"):
        plan([("w", torch.ones(2)), ("c", _complex32(2))])


@pytest.fixture()
def mesh() -> Iterator[Any]:
    """A one-rank gloo group in this process (an in-memory store: no port, no process)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_sharded_save_of_a_dtype_files_do_not_hold_opens_no_shard_file(mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    ffs = FaultFileSystem(fsspec.filesystem("memory"))
    name = f"dtypes-{uuid.uuid4().hex[:12]}"
    try:
        store = CheckpointStore(f"memory://{name}", keep_last=None, filesystem=ffs)
        ok = DTensor.from_local(torch.arange(8.0), mesh, [Shard(0)], run_check=False)
        store.save({"w": ok}, step=1)
        bad = DTensor.from_local(_complex32(4), mesh, [Shard(0)], run_check=False)
        with pytest.raises(ValueError, match=r"complex32 cannot be stored in a tensor file"):
            store.save({"w": ok, "c": bad}, step=2)
        assert [p for op, p in ffs.calls if op == "open" and "step-000000000002" in p] == []
        loaded = store.load(into={"w": ok})
        store.close()
        assert loaded is not None and loaded.step == 1
        assert loaded.state["w"].to_local().tolist() == list(range(8))
    finally:
        if ffs.target.exists(f"/{name}"):
            ffs.target.rm(f"/{name}", recursive=True)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_conjugate_or_negative_view_is_not_taken_for_its_base(tmp_path: Path,
                                                                 blocking: bool) -> None:
    """``z.conj()`` and ``torch._neg_view(z)`` share ``z``'s address, shape, strides and
    dtype; only a bit tells them apart, and it changes every value read."""
    z = torch.tensor([1 + 2j, 3 - 4j])
    real = torch.tensor([1.0, -2.0])
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"z": z, "zc": z.conj(), "r": real, "rn": torch._neg_view(real)}, step=1,
               blocking=blocking).wait()
    loaded = store.load()
    store.close()
    assert loaded is not None
    assert loaded.state["z"].resolve_conj().tolist() == [1 + 2j, 3 - 4j]
    assert loaded.state["zc"].resolve_conj().tolist() == [1 - 2j, 3 + 4j]
    assert loaded.state["r"].resolve_neg().tolist() == [1.0, -2.0]
    assert loaded.state["rn"].resolve_neg().tolist() == [-1.0, 2.0]
