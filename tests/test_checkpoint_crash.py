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

from elastic_kit.checkpoint import CheckpointStore
from elastic_kit.checkpoint.fs import TMP_PREFIX

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
    # the next successful save removes what the killed ones left behind
    store.save(_state(100), step=100)
    store.wait()  # cleaning runs beside training after a blocking save
    assert not [n for n in os.listdir(root) if n.startswith(TMP_PREFIX)]
