"""Options of the wrong type raise ``TypeError`` and wrong values ``ValueError``, as
in torch, each naming the option and what it expects; numpy and torch integers are
taken wherever an int is (sizes and seeds come out of arrays and tensors)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import elastic_kit as ek
from elastic_kit.errors import BatchPolicyError
from elastic_kit.loop import FixedGlobalBatch, LinearLRScaling


def _state() -> ek.TrainState:
    return ek.TrainState(torch.nn.Linear(1, 1))


def _store(tmp: Path, **kw: Any) -> ek.CheckpointStore:
    return ek.CheckpointStore(str(tmp / "ck"), **kw)


#: (label, call(tmp_path), exception, fragment of its message)
CASES: list[tuple[str, Callable[[Path], Any], type[Exception], str]] = [
    ("store url None", lambda t: ek.CheckpointStore(None), TypeError,
     "url=None: expected a path (str or os.PathLike) or fsspec URL, got NoneType"),
    ("store url int", lambda t: ek.CheckpointStore(5), TypeError, "url=5"),
    ("store url dict", lambda t: ek.CheckpointStore({"model": torch.zeros(9)}), TypeError,
     "url=<dict object>"),
    ("store url empty", lambda t: ek.CheckpointStore(""), ValueError, "url=''"),
    ("store keep_last str", lambda t: _store(t, keep_last="3"), TypeError,
     "keep_last='3': expected None or an int >= 1"),
    ("store keep_last 0", lambda t: _store(t, keep_last=0), ValueError,
     "keep_last=0: expected None or an int >= 1"),
    ("store io_timeout str", lambda t: _store(t, io_timeout="10"), TypeError,
     "io_timeout='10'"),
    ("store io_timeout 0", lambda t: _store(t, io_timeout=0), ValueError, "io_timeout=0"),
    ("store load_timeout bool", lambda t: _store(t, load_timeout=True), TypeError,
     "load_timeout=True"),
    ("store read_attempts float", lambda t: _store(t, read_attempts=2.0), TypeError,
     "read_attempts=2.0"),
    ("store checksum None", lambda t: _store(t, checksum=None), TypeError,
     "checksum=None: expected one of"),
    ("store checksum unknown", lambda t: _store(t, checksum="md5"), ValueError,
     "checksum='md5'"),
    ("store info str", lambda t: _store(t, info="cpu"), TypeError,
     "info='cpu': expected None or an ek.DistInfo"),
    ("prune str", lambda t: _store(t).prune("2"), TypeError, "keep='2': expected an int"),
    ("prune 0", lambda t: _store(t).prune(0), ValueError, "keep=0"),
    ("every_steps str", lambda t: ek.Checkpointer(_state(), None, every_steps="200"),
     TypeError, "every_steps='200'"),
    ("every_steps float", lambda t: ek.Checkpointer(_state(), None, every_steps=200.0),
     TypeError, "every_steps=200.0"),
    ("every_steps 0", lambda t: ek.Checkpointer(_state(), None, every_steps=0),
     ValueError, "every_steps=0"),
    ("blocking str", lambda t: ek.Checkpointer(_state(), None, blocking="no"), TypeError,
     "blocking='no': expected True or False"),
    ("every_seconds timedelta",
     lambda t: ek.Checkpointer(_state(), None, every_seconds=datetime.timedelta(seconds=60)),
     TypeError, "every_seconds=<datetime.timedelta object>"),
    ("every_seconds -1", lambda t: ek.CheckpointerConfig(every_seconds=-1), ValueError,
     "every_seconds=-1"),
    ("exit_code str", lambda t: ek.CheckpointerConfig(exit_code="143"), TypeError,
     "exit_code='143'"),
    ("exit_code 0", lambda t: ek.CheckpointerConfig(exit_code=0), ValueError,
     "exit_code=0: expected an int in [1, 255]"),
    ("config keep_last float", lambda t: ek.CheckpointerConfig(keep_last=3.0), TypeError,
     "keep_last=3.0"),
    ("snapshot_every float", lambda t: ek.CheckpointerConfig(snapshot_every=2.5), TypeError,
     "snapshot_every=2.5"),
    ("snapshot_every 'never'", lambda t: ek.CheckpointerConfig(snapshot_every="never"),
     ValueError, "snapshot_every='never'"),
    ("loop global_batch_size str", lambda t: ek.LoopConfig(global_batch_size="64"),
     TypeError, "global_batch_size='64': expected an int >= 1"),
    ("loop global_batch_size 0", lambda t: ek.LoopConfig(global_batch_size=0),
     BatchPolicyError, "global_batch_size=0 must be a positive int"),
    ("loop epochs str", lambda t: ek.LoopConfig(global_batch_size=64, epochs="3"),
     TypeError, "LoopConfig.epochs='3': expected an int >= 0"),
    ("loop micro_batch_size float",
     lambda t: ek.LoopConfig(global_batch_size=64, micro_batch_size=8.0), TypeError,
     "LoopConfig.micro_batch_size=8.0"),
    ("loop log_every -1", lambda t: ek.LoopConfig(global_batch_size=64, log_every=-1),
     ValueError, "LoopConfig.log_every=-1"),
    ("loop scheduler_interval int",
     lambda t: ek.LoopConfig(global_batch_size=64, scheduler_interval=1), TypeError,
     "LoopConfig.scheduler_interval=1"),
    ("loop batch_policy int", lambda t: ek.LoopConfig(global_batch_size=64, batch_policy=1),
     TypeError, "LoopConfig.batch_policy=1"),
    ("loop clip_grad_norm str",
     lambda t: ek.LoopConfig(global_batch_size=64, clip_grad_norm="1"), TypeError,
     "LoopConfig.clip_grad_norm='1'"),
    ("policy size str", lambda t: FixedGlobalBatch("64", 8), TypeError,
     "global_batch_size='64'"),
    ("policy size 0", lambda t: LinearLRScaling(0), BatchPolicyError,
     "batch_size=0 must be a positive int"),
    ("policy world size float", lambda t: LinearLRScaling(8).plan(2.0, 1), TypeError,
     "world_size=2.0"),
    ("seeded seed str", lambda t: ek.SeededDataset([1], seed="0"), TypeError,
     "seed='0': expected an int >= 0"),
    ("seeded seed -1", lambda t: ek.SeededDataset([1], seed=-1), ValueError, "seed=-1"),
]


@pytest.mark.parametrize("call, error, fragment", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_wrong_argument_is_refused_with_the_right_type(
        tmp_path: Path, call: Callable[[Path], Any], error: type[Exception],
        fragment: str) -> None:
    with pytest.raises(error) as caught:
        call(tmp_path)
    assert type(caught.value) is error  # a TypeError is no ValueError subclass here
    assert fragment in str(caught.value)


def test_numpy_integers_are_ints_everywhere(tmp_path: Path) -> None:
    n = np.int64
    store = _store(tmp_path, keep_last=n(2), read_attempts=n(2))
    assert store.keep_last == 2 and type(store.keep_last) is int
    store.save({"w": torch.ones(1)}, step=n(1))
    assert store.prune(n(1)) == [] and [i.step for i in store.list()] == [1]
    config = ek.LoopConfig(global_batch_size=n(64), epochs=n(3), micro_batch_size=n(8),
                           seed=torch.tensor(5), log_every=n(0), max_steps=n(9))
    assert (config.global_batch_size, config.epochs, config.micro_batch_size, config.seed,
            config.log_every, config.max_steps) == (64, 3, 8, 5, 0, 9)
    assert all(type(v) is int for v in (config.global_batch_size, config.epochs, config.seed))
    plan = config.policy().plan(n(4), 1)
    assert (plan.world_size, plan.per_rank) == (4, 16) and type(plan.world_size) is int
    policy = FixedGlobalBatch(n(32), n(8))
    assert (type(policy.global_batch_size), type(policy.micro_batch_size)) == (int, int)
    seeded = ek.SeededDataset([torch.zeros(1)], seed=n(3))
    assert seeded.seed == 3 and type(seeded.seed) is int
    cfg = ek.CheckpointerConfig(keep_last=n(4), exit_code=n(99), every_seconds=np.float64(5))
    assert (cfg.keep_last, cfg.exit_code, cfg.every_seconds) == (4, 99, 5.0)
    assert type(cfg.exit_code) is int
