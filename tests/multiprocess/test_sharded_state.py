"""Sharded (FSDP2 / DTensor) state on real gloo ranks: each rank writes its own shards,
any world size loads them, and what it loads is the saved state, bit for bit.

Every job builds the same tiny model (three linear blocks, ``fully_shard`` per block
and on the root), trains a few AdamW steps, saves through ``TrainState`` and
``CheckpointStore``; a job at another world size loads into a freshly built model and
returns the full state gathered with ``full_state_dict=True``, compared in the parent
with what the saving job gathered.
"""

from __future__ import annotations

import json

import pytest
import torch

from elastic_kit.testing import spawn_multi_process
from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (session fixtures)

pytestmark = pytest.mark.timeout(300)


def _model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # odd sizes: shards are uneven at 2 and 3 ranks, one rank's shard may be empty
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 4),
                                torch.nn.Linear(4, 2))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The full (gathered) model and optimizer state, as lists (on rank 0 only: with
    ``cpu_offload`` the other ranks get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False))
    out = {f"model/{k}": v for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():
        for k, v in st.items():
            out[f"opt/{fqn}/{k}"] = v
    return {k: (v.dtype.__repr__(), v.tolist()) if isinstance(v, torch.Tensor) else v
            for k, v in out.items()}


def _save_job(url: str, storage_options: dict | None, step: int, seed: int,
              again: int | None = None) -> dict:
    import elastic_kit as ek

    info = ek.init_distributed()
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 3, seed)
    state = ek.TrainState(model, opt)
    state.step = step
    state.extras["note"] = f"saved at {info.world_size}"
    store = ek.CheckpointStore(url, storage_options=storage_options)
    assert state.sharded
    store.save(state.state_dict(), step=step, metadata={"epoch": 0})
    if again is not None:  # a second, newer checkpoint of the same state
        store.save(state.state_dict(), step=again, metadata={"epoch": 0})
    store.close()
    return {"full": _full(model, opt), "rank": info.rank}


def _load_job(url: str, storage_options: dict | None, seed: int, then_save: int | None) -> dict:
    import elastic_kit as ek

    info = ek.init_distributed()
    model = _model(seed + 1000)  # other initial weights: all must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ek.TrainState(model, opt)
    store = ek.CheckpointStore(url, storage_options=storage_options)
    if info.world_size == 1:  # the function form finds the layout in the TrainState
        loaded = ek.load_checkpoint(state, store)
    else:
        loaded = store.load(into=state.state_dict)
        state.load_state_dict(loaded.state)
    full = _full(model, opt)
    if then_save is not None:
        state.step = then_save
        store.save(state.state_dict(), step=then_save)
    store.close()
    return {"full": full, "step": loaded.step, "note": state.extras.get("note"),
            "world_size": loaded.world_size, "rank": info.rank}


