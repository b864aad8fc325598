"""SIGKILL in the middle of a save never costs the previous checkpoint.

A forked child saves a ~32 MB state over and over; the parent kills it with SIGKILL
at a random moment inside a save (it learns from a pipe when each save starts and
sleeps a random fraction of a measured save duration), then loads. Every load must
return a committed checkpoint whose content is exactly the state of its step.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import torch

from elastic_kit.store import CheckpointStore
from elastic_kit.store._backend_local import TMP_PREFIX

N = 8_000_000  # float32: 32 MB


def _state(step: int) -> dict:
    return {"w": torch.full((N,), float(step)), "step": step, "tail": torch.arange(8) * step}


def _save_forever(root: str, first_step: int, conn) -> None:
    torch.set_num_threads(1)
    store = CheckpointStore(root, keep_last=2)
    step = first_step
    while True:
        state = _state(step)
        conn.send(step)  # "a save of `step` starts now"
        store.save(state, step=step)
        step += 1


def test_sigkill_during_save_always_leaves_the_previous_checkpoint_loadable(tmp_path):
    root = str(tmp_path / "ck")
    store = CheckpointStore(root, keep_last=2)
    t0 = time.perf_counter()
    store.save(_state(0), step=0)
    save_s = max(time.perf_counter() - t0, 0.05)
    rng = random.Random(1234)
    ctx = mp.get_context("fork")
    interrupted, last_loaded = 0, 0
    for _ in range(6):
        first = (store.latest_step() or 0) + 1
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_save_forever, args=(root, first, send), daemon=True)
        child.start()
        recv.recv()
        if rng.random() < 0.5:  # sometimes let one save finish and kill the next one
            recv.recv()
        time.sleep(rng.uniform(0.0, 1.2 * save_s))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        interrupted += any(n.startswith(TMP_PREFIX) for n in os.listdir(root))

        loaded = CheckpointStore(root, keep_last=2).load()
        assert loaded is not None, "a crash in a save lost every checkpoint"
        assert loaded.step >= last_loaded, "load went back past a committed checkpoint"
        assert loaded.state["step"] == loaded.step
        w = loaded.state["w"]
        assert w.shape == (N,) and bool((w == float(loaded.step)).all())
        assert loaded.state["tail"].tolist() == [i * loaded.step for i in range(8)]
        assert all(p is None for _, _, p in store.verify(deep=False))
        last_loaded = loaded.step
    # the kills must really have hit saves in progress, or the test proves nothing
    assert interrupted >= 2, interrupted
    # The next successful save of a restarted writer (a new store) removes what the
    # killed ones left behind, once it is stale (here: at once; 10 minutes by default).
    # The old store object would refuse: other processes committed since it started.
    store = CheckpointStore(root, keep_last=2, stale_after_s=0)
    store.save(_state(100), step=100)
    store.wait()  # cleaning runs beside training after a blocking save
    assert not [n for n in os.listdir(root) if n.startswith(TMP_PREFIX)]


def _resave_forever(root: str, first_version: int, conn) -> None:
    torch.set_num_threads(1)
    store = CheckpointStore(root, keep_last=2)
    version = first_version
    while True:
        conn.send(("start", version))
        store.save({"w": torch.full((N,), float(version)), "version": version}, step=7)
        conn.send(("done", version))
        version += 1


def test_sigkill_during_a_resave_of_the_same_step_never_uncommits_it(tmp_path):
    """Re-saving a committed step switches its manifest atomically: a kill at any
    moment leaves step 7 committed, whole, at the newest version reported done."""
    root = str(tmp_path / "ck")
    CheckpointStore(root).save({"w": torch.full((N,), 0.0), "version": 0}, step=7)
    t0 = time.perf_counter()
    CheckpointStore(root).save({"w": torch.full((N,), 0.0), "version": 0}, step=7)
    save_s = max(time.perf_counter() - t0, 0.05)
    rng = random.Random(99)
    ctx = mp.get_context("forkserver")
    done, version = 0, 1
    for _ in range(6):
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_resave_forever, args=(root, version, send), daemon=True)
        child.start()
        recv.recv()
        time.sleep(rng.uniform(0.0, 1.5 * save_s))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        while recv.poll(0):
            try:
                kind, v = recv.recv()
            except EOFError:
                break
            version = max(version, v + 1)
            if kind == "done":
                done = max(done, v)
        loaded = CheckpointStore(root).load()
        assert loaded is not None and loaded.step == 7, "a killed re-save un-committed step 7"
        v = loaded.state["version"]
        assert v >= done, f"step 7 went back from version {done} to {v}"
        assert bool((loaded.state["w"] == float(v)).all())
