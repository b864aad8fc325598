"""The CUDA paths: NCCL init and device selection, DDP placement, pinned non-blocking
saves of CUDA tensors, node-local broadcast over NCCL, map_location, and an
ElasticLoop run on the GPU that is stopped by SIGTERM and resumed.

Skipped as a whole without CUDA (the reason is on the allow-list of tests/conftest.py);
the two-rank NCCL tests need two GPUs (one per rank: NCCL refuses two ranks on one
device) and skip on a single-GPU machine with an allowed reason. Run them with
``scripts/gpu-check``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.testing import spawn_multi_process

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices")


def _ranks() -> int:
    """As many NCCL ranks as GPUs, at most 2."""
    return min(2, _gpus())


# --- rank functions (module level: spawn_multi_process pickles them) -----------------

def _init_and_devices(_: Any) -> dict[str, Any]:
    info = ek.init_distributed()
    t = torch.tensor([float(info.rank + 1)], device=info.device)
    torch.distributed.all_reduce(t)
    return {"backend": info.backend, "device": str(info.device),
            "current": torch.cuda.current_device(), "sum": float(t.item()),
            "rank": info.rank, "world": info.world_size}


def _sum_without_device_sync(_: Any) -> dict[str, Any]:
    from elastic_kit.distributed import all_reduce_sum_async

    info = ek.init_distributed()
    result = all_reduce_sum_async(torch.tensor([info.rank + 1, 7], dtype=torch.int64))
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device work queued after the sum
    total = result()
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return {"sum": total.tolist(), "device": str(total.device), "busy": still_busy}


def _wrap_ddp_placement(_: Any) -> dict[str, Any]:
    info = ek.init_distributed()
    model = ek.wrap_ddp(nn.Linear(4, 3))
    out = model(torch.randn(2, 4, device=info.device))
    out.sum().backward()
    return {"type": type(model).__name__, "device_ids": list(model.device_ids or []),
            "output_device": model.output_device,
            "param_devices": sorted({str(p.device) for p in model.parameters()}),
            "grad_devices": sorted({str(p.grad.device) for p in model.parameters()}),
            "rank": info.rank}


def _node_local_load(cfg: dict[str, Any]) -> dict[str, Any]:
    # two "nodes" on one machine: one GPU each, as an agent with CUDA_VISIBLE_DEVICES would
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["RANK"]
    info = ek.init_distributed()
    store = ek.CheckpointStore(cfg["url"], node_local=True)
    loaded = store.load(map_location=cfg["map_location"])
    assert loaded is not None
    state = loaded.state
    store.close()
    return {"step": loaded.step, "rank": info.rank, "backend": info.backend,
            "devices": sorted({str(t.device) for t in state["model"].values()}),
            "sums": {k: float(t.double().sum()) for k, t in state["model"].items()},
            "epoch": state["epoch"]}


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x.sum(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def _loop_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train a small model on the GPU; SIGTERM this rank at ``cfg['kill_at']``."""
    info = ek.init_distributed()
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = ek.TrainState(model, opt)
    criterion = nn.CrossEntropyLoss(reduction="none")
    devices: set[str] = set()

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        devices.add(str(x.device))
        return criterion(m(x), y)

    def on_step(state: ek.TrainState, step: ek.StepInfo) -> None:
        if cfg["kill_at"] is not None and step.step == cfg["kill_at"]:
            os.kill(os.getpid(), signal.SIGTERM)  # what torchrun sends before a restart

    loop = ek.ElasticLoop(
        state, _data(), loss_fn=loss_fn, store=ek.CheckpointStore(cfg["url"]),
        on_step_end=on_step,
        config=ek.LoopConfig(epochs=2, global_batch_size=8, micro_batch_size=4,
                             checkpoint=ek.CheckpointerConfig(every_steps=2,
                                                              handle_signals=True),
                             max_steps=cfg["max_steps"], log_every=0, progress_bar=False,
                             pin_memory=True))
    code = None
    try:
        loop.run()
    except SystemExit as e:
        code = e.code
    params = {k: v.detach().cpu().numpy().copy()
              for k, v in ek.unwrap_model(model).state_dict().items()}
    return {"exit": code, "step": state.step, "restored": loop.restored_step,
            "devices": sorted(devices), "params": params, "rank": info.rank}


# --- tests ---------------------------------------------------------------------------