def test_resharded_restore_2_3_1_2_is_bit_identical(tmp_path) -> None:
    url = str(tmp_path / "ckpt")
    saved = spawn_multi_process(2, _save_job, url, None, 5, 1)
    reference = saved[0]["full"]
    assert len(reference) == 6 + 6 * 3  # weights and biases; exp_avg, exp_avg_sq, step
    step = 5
    for world in (3, 1, 2):
        got = spawn_multi_process(world, _load_job, url, None, 1, step + 1)
        for r in got:
            assert r["step"] == step
            assert r["note"] == "saved at 2"
        assert got[0]["full"].keys() == reference.keys()
        assert got[0]["full"] == reference, f"world {world}"
        step += 1
    manifest = json.loads((tmp_path / "ckpt" / f"step-{step:012d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["format"].endswith("+sharded")
    # each of the two ranks wrote its own shard file, beside the replicated payload
    assert sorted(manifest["files"]) == ["shards-00000.bin", "shards-00001.bin", "state.pt"]


# ---------------------------------------------------------------------- Checkpointer
_GLOBAL_BATCH = 6


def _loop_job(url: str, stop_at: int | None) -> dict:
    """An own loop over a sharded model with ek.Checkpointer; returns early (as if
    killed, nothing closed, the last save committed) once ``state.step == stop_at``."""
    import elastic_kit as ek
    from torch.utils.data import DataLoader, TensorDataset

    info = ek.init_distributed()
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.arange(30), torch.randn(30, 5, generator=g),
                         torch.randn(30, 2, generator=g))
    sampler = ek.ElasticDistributedSampler(data, seed=3)
    loader = DataLoader(data, batch_size=_GLOBAL_BATCH // info.world_size, sampler=sampler)
    state = ek.TrainState(model, opt, sampler=sampler)
    # non-blocking saves (the default): each rank's shards are written in the background
    ckpt = ek.Checkpointer(state, url, every_steps=2, audit="error", handle_signals=False)
    seen: list[int] = []
    for epoch in range(ckpt.restore(), 2):
        sampler.set_epoch(epoch)
        for idx, x, y in loader:
            w = ckpt.sample_weights(len(x))
            loss = ((model(x) - y).square().mean(1) * w).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen.extend(idx.tolist())
            ckpt.step(len(x))
            if state.step == stop_at:  # killed once the background save committed
                ckpt.store.wait()
                return {"stopped": state.step, "restored": ckpt.restored_step}
        ckpt.end_epoch()
    ckpt.close()
    return {"full": _full(model, opt), "report": state.run_report(),
            "restored": ckpt.restored_step, "step": state.step}


def _close(a: dict, b: dict) -> bool:
    for k in a:
        x, y = torch.tensor(a[k][1]), torch.tensor(b[k][1])
        if not torch.allclose(x, y, rtol=1e-5, atol=1e-6):
            return False
    return a.keys() == b.keys()


def test_checkpointer_resumes_fsdp_training_across_world_sizes(tmp_path) -> None:
    plain = spawn_multi_process(2, _loop_job, str(tmp_path / "plain"), None)[0]
    assert plain["step"] == 10 and plain["restored"] is None
    # unchanged world size: 2 -> killed after step 3 -> 2: bitwise the uninterrupted run
    url = str(tmp_path / "same")
    assert spawn_multi_process(2, _loop_job, url, 3)[0]["stopped"] == 3
    same = spawn_multi_process(2, _loop_job, url, None)[0]
    assert same["restored"] == 2 and same["step"] == 10
    assert same["full"] == plain["full"]
    # 2 -> 3 -> 1 ranks, each killed between saves: the same run within fp32 rounding
    url = str(tmp_path / "elastic")
    assert spawn_multi_process(2, _loop_job, url, 3)[0]["stopped"] == 3
    assert spawn_multi_process(3, _loop_job, url, 7)[0] == {"stopped": 7, "restored": 2}
    last = spawn_multi_process(1, _loop_job, url, None)[0]
    assert last["restored"] == 6 and last["step"] == 10
    assert _close(last["full"], plain["full"])  # reduction order differs: not bitwise
    # every sample of both epochs trained exactly once, across the reshards
    assert [(a["epoch"], a["count"], a["ok"]) for a in last["report"]["audit"]] == [
        (0, 30, True), (1, 30, True)]
    assert [w["world_size"] for w in last["report"]["world_sizes"]] == [2, 3, 1]


# ---------------------------------------------------------------------- corruption
def _entries(root, step: int, file: str) -> list[dict]:
    m = json.loads((root / f"step-{step:012d}" / "manifest.json").read_text())
    return [c for c in m["sharded"]["chunks"] if c["file"] == file]


@pytest.mark.parametrize("where", ["inside a chunk read in part", "in a chunk read whole"])
def test_a_flipped_byte_in_any_shard_is_detected_and_the_older_step_loads(
        tmp_path, where: str) -> None:
    root = tmp_path / "ckpt"
    saved = spawn_multi_process(2, _save_job, str(root), None, 5, 1, 6)
    # rank 1 holds rows 4-6 of the first weight (7 rows; 4 per rank at 2 ranks)
    chunk = next(c for c in _entries(root, 6, "shards-00001.bin")
                 if c["offsets"] == [4, 0])
    assert chunk["entry"]["shape"] == [3, 5]
    # at 3 ranks rank 1 owns rows 3-5: row 4 is read as part of a chunk; at 1 rank
    # every chunk is read whole and checked against its checksum
    world = 3 if where.startswith("inside") else 1
    at = chunk["entry"]["offset"] + 4 * 5 + 2  # row 5, element 0, third byte
    path = root / "step-000000000006" / "shards-00001.bin"
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    got = spawn_multi_process(world, _load_job, str(root), None, 1, None)
    assert [r["step"] for r in got] == [5] * world  # step 6 refused on every rank
    assert got[0]["full"] == saved[0]["full"]
    # the store's own deep verification names the damaged file too
    from elastic_kit.store import CheckpointStore

    problems = {step: p for step, _, p in CheckpointStore(str(root)).verify()}
    assert problems[5] is None and "shards-00001.bin" in problems[6]


@pytest.mark.s3
def test_resharded_restore_from_an_object_store(s3_bucket) -> None:  # noqa: F811
    url, opts = s3_bucket
    saved = spawn_multi_process(2, _save_job, f"{url}/run", opts, 3, 1)
    got = spawn_multi_process(3, _load_job, f"{url}/run", opts, 1, None)
    assert [r["step"] for r in got] == [3, 3, 3]
    assert got[0]["full"] == saved[0]["full"]


# ---------------------------------------------------------------------- placements
def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"a": torch.randn(7, 10, generator=g), "b": torch.randn(5, 9, generator=g),
            "c": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "d": torch.randn(6, generator=g).to(torch.bfloat16)}


def _placements_job(url: str, layout: dict[str, str], save: bool) -> dict:
    """Save (or load) DTensors of ``_tensors()`` with the placements ``layout`` names."""
    import elastic_kit as ek
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    info = ek.init_distributed()
    mesh = init_device_mesh("cpu", (info.world_size,))
    kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    full = _tensors()
    state = {"t": {k: distribute_tensor(v if save else torch.zeros_like(v), mesh,
                                        [kinds[layout[k]]]) for k, v in full.items()},
             "plain": torch.ones(2), "n": 3}
    store = ek.CheckpointStore(url)
    if save:
        store.save(state, step=1)
        return {}
    loaded = store.load(into=state)
    got = loaded.state["t"]
    return {"equal": {k: torch.equal(got[k].full_tensor(), full[k]) for k in full},
            "placements": {k: str(got[k].placements[0]) for k in full},
            "plain": loaded.state["plain"].tolist(), "n": loaded.state["n"]}


def test_any_placement_loads_into_any_other(tmp_path) -> None:
    url = str(tmp_path / "ckpt")
    spawn_multi_process(2, _placements_job, url, {"a": "S1", "b": "R", "c": "S0", "d": "S0"},
                        True)
    m = json.loads((tmp_path / "ckpt" / "step-000000000001" / "manifest.json").read_text())
    b = [c for c in m["sharded"]["chunks"] if m["sharded"]["tensors"][c["tensor"]]["path"]
         == "['t']['b']"]
    assert [c["file"] for c in b] == ["shards-00000.bin"]  # a replicated tensor: written once
    # column shards read into row shards and back, a replicated one into shards
    got = spawn_multi_process(3, _placements_job, url,
                              {"a": "S0", "b": "S1", "c": "S1", "d": "R"}, False)
    for r in got:
        assert r["equal"] == {"a": True, "b": True, "c": True, "d": True}
        assert r["placements"] == {"a": "S(0)", "b": "S(1)", "c": "S(1)", "d": "R"}
        assert r["plain"] == [1.0, 1.0] and r["n"] == 3


# ---------------------------------------------------------------------- faults
def _faulty_job(root: str) -> dict:
    import errno

    import fsspec

    import elastic_kit as ek
    from elastic_kit.testing import FaultFileSystem

    info = ek.init_distributed()
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 1, 1)
    state = ek.TrainState(model, opt)
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    store = ek.CheckpointStore(root, filesystem=ffs)
    store.save(state.state_dict(), step=1)
    if info.rank == 1:  # this rank's disk fills up half way through its shards
        ffs.add("write", match="shards-00001", after_bytes=100,
                error=OSError(errno.ENOSPC, "No space left on device"))
    _train(model, opt, 1, 2)
    try:
        store.save(state.state_dict(), step=2)
        raised = None
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    steps = [i.step for i in store.list()]
    loaded = store.load(into=state.state_dict)
    return {"raised": raised, "steps": steps, "loaded": loaded.step}


