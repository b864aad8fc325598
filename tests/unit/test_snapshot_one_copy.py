"""One copy, straight into shared memory: a snapshot's tensors are copied into a file
in the node's snapshot directory that is mapped once and reused (two files rotate),
and a restore maps the file, verifies its chunks and hands out views of it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic_kit as ek
from elastic_kit import cli
import elastic_kit.snapshot._tier as tier_module
from elastic_kit.snapshot import SnapshotTier
from elastic_kit.store import (
    FLAT_NAME, MANIFEST_NAME, Layout, commit_flat, copy_tensors, hash_flat, is_flat, map_file,
    open_flat, plan_flat, resolve_url, split_state, tensor_views,
)


def _tier(shm: str) -> SnapshotTier:
    return SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(300, 64, generator=g), "odd": torch.randn(30, 37, generator=g),
                  "b": torch.arange(5, dtype=torch.int64),
                  "scale": torch.tensor(seed, dtype=torch.float64)},
        "mask": torch.rand(1000, generator=g) > 0.5,
        "rng": torch.get_rng_state(),
        "empty": torch.empty(0, 3),
        "step": seed, "history": [{"lr": 0.1}],
    }


def _tensors(state: Any) -> list[tuple[str, torch.Tensor]]:
    return split_state(state)[1]


def _step_dir(tier: SnapshotTier, step: int) -> Path:
    return Path(tier.node_dir, f"step-{step:012d}")


def test_the_snapshot_file_holds_exactly_the_states_bytes(shm: str) -> None:
    tier = _tier(shm)
    state = _state(1)
    tier.save(state, step=1, metadata={"epoch": 0})
    assert tier.wait(timeout=60)
    d = _step_dir(tier, 1)
    manifest = json.loads((d / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == ["state.pt", FLAT_NAME]
    data = (d / FLAT_NAME).read_bytes()
    expected = bytearray(len(data))
    for key, t in _tensors(state):
        i = next(i for i, x in enumerate(manifest["sharded"]["tensors"]) if x["path"] == key)
        offset = min(c["entry"]["offset"] for c in manifest["sharded"]["chunks"]
                     if c["tensor"] == i)
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        expected[offset:offset + len(raw)] = raw
    assert data == bytes(expected)                 # the tensors' bytes, zero padding, no more
    assert os.path.getsize(d / "state.pt") < 4096  # the payload holds no tensor bytes
    assert {x["path"] for x in manifest["sharded"]["tensors"]} == {k for k, _ in _tensors(state)}
    tier.close(remove=True)


def test_a_flipped_byte_is_detected_at_restore_and_the_next_newest_source_is_used(
        shm: str, caplog: pytest.LogCaptureFixture) -> None:
    tier = _tier(shm)
    older = _state(5)
    tier.save(older, step=5, metadata={})
    assert tier.wait(timeout=60)
    replica = Path(tier.node_dir, "replicas", "peer")   # as a peer's stream leaves it
    replica.mkdir(parents=True, mode=0o700)
    os.chmod(replica.parent, 0o700)
    shutil.copytree(_step_dir(tier, 5), replica / "step-000000000005")
    tier.save(_state(7), step=7, metadata={})
    assert tier.wait(timeout=60)
    flat = _step_dir(tier, 7) / FLAT_NAME
    with open(flat, "r+b") as f:                    # one bit of the mapped file
        f.seek(4096 + 17)
        byte = f.read(1)
        f.seek(4096 + 17)
        f.write(bytes([byte[0] ^ 0x01]))
    loaded = tier.load()
    assert loaded is not None and loaded.step == 5
    for (k, want), (_, got) in zip(_tensors(older), _tensors(loaded.state)):
        assert torch.equal(got, want), k
    assert "skipping snapshot" in caplog.text and "corrupt snapshot" in caplog.text
    assert not tier.loaded_own
    tier.close(remove=True)


def test_two_files_rotate_and_are_reused_without_a_new_allocation(shm: str) -> None:
    tier = _tier(shm)
    inodes, free = [], []
    for step in range(1, 7):
        tier.save(_state(step), step=step, metadata={})
        assert tier.wait(timeout=60)
        inodes.append(os.stat(_step_dir(tier, step) / FLAT_NAME).st_ino)
        committed = sorted(p.name for p in Path(tier.node_dir).glob("step-*"))
        assert committed == [f"step-{step:012d}"]  # the older snapshot is gone
        slots = list(Path(tier.node_dir).glob(".slot-*"))
        assert len(slots) == 1                      # the next snapshot's file waits
        free.append(os.stat(slots[0]).st_ino)
        for f in (slots[0], _step_dir(tier, step) / FLAT_NAME):
            assert stat.S_IMODE(os.stat(f).st_mode) == 0o600  # the user's alone
    assert len(set(inodes)) == 2 and set(free) == set(inodes)  # the same two files
    assert inodes[0::2] == [inodes[0]] * 3 and inodes[1::2] == [inodes[1]] * 3
    assert tier._slots is not None and tier._slots.made == 2
    tier.close(remove=True)


def test_a_state_that_changes_its_layout_is_staged_elsewhere_and_gets_a_new_file(
        shm: str) -> None:
    """The training thread takes the free file without checking its layout first (one
    walk of the state); a state of another layout (other shape, dtype, key, or one
    tensor more) is staged into buffers instead, the file is handed back and the
    writer makes one that fits. Every snapshot reads back as saved."""
    def variant(step: int, kind: str) -> dict[str, Any]:
        state = _state(step)
        if kind == "shape":
            state["model"]["odd"] = torch.randn(31, 37)
        elif kind == "dtype":
            state["model"]["b"] = torch.arange(5, dtype=torch.int32)
        elif kind == "key":
            state["model"]["B"] = state["model"].pop("b")
        elif kind == "more":
            state["extra"] = torch.ones(3)
        return state

    tier = _tier(shm)
    kinds = ["same", "same", "shape", "shape", "dtype", "key", "more", "more", "same"]
    for step, kind in enumerate(kinds, start=1):
        saved = variant(step, kind)
        tier.save(saved, step=step, metadata={})
        assert tier.wait(timeout=60)
        loaded = tier.load()
        assert loaded is not None and loaded.step == step
        got, want = _tensors(loaded.state), _tensors(saved)
        assert [k for k, _ in got] == [k for k, _ in want]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
        assert loaded.state["step"] == step
        slots = tier._slots
        assert slots is not None and not any(s.busy for s in slots._slots)
        assert len(list(Path(tier.node_dir).glob(".slot-*"))) <= 1
    # straight into a file whenever the layout was the one before; else not
    assert tier.direct == sum(1 for a, b in zip(kinds, kinds[1:]) if a == b)
    tier.close(remove=True)


def test_staging_into_a_file_that_does_not_fit_copies_nothing_into_it() -> None:
    from elastic_kit.snapshot._staging import FileTarget, StagingBuffers

    state = _state(1)
    _, items = split_state(state)
    plan = plan_flat(items)
    mapped = torch.full((plan.size,), 7, dtype=torch.uint8)
    views = tensor_views(mapped, plan)

    staged = StagingBuffers().stage(state, into=FileTarget(plan, views, mapped))
    assert staged.into_file and staged.staged.is_set()
    assert [t.data_ptr() for _, t in _tensors(staged.state)] == [v.data_ptr() for v in views]
    assert all(torch.equal(v, t) for v, (_, t) in zip(views, items))

    mapped.fill_(7)
    other = _state(2)
    other["empty"] = torch.empty(0, 4)              # the last tensor differs: found last
    staged = StagingBuffers().stage(other, into=FileTarget(plan, views, mapped))
    assert not staged.into_file
    assert int((mapped != 7).sum()) == 0            # the file was not written to
    got = _tensors(staged.state)
    assert [k for k, _ in got] == [k for k, _ in _tensors(other)]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, _tensors(other)))
    assert not any(t.data_ptr() in {v.data_ptr() for v in views} for _, t in got if t.numel())


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(path):
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def test_restored_tensors_are_views_of_the_mapped_file_equal_to_the_saved_ones(
        shm: str) -> None:
    tier = _tier(shm)
    state = _state(3)
    tier.save(state, step=3, metadata={"epoch": 1})
    assert tier.wait(timeout=60)
    tier.close(remove=False)                        # a worker that ends; the snapshot stays
    again = _tier(shm)
    loaded = again.load()
    assert loaded is not None and loaded.step == 3 and loaded.metadata == {"epoch": 1}
    assert loaded.state["step"] == 3 and loaded.state["history"] == [{"lr": 0.1}]
    flat = str(_step_dir(again, 3) / FLAT_NAME)
    ranges = _mapped_ranges(flat)
    for (k, want), (_, got) in zip(_tensors(state), _tensors(loaded.state)):
        assert torch.equal(got, want), k
        if got.numel():
            assert any(lo <= got.data_ptr() < hi for lo, hi in ranges), k  # no copy
    before = Path(flat).read_bytes()
    loaded.state["model"]["w"].add_(1.0)            # copy-on-write: the file stays
    assert Path(flat).read_bytes() == before
    torch.set_rng_state(loaded.state["rng"])        # a view is a tensor like any other
    again.close(remove=True)


def test_a_snapshot_taken_while_one_is_written_is_copied_into_the_file_after(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer is held in the first snapshot's hashing; the next ones are staged
    in buffers (the training thread never waits), the newest replaces the queued
    one, and it lands in a reused file once the first one committed."""
    entered, opened = threading.Event(), threading.Event()
    real = tier_module.hash_flat

    def held(*args: Any, **kw: Any) -> Any:
        if not entered.is_set():
            entered.set()
            opened.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(tier_module, "hash_flat", held)
    tier = _tier(shm)
    live = torch.zeros(1000)
    tier.save({"w": live}, step=1, metadata={})
    assert entered.wait(60)
    for step in range(2, 5):
        live.fill_(float(step))
        tier.save({"w": live}, step=step, metadata={})
    live.fill_(-1.0)
    assert tier.written == [] and tier.replaced == [2, 3]
    opened.set()
    assert tier.wait(timeout=60) and tier.written == [1, 4]
    loaded = tier.load()
    assert loaded is not None and loaded.step == 4
    assert torch.equal(loaded.state["w"], torch.full((1000,), 4.0))
    tier.close(remove=True)