def test_init_distributed_picks_nccl_and_one_device_per_local_rank() -> None:
    n = _ranks()
    out = spawn_multi_process(n, _init_and_devices, None, timeout=300, cuda=True)
    assert [r["backend"] for r in out] == ["nccl"] * n
    assert [r["device"] for r in out] == [f"cuda:{r}" for r in range(n)]
    assert [r["current"] for r in out] == list(range(n))
    assert [r["sum"] for r in out] == [float(n * (n + 1) // 2)] * n


def test_an_async_sum_over_nccl_is_read_without_waiting_for_later_device_work() -> None:
    n = _ranks()
    out = spawn_multi_process(n, _sum_without_device_sync, None, timeout=300, cuda=True)
    for r in out:
        assert r["sum"] == [n * (n + 1) // 2, 7 * n] and r["device"] == "cpu"
        assert r["busy"]  # the sleep queued after the sum was still running


def test_wrap_ddp_places_the_model_on_the_workers_device() -> None:
    n = _ranks()
    out = spawn_multi_process(n, _wrap_ddp_placement, None, timeout=300, cuda=True)
    for r in out:
        assert r["type"] == "DistributedDataParallel"
        assert r["device_ids"] == [r["rank"]] and r["output_device"] == r["rank"]
        assert r["param_devices"] == [f"cuda:{r['rank']}"] == r["grad_devices"]


def _cuda_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(1 << 18, generator=g).cuda() for i in range(4)},
            "step": 7}


def test_nonblocking_save_stages_cuda_tensors_in_pinned_memory(tmp_path: Path) -> None:
    state = _cuda_state()
    expected = {k: v.cpu().clone() for k, v in state["model"].items()}
    nbytes = sum(v.numel() * v.element_size() for v in state["model"].values())
    pinned0 = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    with ek.CheckpointStore(str(tmp_path / "ckpt"), info=ek.DistInfo()) as store:
        store.save(state, step=1, blocking=False)
        # the copies were made inside save(): changing the tensors now is safe
        for v in state["model"].values():
            v.add_(1.0)
        store.wait()
        pinned = torch.cuda.host_memory_stats().get("active_bytes.current", 0) - pinned0
        loaded = store.load(map_location="cpu")
    assert pinned >= nbytes  # the reused staging buffers are pinned host memory
    assert loaded is not None and loaded.step == 1
    for k, v in expected.items():
        assert torch.equal(loaded.state["model"][k], v), k


def test_copy_later_sees_queued_work_and_ignores_changes_after_wait_staged(
        tmp_path: Path) -> None:
    state = _cuda_state()
    tensors = list(state["model"].values())
    for v in tensors:
        v.mul_(2.0)  # queued on the stream, not synchronized: the save must include it
    expected = {k: v.cpu().clone() for k, v in state["model"].items()}
    with ek.CheckpointStore(str(tmp_path / "ckpt"), info=ek.DistInfo()) as store:
        store.save(state, step=3, blocking=False, copy_later=tensors)
        y = sum(v.sum() for v in tensors)  # "forward/backward": reads only
        store.wait_staged()  # before the "optimizer step"
        for v in tensors:
            v.sub_(100.0)
        store.wait()
        loaded = store.load(map_location="cpu")
    assert torch.isfinite(y)
    assert loaded is not None and loaded.step == 3
    for k, v in expected.items():
        assert torch.equal(loaded.state["model"][k], v), k


@pytest.mark.parametrize("map_location,device", [("cpu", "cpu"), ("cuda:0", "cuda:0"),
                                                 (None, "cpu")])
def test_load_map_location(tmp_path: Path, map_location: Any, device: str) -> None:
    """Checkpoints hold CPU tensors (staged off the GPU); map_location moves them."""
    state = _cuda_state()
    expected = {k: v.cpu() for k, v in state["model"].items()}
    with ek.CheckpointStore(str(tmp_path / "ckpt"), info=ek.DistInfo()) as store:
        store.save(state, step=2)
        loaded = store.load(map_location=map_location)
    assert loaded is not None
    for k, v in loaded.state["model"].items():
        assert str(v.device) == device, k
        assert torch.equal(v.cpu(), expected[k]), k


def _on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            width: int) -> tuple[nn.Module, torch.optim.Optimizer, str]:
    """A ``Linear(width, width)`` on the GPU, its SGD optimizer and a durable store's
    URL, with snapshots in this test's own directory."""
    (tmp_path / "shm").mkdir()
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_DIR", str(tmp_path / "shm"))
    model = nn.Linear(width, width).cuda()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), str(tmp_path / "ckpt")


@pytest.mark.parametrize("snapshot_every", [None, 1], ids=["durable", "snapshot"])
def test_restore_onto_the_gpu_restores_the_random_generators(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, snapshot_every: Any) -> None:
    """``restore(map_location="cuda:0")`` moves the generators' saved states to the
    device too; each generator still takes its state back (numpy's failed)."""
    import random

    import numpy as np
    model, opt, url = _on_gpu(tmp_path, monkeypatch, 8)
    # left by abandon(), as by a failure: a clean close() removes the snapshots
    ck = ek.Checkpointer(ek.TrainState(model, opt), url, handle_signals=False,
                         snapshot_every=snapshot_every, info=ek.DistInfo(run_id="j"))
    ck.restore()
    model(torch.ones(2, 8, device="cuda")).sum().backward()
    opt.step()
    torch.manual_seed(11), np.random.seed(12), random.seed(13)
    ck.step(2)
    if snapshot_every is None:
        ck.save(blocking=True)
    expected = (torch.rand(3), np.random.rand(3), random.random(),
                torch.rand(3, device="cuda").cpu())
    weights = model.weight.detach().clone()
    ck.abandon()
    with torch.no_grad():
        model.weight.zero_()
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    with ek.Checkpointer(ek.TrainState(model, opt), url, handle_signals=False,
                         snapshot_every=snapshot_every, info=ek.DistInfo(run_id="j")) as ck:
        ck.restore(map_location="cuda:0")
        assert ck.restored_step == 1
        assert ck.restored_from == ("memory" if snapshot_every else "store")
        got = (torch.rand(3), np.random.rand(3), random.random(),
               torch.rand(3, device="cuda").cpu())
    assert torch.equal(model.weight, weights)
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and torch.equal(got[3], expected[3])