def test_a_rank_that_cannot_write_its_shards_fails_the_save_on_every_rank(tmp_path) -> None:
    root = tmp_path / "ckpt"
    got = spawn_multi_process(2, _faulty_job, str(root))
    assert got[1]["raised"].startswith("OSError: [Errno 28] cannot write checkpoint file ")
    assert "/step-000000000002/shards-00001" in got[1]["raised"]
    assert got[1]["raised"].endswith(": no space left on device")
    assert "rank 1 could not write its shards" in got[0]["raised"]
    for r in got:
        assert r["steps"] == [1] and r["loaded"] == 1  # nothing of step 2 committed
    assert not (root / "step-000000000002" / "manifest.json").exists()
    assert not list(root.glob("step-000000000002/shards-*"))  # its files removed


def _resave_job(root: str) -> dict:
    import elastic_kit as ek

    ek.init_distributed()
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ek.TrainState(model, opt)
    store = ek.CheckpointStore(root, keep_last=1)
    _train(model, opt, 1, 1)
    store.save(state.state_dict(), step=1)
    first = sorted(store.list()[-1].manifest.files)
    _train(model, opt, 1, 2)
    store.save(state.state_dict(), step=1)  # the same step again: replaced, never uncommitted
    second = sorted(store.list()[-1].manifest.files)
    resaved = _full(model, opt)
    store.load(into=state.state_dict)  # reads the replacement
    again = _full(model, opt)
    _train(model, opt, 1, 3)
    store.save(state.state_dict(), step=2)
    store.close()
    return {"first": first, "second": second, "same": resaved == again,
            "steps": [i.step for i in store.list()]}