def _flat_file(tmp_path: Path, state: Any) -> tuple[Any, list[tuple[str, torch.Tensor]],
                                                    Any, str, torch.Tensor]:
    """``state`` written as a flat file of several chunks per large tensor: its payload,
    tensors, plan, the file's path and its mapping."""
    payload, items = split_state(state)
    plan = plan_flat(items, chunk_bytes=8192)      # several chunks for the large tensor
    slot = str(tmp_path / "file")
    with open(slot, "wb") as f:
        f.truncate(plan.size)
    mapped = map_file(slot, plan.size)
    for view, (_, t) in zip(tensor_views(mapped, plan), items):
        view.copy_(t)
    return payload, items, plan, slot, mapped


def test_a_flat_step_is_a_checkpoint_the_store_and_the_cli_verify(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    root.mkdir()
    payload, items, plan, slot, mapped = _flat_file(tmp_path, _state(2))
    assert len(plan.chunks) > len(items)
    fs, path = resolve_url(str(root))
    layout = Layout(fs, path, url=str(root))
    commit_flat(layout, step=2, flat_path=slot, plan=plan, hashes=hash_flat(mapped, plan),
                payload=payload, metadata={"epoch": 0})
    assert not os.path.exists(slot)                 # moved into the step, not copied
    m = layout.read_manifest(layout.dir_of(2))
    assert is_flat(m) and m.epoch == 0
    opened = open_flat(layout, layout.dir_of(2))
    for (k, want), (_, got) in zip(items, _tensors(opened.state)):
        assert torch.equal(got, want), k
    assert cli.main(["verify", str(root)]) == 0
    assert "1 ok, 0 corrupt" in capsys.readouterr().out
    with open(root / "step-000000000002" / FLAT_NAME, "r+b") as f:
        f.seek(plan.offsets[0] + 9000)              # the large tensor's second chunk
        f.write(b"\xff\xff")
    with pytest.raises(ek.CheckpointCorruptError, match="corrupt snapshot"):
        open_flat(layout, layout.dir_of(2))
    assert cli.main(["verify", str(root)]) != 0     # `python -m elastic_kit verify`
    assert "0 ok, 1 corrupt" in capsys.readouterr().out


def test_a_flat_files_checksum_is_the_digest_of_its_chunks_which_verify_checks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each chunk is hashed on its own (in parallel) and the file's checksum is the
    digest of the chunk listing, not one more pass over the bytes."""
    import xxhash

    from elastic_kit.store._chunk_listing import listing_digest

    root = tmp_path / "store"
    root.mkdir()
    payload, items, plan, slot, mapped = _flat_file(tmp_path, _state(3))
    hashes = hash_flat(mapped, plan)
    raw = bytes(mapped.numpy())
    want = [xxhash.xxh3_128(raw[o:o + n]).hexdigest() for _, _, _, o, n in plan.chunks]
    assert list(hashes.chunks) == want
    assert hashes.file == listing_digest(
        plan.size, [(o, n, h) for (_, _, _, o, n), h in zip(plan.chunks, want)], "xxh3_128")
    assert hashes.file != xxhash.xxh3_128(raw).hexdigest()
    fs, path = resolve_url(str(root))
    layout = Layout(fs, path, url=str(root))
    commit_flat(layout, step=3, flat_path=slot, plan=plan, hashes=hashes, payload=payload,
                metadata={})
    assert cli.main(["verify", str(root)]) == 0
    assert "1 ok, 0 corrupt" in capsys.readouterr().out
    # a manifest whose file checksum does not match its chunk listing is corrupt
    manifest = root / "step-000000000003" / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    doc["files"][FLAT_NAME]["checksum"] = "0" * 32
    manifest.write_text(json.dumps(doc))
    with pytest.raises(ek.CheckpointCorruptError, match="chunks of tensors.bin do not match"):
        layout.verify(layout.dir_of(3), deep=True)
    assert cli.main(["verify", str(root)]) != 0
    assert "0 ok, 1 corrupt" in capsys.readouterr().out


@pytest.mark.parametrize("checksum", ["xxh3_128", "crc32", "sha256"])
def test_each_chunk_is_hashed_and_digested_in_one_pass_with_the_tensors_digests(
        checksum: str) -> None:
    """The tensors' layout-independent digests come from their chunks' shares,
    computed in the pass that hashes each chunk: the same digests as the whole
    tensors', and the same checksums as each chunk's bytes hashed alone."""
    from elastic_kit.store._digest import combine, partial
    from elastic_kit.store._serialize import new_hasher

    g = torch.Generator().manual_seed(0)
    items = [("f32", torch.randn(3000, 64, generator=g)),          # 94 chunks
             ("bf16", torch.randn(4097, 6, generator=g).to(torch.bfloat16)),  # 5, the last short
             ("i8", torch.randint(-100, 100, (1001, 7), generator=g, dtype=torch.int8)),
             ("bool", torch.rand(40961, generator=g) > 0.5),   # the last chunk one byte
             ("f64", torch.tensor(2.5, dtype=torch.float64)),
             ("empty", torch.empty(0, 5))]
    plan = plan_flat(items, chunk_bytes=8192)
    assert [sum(c[0] == i for c in plan.chunks) for i in range(len(items))] == [94, 5, 1, 6, 1, 1]
    mapped = torch.zeros(plan.size, dtype=torch.uint8)
    for view, (_, t) in zip(tensor_views(mapped, plan), items):
        view.copy_(t)
    hashes = hash_flat(mapped, plan, checksum=checksum)
    assert list(hashes.digests) == [combine([partial(t, (0,) * t.dim(), t.shape)])
                                    for _, t in items]
    raw = bytes(mapped.numpy())
    for (_, _, _, o, n), got in zip(plan.chunks, hashes.chunks):
        h = new_hasher(checksum)
        h.update(raw[o:o + n])
        assert got == h.hexdigest()


def test_copy_tensors_copies_in_pieces_on_the_pool_every_kind_of_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import elastic_kit.store._flat_commit as flat

    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(300, 64, generator=g), torch.arange(10_000, dtype=torch.int64),
            torch.rand(5000, generator=g) > 0.5, torch.tensor(3.5, dtype=torch.float64),
            torch.empty(0, 3), torch.randn(64, 300, generator=g).t()]  # last: strided
    dsts = [torch.zeros_like(s, memory_format=torch.contiguous_format) for s in srcs]
    pieces = []
    real = flat._copy_range
    monkeypatch.setattr(flat, "_copy_range", lambda d, s, a, b: (pieces.append((a, b)),
                                                                real(d, s, a, b)))
    copy_tensors(list(zip(dsts, srcs)), piece_bytes=4096)   # many pieces for the large ones
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)
    # the 76,800-byte tensor went in 19 pieces of 1,024 floats, the rest likewise
    assert len(pieces) == 19 + 20 + 2 + 1


def test_zero_bytes_zeroes_every_piece(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import elastic_kit.store._flat_commit as flat

    monkeypatch.setattr(flat, "CHUNK_BYTES", 4096)
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"\xab" * 10_000)                  # 2 whole pieces and a partial one
    mapped = map_file(path, 10_000)
    flat.zero_bytes(mapped)
    assert int(mapped.count_nonzero()) == 0
    with open(path, "rb") as f:
        assert f.read() == bytes(10_000)


@pytest.mark.parametrize("width", [64, 1024])   # the optimizer's tensors: cloned; copied on the pool
def test_a_checkpointer_restored_from_memory_does_not_hold_the_snapshots_file(
        shm: str, tmp_path: Path, width: int) -> None:
    """After a CPU restore from a snapshot the run keeps nothing mapped of its file:
    the model copies from the views, the optimizer state gets memory of its own and
    ``loaded`` keeps no state (before, both held the mapping for the rest of the run,
    one state's size of shared memory after the file was deleted)."""
    import gc

    def make() -> tuple[ek.Checkpointer, torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(width, 64)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        ck = ek.Checkpointer(ek.TrainState(model, opt), str(tmp_path / "durable"),
                             handle_signals=False, snapshot_every=1,
                             info=ek.DistInfo(run_id="job"))
        return ck, model, opt

    ck, model, opt = make()
    ck.restore()
    model(torch.ones(2, width)).sum().backward()
    opt.step()
    ck.step(2)
    assert ck.snapshots is not None and ck.snapshots.wait(timeout=60)
    want = {k: v.clone() for k, v in opt.state[model.weight].items()}
    ck.abandon()                                    # a failing worker: the snapshot stays
    del ck, model, opt
    gc.collect()
    ck, model, opt = make()
    ck.restore()
    assert ck.restored_from == "memory" and ck.restored_step == 1
    assert ck.loaded is not None and ck.loaded.step == 1 and ck.loaded.state == {}
    got = opt.state[model.weight]
    assert all(torch.equal(got[k], v) for k, v in want.items())
    gc.collect()
    flat = str(Path(ck.snapshots.node_dir, "step-000000000001", FLAT_NAME))  # type: ignore[union-attr]
    assert os.path.exists(flat) and _mapped_ranges(flat) == []
    ck.close()