def test_the_last_step_is_written_past_a_stream_that_hangs(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that exits alone writes the state of its last step from a stream of its
    own that waits only for that step's end: a collective that hangs on the training
    stream (here a long sleep kernel queued there) neither delays nor blocks it."""
    model, opt, url = _on_gpu(tmp_path, monkeypatch, 64)
    ck = ek.Checkpointer(ek.TrainState(model, opt), url, handle_signals=False,
                         snapshot_every=1000, info=ek.DistInfo(run_id="j"))
    ck.restore()
    assert ck.snapshots is not None
    for step in (1, 2, 3):
        model(torch.ones(2, 64, device="cuda")).sum().backward()
        opt.step()
        ck.step(2)
        if step < 3:  # the two snapshot files made and registered, as in a run
            ck.snapshot()
            assert ck.snapshots.wait(timeout=60)
    weights = model.weight.detach().cpu()
    torch.cuda._sleep(40_000_000_000)       # ~20 s of the training stream: the hang
    ck._snapshot_at_exit()                  # what abandon() writes, the write waited for
    assert ck.snapshots.wait(timeout=60)
    hung = not torch.cuda.current_stream().query()
    written = list(ck.snapshots.written)
    torch.cuda.synchronize()
    ck.abandon()
    assert hung, "the last step's write waited for the hung stream"
    assert written == [1, 2, 3]
    with ek.Checkpointer(ek.TrainState(model, opt), url, handle_signals=False,
                         snapshot_every=1000, info=ek.DistInfo(run_id="j")) as again:
        with torch.no_grad():
            model.weight.zero_()
        again.restore(map_location="cuda:0")
        assert again.restored_step == 3 and again.restored_from == "memory"
    assert torch.equal(model.weight.cpu(), weights)


@needs_two_gpus
@pytest.mark.parametrize("map_location", ["cpu", "cuda:0"])
def test_node_local_broadcast_over_nccl(tmp_path: Path, map_location: Any) -> None:
    state = _cuda_state()
    state["epoch"] = 3
    sums = {k: float(v.double().sum()) for k, v in state["model"].items()}
    # only node 0 holds the checkpoint
    with ek.CheckpointStore(str(tmp_path / "node-0"), info=ek.DistInfo()) as s0:
        s0.save(state, step=5)
    url = str(tmp_path / "node-{node_rank}")
    out = spawn_multi_process(2, _node_local_load, {"url": url, "map_location": map_location},
                              local_world_size=1, timeout=300, cuda=True)
    for r in out:
        assert r["backend"] == "nccl" and r["step"] == 5 and r["epoch"] == 3
        assert r["devices"] == [map_location]  # each rank's own GPU is its cuda:0
        assert r["sums"] == pytest.approx(sums, rel=1e-12)
    # node 1 now holds its own copy
    with ek.CheckpointStore(str(tmp_path / "node-1"), info=ek.DistInfo()) as s1:
        assert [i.step for i in s1.list()] == [5]


def test_elastic_loop_on_gpu_resumes_after_sigterm_with_the_same_weights(
        tmp_path: Path) -> None:
    n = _ranks()
    full = spawn_multi_process(n, _loop_run, {"url": str(tmp_path / "full"), "kill_at": None,
                                              "max_steps": 6}, timeout=300, cuda=True)
    cut = str(tmp_path / "cut")
    first = spawn_multi_process(n, _loop_run, {"url": cut, "kill_at": 3, "max_steps": 6},
                                timeout=300, cuda=True)
    assert [r["exit"] for r in first] == [143] * n  # saved, then exited for a restart
    stopped = first[0]["step"]  # the ranks agree on the stop at a step boundary
    assert [r["step"] for r in first] == [stopped] * n and 3 <= stopped < 6
    second = spawn_multi_process(n, _loop_run, {"url": cut, "kill_at": None, "max_steps": 6},
                                 timeout=300, cuda=True)
    for r in second:
        assert r["restored"] == stopped and r["step"] == 6 and r["exit"] is None
        assert r["devices"] == [f"cuda:{r['rank']}"]
    ref, got = full[0]["params"], second[0]["params"]
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), k