def test_a_resaved_step_switches_to_new_files_and_retention_keeps_the_newest(tmp_path) -> None:
    got = spawn_multi_process(2, _resave_job, str(tmp_path / "ckpt"))[0]
    assert got["first"] == ["shards-00000.bin", "shards-00001.bin", "state.pt"]
    assert len(got["second"]) == 3 and not set(got["second"]) & set(got["first"])
    assert got["same"] is True
    assert got["steps"] == [2]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000000000002"]


# ---------------------------------------------------------------------- background saves
def _background_job(url: str, storage_options: dict | None = None) -> dict:
    """Non-blocking sharded saves while training goes on: each checkpoint holds the
    state of the moment save() returned, not what training made of it afterwards."""
    import elastic_kit as ek

    info = ek.init_distributed()
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ek.TrainState(model, opt)
    store = ek.CheckpointStore(url, keep_last=None, storage_options=storage_options)
    at_save = {}
    handles = []
    for step in (1, 2, 3):
        _train(model, opt, 1, step)
        at_save[step] = _full(model, opt)
        handles.append(store.save(state.state_dict(), step=step, blocking=False))
        _train(model, opt, 2, 10 + step)  # changes every parameter while the save runs
    for h in handles:
        h.wait()
    done = [h.committed.done() and h.committed.exception() is None for h in handles]
    store.close()
    return {"at_save": at_save, "done": done, "rank": info.rank}


def test_background_sharded_saves_hold_the_state_of_their_step(tmp_path) -> None:
    url = str(tmp_path / "ckpt")
    saved = spawn_multi_process(2, _background_job, url)
    assert [r["done"] for r in saved] == [[True] * 3] * 2  # committed on every rank
    got = spawn_multi_process(3, _load_job, url, None, 1, None)
    assert got[0]["step"] == 3
    assert got[0]["full"] == saved[0]["at_save"][3]
    assert saved[0]["at_save"][3] != saved[0]["at_save"][2]


def test_a_manifest_that_misplaces_shards_is_caught_by_the_digest(tmp_path) -> None:
    """Every file intact, the index edited so that two shards trade places: only the
    global digest can tell, and the step is refused for the one before."""
    root = tmp_path / "ckpt"
    saved = spawn_multi_process(2, _save_job, str(root), None, 5, 1, 6)
    path = root / "step-000000000006" / "manifest.json"
    m = json.loads(path.read_text())
    by_tensor: dict[int, list[dict]] = {}
    for c in m["sharded"]["chunks"]:
        by_tensor.setdefault(c["tensor"], []).append(c)
    # a tensor split evenly (the second weight: 4 rows, 2 per rank)
    mine = next(cs for cs in by_tensor.values()
                if len(cs) == 2 and cs[0]["entry"]["shape"] == cs[1]["entry"]["shape"])
    mine[0]["offsets"], mine[1]["offsets"] = mine[1]["offsets"], mine[0]["offsets"]
    path.write_text(json.dumps(m))
    got = spawn_multi_process(3, _load_job, str(root), None, 1, None)
    assert [r["step"] for r in got] == [5, 5, 5]
    assert got[0]["full"] == saved[0]["full"]


@pytest.mark.s3
def test_background_sharded_saves_to_an_object_store(s3_bucket) -> None:  # noqa: F811
    url, opts = s3_bucket
    saved = spawn_multi_process(2, _background_job, f"{url}/bg", opts)
    assert [r["done"] for r in saved] == [[True] * 3] * 2
    got = spawn_multi_process(3, _load_job, f"{url}/bg", opts, 1, None)
    assert got[0]["step"] == 3 and got[0]["full"] == saved[0]["at_save"][3]


# ---------------------------------------------------------------------- read faults
def _read_fault_job(root: str, times: int | None) -> dict:
    """Load with the shard reads of rank 1 failing ``times`` times (None: always)."""
    import fsspec

    import elastic_kit as ek
    from elastic_kit.testing import FaultFileSystem

    info = ek.init_distributed()
    model = _model(1000)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ek.TrainState(model, opt)
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    if info.rank == 1:
        ffs.add("cat", match="shards-", times=times,
                error=ConnectionResetError(104, "Connection reset by peer"))
    store = ek.CheckpointStore(root, filesystem=ffs, read_attempts=3)
    try:
        loaded = store.load(into=state.state_dict)
    except Exception as e:
        return {"raised": f"{type(e).__name__}: {e}", "fired": ffs.fired("cat")}
    state.load_state_dict(loaded.state)
    return {"step": loaded.step, "full": _full(model, opt), "fired": ffs.fired("cat")}


def test_a_failed_range_read_is_retried_and_a_lasting_one_raised_not_skipped(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    saved = spawn_multi_process(2, _save_job, root, None, 5, 1, 6)
    got = spawn_multi_process(3, _read_fault_job, root, 2)
    assert got[1]["fired"] == 2 and [r["step"] for r in got] == [6, 6, 6]  # retried
    assert got[0]["full"] == saved[0]["full"]
    got = spawn_multi_process(3, _read_fault_job, root, None)
    # a read that keeps failing proves nothing about step 6: raised on every rank,
    # never taken for corruption (which would fall back to step 5)
    assert all("rank 1 could not read" in r["raised"] for r in got), got
    assert "Connection reset" in got[1]["raised"]


def test_a_sharded_checkpoint_loads_whole_without_a_target_layout(tmp_path) -> None:
    # e.g. evaluation in one plain process: store.load() with no ``into`` gives every
    # sharded tensor whole, checked against its saved digest
    import elastic_kit as ek

    url = str(tmp_path / "ckpt")
    saved = spawn_multi_process(2, _save_job, url, None, 5, 1)
    reference = saved[0]["full"]
    loaded = ek.CheckpointStore(url).load()
    assert loaded is not None and loaded.step == 5
    weights = {f"model/{k}": (v.dtype.__repr__(), v.tolist())
               for k, v in loaded.state["model"].items()}
    assert weights == {k: v for k, v in reference.items() if k.startswith("model/")}


def _load_into_a_dict_of_dtensors(url: str, sharded: bool) -> dict:
    """The DCP pattern on FSDP2: ``{"model": model.state_dict()}`` holds DTensors that
    share storage with the parameters; loading into it reaches the model."""
    import elastic_kit as ek

    info = ek.init_distributed()
    if sharded:  # every rank writes its shards
        saved = _model(3)
        ek.save_checkpoint({"model": saved.state_dict(), "epoch": 2}, url, step=5)
    else:  # a plain model's state, written by rank 0 alone
        torch.manual_seed(3)
        plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 4),
                                    torch.nn.Linear(4, 2))
        if info.rank == 0:
            ek.save_checkpoint({"model": plain.state_dict(), "epoch": 2}, url, step=5)
        torch.distributed.barrier()
    model = _model(4)  # other weights: all must come from the checkpoint
    state = {"model": model.state_dict(), "epoch": 0}
    loaded = ek.load_checkpoint(state, url)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return {"step": loaded.step, "epoch": state["epoch"], "full": _full(model, opt),
            "rank": info.rank}


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "whole"])
def test_a_dict_of_fsdp_state_dicts_loads_into_the_model_itself(tmp_path, sharded) -> None:
    res = spawn_multi_process(2, _load_into_a_dict_of_dtensors, str(tmp_path / "ck"), sharded)
    torch.manual_seed(3)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 4),
                                torch.nn.Linear(4, 2))
    expected = {f"model/{k}": (v.dtype.__repr__(), v.tolist())
                for k, v in plain.state_dict().items()}
    full = next(r["full"] for r in res if r["rank"] == 0)
    assert {k: v for k, v in full.items() if k.startswith("model/")} == expected
    assert [(r["step"], r["epoch"]) for r in res] == [(5, 2), (5, 2)]


def _load_fp32_into_bf16(url: str) -> dict:
    import elastic_kit as ek

    info = ek.init_distributed()
    ek.save_checkpoint({"model": _model(3).state_dict()}, url, step=5)
    model = _model(4).to(torch.bfloat16)  # fine-tuning in bf16 from an fp32 checkpoint
    ek.load_checkpoint({"model": model.state_dict()}, url)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    return {"rank": info.rank, "full": {k: (repr(v.dtype), v.float().tolist())
                                        for k, v in full.items()}}


def test_a_sharded_checkpoint_loads_converted_to_the_dtype_the_dict_holds(tmp_path) -> None:
    res = spawn_multi_process(2, _load_fp32_into_bf16, str(tmp_path / "ck"))
    torch.manual_seed(3)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 4),
                                torch.nn.Linear(4, 2))
    expected = {k: ("torch.bfloat16", v.bfloat16().float().tolist())
                for k, v in plain.state_dict().items()}
    assert next(r["full"] for r in res if r["rank"] == 0) == expected


def _plain_trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 4),
                                torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    _train(plain, opt, steps=2, seed=1)
    return plain, opt


def _unsharded_into_sharded_train_state(url: str) -> dict:
    import elastic_kit as ek

    info = ek.init_distributed()
    if info.rank == 0:  # an unsharded (DDP) job's checkpoint: rank 0 writes it
        plain, opt = _plain_trained()
        ek.save_checkpoint(ek.TrainState(plain, opt), url, step=5)
    torch.distributed.barrier()
    model = _model(4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = ek.TrainState(model, opt)
    loaded = ek.load_checkpoint(state, url)
    full = _full(model, opt)
    _train(model, opt, steps=1, seed=2)  # the moments are DTensors: a step works
    return {"rank": info.rank, "step": loaded.step, "full": full}


def test_an_unsharded_jobs_checkpoint_loads_into_a_sharded_train_state(tmp_path) -> None:
    """DDP today, FSDP2 tomorrow: each rank takes its part of the whole tensors, and
    the optimizer state saved by position is matched to the parameters by name."""
    res = spawn_multi_process(2, _unsharded_into_sharded_train_state, str(tmp_path / "ck"))
    plain, opt = _plain_trained()
    names = [n for n, _ in plain.named_parameters()]
    expected = {f"model/{k}": (v.dtype.__repr__(), v.tolist())
                for k, v in plain.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            expected[f"opt/{names[i]}/{k}"] = (v.dtype.__repr__(), v.tolist())
    full = next(r["full"] for r in res if r["rank"] == 0)
    assert full == expected
    assert [r["step"] for r in res] == [5, 5]


def _read_whole_into_train_state(url: str) -> dict:
    import elastic_kit as ek

    info = ek.init_distributed()
    model = _model(3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, steps=2, seed=1)
    store = ek.CheckpointStore(url)
    store.save(ek.TrainState(model, opt).state_dict(), step=4)
    saved = _full(model, opt)
    model2 = _model(4)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    state = ek.TrainState(model2, opt2)
    state.load_state_dict(store.load().state)  # no into=: every tensor read whole
    store.close()
    loaded = _full(model2, opt2)
    _train(model2, opt2, steps=1, seed=2)  # the moments are DTensors: a step works
    _train(model, opt, steps=1, seed=2)
    return {"rank": info.rank, "saved": saved, "loaded": loaded,
            "same_step": _full(model2, opt2) == _full(model, opt)}


def test_a_sharded_checkpoint_read_whole_loads_into_a_train_state(tmp_path) -> None:
    res = spawn_multi_process(2, _read_whole_into_train_state, str(tmp_path / "ck"))
    r0 = next(r for r in res if r["rank"] == 0)
    assert r0["loaded"] == r0["saved"] and len(r0["saved"]) > 6
    assert r0["same_step"]


def _sharded_save_on_rank_0_only(url: str) -> dict:
    import elastic_kit as ek

    info = ek.init_distributed()
    model = _model(3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, steps=1, seed=1)
    store = ek.CheckpointStore(url, load_timeout=2.0)
    store.save(ek.TrainState(model, opt).state_dict(), step=1)  # every rank: fine
    error = ""
    if info.rank == 0:  # the habit torch.save teaches, with sharded state
        try:
            store.save(ek.TrainState(model, opt).state_dict(), step=2)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    steps = [i.step for i in store.list()]
    store.close()
    return {"rank": info.rank, "error": error, "steps": steps}


def test_a_blocking_sharded_save_on_some_ranks_only_fails_clearly(tmp_path) -> None:
    """Its collectives would pair with the other ranks' own (gloo aborts the process
    on the size mismatch, NCCL may hang): a handshake fails it within load_timeout."""
    res = spawn_multi_process(2, _sharded_save_on_rank_0_only, str(tmp_path / "ck"))
    r0 = next(r for r in res if r["rank"] == 0)
    assert r0["error"].startswith(
        "CheckpointError: save() of sharded state is collective: call it on every rank. "
        "Rank 0 waited 2 s (load_timeout) in sharded save() call #2 on "), r0["error"]
    assert r0["steps"] == [1]


def _ema_job(url: str, world_then: int) -> dict:
    """An FSDP2 model's EMA kept in TrainState extras as a dict of DTensors (the
    sharded form of ``extras={"ema": ema}``): saved at one world size, restored at
    another; returns the restored EMA, gathered."""
    import elastic_kit as ek

    ek.init_distributed()
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = ek.TrainState(model, opt, extras={"ema": ema, "count": torch.tensor(0)})
    ckpt = ek.Checkpointer(state, url, snapshot_every=0, handle_signals=False)
    ckpt.restore()
    if ckpt.restored_step is None:
        _train(model, opt, 2, seed=5)
        with torch.no_grad():
            for n, p in model.named_parameters():
                ema[n].mul_(0.5).add_(p.detach(), alpha=0.5)
        state.extras["count"] += 2
        state.step = 2
        ckpt.save(blocking=True)
    restored = state.extras["ema"]
    out = {"step": ckpt.restored_step, "count": int(state.extras["count"]),
           "dtensor": all(type(v).__name__ == "DTensor" for v in restored.values()),
           "ema": {n: v.full_tensor().tolist() for n, v in restored.items()}}
    ckpt.close()
    return out


def test_a_dict_of_dtensors_in_extras_is_saved_and_resharded(tmp_path) -> None:
    """TrainState refused it (as if torch.save were to write it): the job died at its
    first snapshot or save, on every rank and every restart."""
    url = str(tmp_path / "ck")
    saved = spawn_multi_process(2, _ema_job, url, 2)[0]
    assert saved["step"] is None and saved["dtensor"]
    restored = spawn_multi_process(3, _ema_job, url, 3)[0]
    assert restored["step"] == 2 and restored["count"] == 2 and restored["dtensor"]
    assert restored["ema"] == saved["ema"]
