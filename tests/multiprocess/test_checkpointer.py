"""ek.Checkpointer in a script that keeps its own loop: exact mid-epoch resume at any
world size, per-sample weights for the last partial step, SIGTERM, audit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elastic_kit as ek
from elastic_kit.testing import spawn_multi_process
from tests.train_script import TrainConfig, make_dataset, train

N = 50          # not a multiple of any batch used below: the last step is partial
BATCH = 4       # per rank


def _dataset() -> TensorDataset:
    return make_dataset(TrainConfig(dataset_size=N, features=5, target="x0+x1", data_seed=3))


def _own_loop(url: str, epochs: int, stop_after: int | None) -> TrainConfig:
    """A plain own-loop script made elastic with Checkpointer (a warm-up scheduler, an
    EMA model and a plain counter in the state, a checkpoint every 3 steps); it
    'crashes' (closes without saving) after ``stop_after`` global steps of this life."""
    return TrainConfig(url=url, dataset_size=N, features=5, hidden=8, target="x0+x1",
                       data_seed=3, sampler_seed=1, scheduler="warmup", ema=True,
                       extras=True, epochs=epochs, batch_size=BATCH,
                       checkpoint={"every_steps": 3, "audit": True, "blocking": True},
                       stop_after=stop_after, stop_how="close")


def test_world_size_one_resume_mid_epoch_is_bitwise_equal(tmp_path: Any) -> None:
    ref = train(_own_loop(str(tmp_path / "ref"), epochs=2, stop_after=None))
    url = str(tmp_path / "run")
    first = train(_own_loop(url, epochs=2, stop_after=8))  # 13 steps per epoch: mid-epoch 0
    assert first == {"crashed_at": 8}
    rest = train(_own_loop(url, epochs=2, stop_after=None))
    assert rest["restored"] == 6                       # the newest checkpoint (every 3 steps)
    assert rest["step"] == ref["step"] == 26
    for a, b in zip(rest["params"], ref["params"]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(rest["ema"], ref["ema"]):          # the EMA model resumed in place
        np.testing.assert_array_equal(a, b)
    assert rest["audit"] == [(0, N, True), (1, N, True)]
    assert rest["extras"]["seen"] == ref["extras"]["seen"] == 26  # plain extras restored too
    # len(loader) is constant while a pass is iterated: 13 batches a full epoch, and
    # the resumed pass of epoch 0 (from sample 24) has 7
    assert sorted(set(rest["lens"])) == [(0, 7), (1, 13)]
    assert [w["restored_step"] for w in rest["report"]["world_sizes"]] == [None, 6]
    assert rest["report"]["world_sizes"][1]["restored_from"] == "store"


def test_resize_2_to_3_to_2_trains_every_sample_once_per_epoch(tmp_path: Any) -> None:
    url = str(tmp_path / "run")
    lives = [(2, 4), (3, 5), (2, None)]
    results = []
    for world, stop in lives:
        results.append(spawn_multi_process(world, train, _own_loop(url, 3, stop)))
    final = results[-1]
    assert {r["step"] for r in final} == {final[0]["step"]}
    assert all(r["epoch"] == 3 for r in final)
    for r in final:
        assert r["audit"] == [(0, N, True), (1, N, True), (2, N, True)]
    worlds = [w["world_size"] for w in final[0]["report"]["world_sizes"]]
    assert worlds == [2, 3, 2]
    # every rank's parameters agree (DDP kept them in lockstep across restarts)
    for a, b in zip(final[0]["params"], final[1]["params"]):
        np.testing.assert_array_equal(a, b)


def _weights(world: int) -> list[list[float]]:
    ek.init_distributed()
    ds = _dataset()
    sampler = ek.ElasticDistributedSampler(ds, seed=1)
    state = ek.TrainState(nn.Linear(1, 1), torch.optim.SGD(nn.Linear(1, 1).parameters(), 0.1),
                          sampler=sampler)
    ckpt = ek.Checkpointer(state, None, handle_signals=False)
    ckpt.restore()
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler)
    out = []
    for x, _ in loader:
        out.append(ckpt.sample_weights(len(x)).tolist())
        ckpt.step(len(x))
    ckpt.close()
    return out


def test_sample_weights_count_every_real_sample_once_on_the_last_partial_step() -> None:
    per_rank = spawn_multi_process(3, _weights, 3)
    steps = len(per_rank[0])
    assert steps == 5                                  # 50 samples, 12 per global step
    for k in range(steps - 1):                         # full steps: W / 12 each
        for r in range(3):
            assert per_rank[r][k] == pytest.approx([3 / 12] * BATCH)
    # 50 samples over 3 ranks: 17 each with one padded position; the last batch
    # is one sample per rank, global positions 48, 49 and 50 (padding, on rank 2)
    last = [per_rank[r][-1] for r in range(3)]
    assert last[0] == pytest.approx([1.5])
    assert last[1] == pytest.approx([1.5])
    assert last[2] == pytest.approx([0.0])
    # DDP averages over 3 ranks: the real samples' weights sum to W, i.e. a mean
    assert sum(sum(w) for w in last) == pytest.approx(3.0)


def _accumulated_weights(offsets: bool) -> list[tuple[int, float]]:
    """7 samples over 2 ranks, micro-batches of 2, two per optimizer step: (sample,
    weight) of every sample; rank 1's last position is padding, in the step's second
    micro-batch."""
    ek.init_distributed()
    data = TensorDataset(torch.arange(7))
    sampler = ek.ElasticDistributedSampler(data, seed=1)
    model = nn.Linear(1, 1)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), 0.1), sampler=sampler)
    ckpt = ek.Checkpointer(state, None, handle_signals=False)
    ckpt.restore()
    it = iter(DataLoader(data, batch_size=2, sampler=sampler))
    out: list[tuple[int, float]] = []
    done = 0  # the epoch is one optimizer step: 4 samples per rank
    for (x,) in (next(it), next(it)):
        w = ckpt.sample_weights(len(x), offset=done if offsets else 0)
        out += list(zip(x.tolist(), w.tolist()))
        done += len(x)
    ckpt.step(done)
    ckpt.close()
    return out


def test_accumulated_micro_batches_weigh_the_padding_zero_with_their_offsets() -> None:
    per_rank = spawn_multi_process(2, _accumulated_weights, True)
    pairs = per_rank[0] + per_rank[1]
    assert len(pairs) == 8
    weighed = [i for i, w in pairs if w > 0]
    assert sorted(weighed) == list(range(7))            # every sample once, padding 0
    assert [w for _, w in per_rank[1]][-1] == 0.0
    # each micro-batch averages over its real samples (DDP divides by W=2): the
    # second holds 3 real samples over both ranks, the first 4
    assert [w for _, w in per_rank[0]] == pytest.approx([0.5, 0.5, 2 / 3, 2 / 3])
    assert [w for _, w in per_rank[1]] == pytest.approx([0.5, 0.5, 2 / 3, 0.0])


def test_micro_batches_all_weighed_at_offset_0_are_refused_at_the_step() -> None:
    with pytest.raises(Exception, match=r"sample_weights\(\) was called for 2 micro-batches "
                                        r"of this step \(\[2, 2\] samples\), each at "
                                        r"offset 0"):
        spawn_multi_process(2, _accumulated_weights, False)


def _linear_at_world_size_1(url: Any, **options: Any) -> tuple[Any, Any, Any, Any]:
    """``(dataset, sampler, state, checkpointer)`` of a linear model at world size 1."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    ds = _dataset()
    sampler = ek.ElasticDistributedSampler(ds, 1, 0)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler)
    return ds, sampler, state, ek.Checkpointer(state, url, handle_signals=False, **options)


def test_request_stop_saves_the_current_step_and_exits_143(tmp_path: Any) -> None:
    ds, sampler, state, ckpt = _linear_at_world_size_1(tmp_path, every_steps=100)
    ckpt.restore()
    sampler.set_epoch(0)
    it = iter(DataLoader(ds, batch_size=BATCH, sampler=sampler))
    for _ in range(3):
        next(it)
        ckpt.step(BATCH)
    ckpt.request_stop(restart=True)  # as SIGTERM
    next(it)
    with pytest.raises(SystemExit) as exc:
        ckpt.step(BATCH)
    assert exc.value.code == 143
    loaded = ek.load_checkpoint(None, tmp_path)
    assert loaded is not None and loaded.step == 4
    assert loaded.state["sampler"]["consumed"] == 4 * BATCH
    assert loaded.state["epoch"] == 0


def _one_epoch_loop(url: str, stop_at: int | None) -> dict[str, Any]:
    """Two epochs of 13 steps at world size 1; a stop is requested before step
    ``stop_at + 1`` (12: the epoch's last step)."""
    ds, sampler, state, ckpt = _linear_at_world_size_1(url, every_steps=5, audit=True)
    steps = []
    for epoch in range(ckpt.restore(), 2):
        sampler.set_epoch(epoch)
        for x, _ in DataLoader(ds, batch_size=BATCH, sampler=sampler):
            if state.step == stop_at:
                ckpt.request_stop(restart=True)
            ckpt.step(len(x))
            steps.append((epoch, state.step))
        ckpt.end_epoch()
    ckpt.close()
    return {"steps": steps, "audit": [(a.epoch, a.count, a.ok)
                                      for _, a in sorted(state.audit.epochs.items())]}


def test_sigterm_at_the_epochs_last_step_exits_from_end_epoch_with_the_epoch_closed(
        tmp_path: Any, caplog: Any) -> None:
    with pytest.raises(SystemExit):
        _one_epoch_loop(str(tmp_path), stop_at=12)
    saved = ek.load_checkpoint(None, tmp_path)
    assert saved is not None and saved.step == 13
    assert saved.state["sampler"]["consumed"] == 0 and saved.state["epoch"] == 1
    # resume: at the next epoch (no empty pass, no warning)
    with caplog.at_level("WARNING"):
        resumed = _one_epoch_loop(str(tmp_path), stop_at=None)
    assert resumed["steps"][0] == (1, 14)
    assert resumed["audit"] == [(0, N, True), (1, N, True)]
    assert not [r for r in caplog.records if "set_epoch" in r.getMessage()]


def test_checkpointer_rejects_bad_options(tmp_path: Any) -> None:
    state = ek.TrainState(nn.Linear(1, 1))
    with pytest.raises(ValueError, match="every_steps=0"):
        ek.Checkpointer(state, tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="audit='maybe'"):
        ek.Checkpointer(state, tmp_path, audit="maybe")
    with pytest.raises(ValueError, match="every_seconds"):
        ek.Checkpointer(state, tmp_path, every_seconds=0)
    with pytest.raises(TypeError, match="TrainState"):
        ek.Checkpointer(object(), tmp_path)  # type: ignore[arg-type]


def _count_exchanges(steps: int, step_s: float, stop_at: int | None) -> dict[str, Any]:
    """``steps`` steps of ``step_s`` seconds with no store; counts the flag exchanges
    (async all-reduces) the checkpointer issues; rank 1 requests a stop at ``stop_at``."""
    import time

    import elastic_kit.checkpointer._cadence as cadence_mod

    torch.set_num_threads(1)
    ek.init_distributed()
    calls = []
    real = cadence_mod.all_reduce_sum_async

    def counting(t: torch.Tensor) -> Any:
        calls.append(1)
        return real(t)

    cadence_mod.all_reduce_sum_async = counting
    model = nn.Linear(2, 2)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = ek.Checkpointer(state, None, handle_signals=False)
    ckpt.restore()
    stopped_at = None
    try:
        for i in range(steps):
            time.sleep(step_s)
            if stop_at is not None and i == stop_at and ek.get_dist_info().rank == 1:
                ckpt.request_stop(restart=True)
            ckpt.step(1)
    except SystemExit as e:
        stopped_at = (state.step, e.code)
    return {"exchanges": len(calls), "every": ckpt._cadence.exchange_every,
            "stopped_at": stopped_at}


def test_long_steps_exchange_flags_every_step() -> None:
    out = spawn_multi_process(2, _count_exchanges, 4, 0.25, None)
    assert out[0]["every"] == out[1]["every"] == 1
    assert out[0]["exchanges"] == out[1]["exchanges"] == 4


def test_short_steps_exchange_rarely_and_a_stop_on_one_rank_exits_all_at_one_step() -> None:
    # 1 ms steps: rank 0 proposes an exchange every 0.2 s of training (capped at 64
    # steps) and every rank adopts it at the same exchange (a mismatch would hang);
    # rank 1's stop request at step 150 reaches every rank at the same step
    out = spawn_multi_process(2, _count_exchanges, 1000, 0.001, 150)
    assert out[0]["every"] == out[1]["every"] > 1
    assert out[0]["stopped_at"] == out[1]["stopped_at"]
    step, code = out[0]["stopped_at"]
    assert code == 143
    assert 151 <= step <= 151 + 2 * 64  # within two exchange intervals of the request
    assert out[0]["exchanges"] == out[1]["exchanges"] < step // 4


def test_step_time_leaves_out_the_time_spent_in_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step time the exchange and snapshot intervals are budgets of is training
    time: a hook's time (validation in ``on_step_end``) handed to ``exclude_time`` is
    not counted, so a long hook does not make snapshots more frequent for a while."""
    import types

    import elastic_kit.checkpointer._cadence as cadence_mod

    clock = [100.0]
    monkeypatch.setattr(cadence_mod, "time", types.SimpleNamespace(
        monotonic=lambda: clock[0], perf_counter=lambda: clock[0]))
    model = nn.Linear(2, 2)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = ek.Checkpointer(state, None, handle_signals=False, info=ek.DistInfo())
    cadence = ckpt._cadence
    cadence.local_flags()  # the first exchange: no step time yet
    assert cadence.step_s is None
    state.step += 10
    clock[0] += 1.0  # 10 steps in 1 s, of which 0.6 s in hooks
    cadence.exclude_time(0.6)
    flags = cadence.local_flags()
    assert cadence.step_s == pytest.approx(0.04)
    # ... but the flag exchange keeps its pace in wall time (0.1 s a step, hooks
    # included): a stop must reach every rank within torchrun's grace, whatever the
    # hooks cost (at 0.04 s it would exchange every 5 steps, 0.5 s apart)
    assert cadence.wall_step_s == pytest.approx(0.1) and flags.exchange_every == 2
    state.step += 10
    clock[0] += 0.4  # the next window has no hooks: the excluded time was reset
    cadence.local_flags()
    assert cadence.step_s == pytest.approx(0.04)


def test_a_preemption_signal_on_one_rank_leaves_every_rank_at_one_saved_step(
        tmp_path: Any) -> None:
    # one node: every node leaves, so the step goes to the durable store and the
    # ranks exit with the SIGTERM status; the next life resumes exactly there
    url = str(tmp_path / "run")
    # steps of 10 ms: the ranks exchange their flags every ~20 steps (0.2 s of training)
    cfg = TrainConfig(url=url, dataset_size=200, features=5, target="x0+x1", data_seed=3,
                      epochs=2, batch_size=BATCH, checkpoint={"every_steps": 1000, "audit": True},
                      notice_after=3, notice_rank=1, step_delay=0.01)
    left = spawn_multi_process(2, train, cfg)
    step = left[0]["left_at"]
    assert left == [{"left_at": step, "code": 143}] * 2 and step >= 3
    assert ek.CheckpointStore(url).latest_step() == step  # the leave's own checkpoint
    rest = spawn_multi_process(2, train, TrainConfig(**{**cfg.__dict__, "notice_after": None}))
    assert [r["restored"] for r in rest] == [step, step]
    assert rest[0]["audit"] == [(0, 200, True), (1, 200, True)]


def test_a_leave_agreed_at_an_epochs_last_step_waits_for_its_end(tmp_path: Any) -> None:
    # alone, the flags are read every step: the notice after step 49 is acted on at
    # step 50, the epoch's last; the leave waits for end_epoch, so what is saved is
    # the closed epoch and the next life starts the next one
    url = str(tmp_path / "run")
    cfg = TrainConfig(url=url, dataset_size=200, features=5, target="x0+x1", data_seed=3,
                      epochs=2, batch_size=BATCH, checkpoint={"every_steps": 1000, "audit": True},
                      notice_after=49, notice_rank=0)
    assert spawn_multi_process(1, train, cfg) == [{"left_at": 50, "code": 143}]
    (info,) = ek.CheckpointStore(url).list()
    assert (info.step, info.epoch) == (50, 1)
    (rest,) = spawn_multi_process(1, train, TrainConfig(**{**cfg.__dict__, "notice_after": None}))
    assert (rest["restored"], rest["start"], rest["sampler_at_start"]) == (50, 1, (1, 0))
    assert rest["audit"] == [(0, 200, True), (1, 200, True)]


def test_a_notice_is_acted_on_when_epochs_are_shorter_than_the_exchange_interval(
        tmp_path: Any) -> None:
    # epochs of 8 steps of 10 ms, flags exchanged every ~20 steps: every exchange in
    # flight is read by an end_epoch (its stop agreement), whose reading must not drop
    # the exchange's other flags (here the leave; also rank 0's interval proposals)
    url = str(tmp_path / "run")
    cfg = TrainConfig(url=url, dataset_size=64, features=5, target="x0+x1", data_seed=3,
                      epochs=12, batch_size=BATCH, checkpoint={"every_steps": 1000, "audit": True},
                      notice_after=3, notice_rank=1, step_delay=0.01)
    left = spawn_multi_process(2, train, cfg)
    assert "left_at" in left[0], left  # before: the run ended without leaving
    step = left[0]["left_at"]
    assert left == [{"left_at": step, "code": 143}] * 2 and step < 12 * 8
    assert ek.CheckpointStore(url).latest_step() == step


def _stop_on_rank_1(url: str, at: int, restart_on_0: bool) -> tuple[int, Any]:
    """Two ranks of an own loop; rank 1 asks to end training for good before step
    ``at + 1`` (rank 0 asks for a restart there too when ``restart_on_0``)."""
    ek.init_distributed()
    info = ek.get_dist_info()
    torch.manual_seed(0)
    model = ek.wrap_ddp(nn.Linear(5, 2))
    ds = _dataset()
    sampler = ek.ElasticDistributedSampler(ds)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler)
    ckpt = ek.Checkpointer(state, url, handle_signals=False, every_steps=100, snapshot_every=0)
    try:
        for epoch in range(ckpt.restore(), 3):
            sampler.set_epoch(epoch)
            for x, _ in DataLoader(ds, batch_size=2, sampler=sampler):
                if state.step == at and info.rank == 1:
                    ckpt.request_stop()
                if state.step == at and info.rank == 0 and restart_on_0:
                    ckpt.request_stop(restart=True)
                ckpt.step(len(x))
            ckpt.end_epoch()
        ckpt.close()
    except SystemExit as e:
        return state.step, e.code
    return state.step, None


@pytest.mark.parametrize("restart_on_0,code", [(False, 0), (True, 143)])
def test_a_request_to_end_on_one_rank_saves_and_exits_0_on_every_rank(
        tmp_path: Any, restart_on_0: bool, code: int) -> None:
    """Early stopping under torchrun: the job must end, not restart (exit 143 made
    torchrun restart the group, which trained on); a SIGTERM at the same time wins."""
    out = spawn_multi_process(2, _stop_on_rank_1, str(tmp_path), 4, restart_on_0)
    (step, got), other = out
    assert other == (step, got) and got == code and step >= 5, out
    assert [i.step for i in ek.CheckpointStore(str(tmp_path)).list()] == [step]


def test_elastic_loop_returns_after_a_request_to_end(tmp_path: Any) -> None:
    from elastic_kit import CheckpointerConfig, ElasticLoop, LoopConfig

    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = LoopConfig(epochs=3, global_batch_size=4, micro_batch_size=4, log_every=0,
                     progress_bar=False,
                     checkpoint=CheckpointerConfig(handle_signals=False, snapshot_every=0))

    def loss(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((m(x) - y.float().unsqueeze(-1)) ** 2).mean(-1)

    def on_step_end(state: ek.TrainState, info: Any) -> None:
        if state.step == 3:
            loop.request_stop()

    loop = ElasticLoop(state, _dataset(), loss_fn=loss, store=str(tmp_path), config=cfg,
                       on_step_end=on_step_end)
    assert loop.run() is state  # returns: no SystemExit, no restart
    assert loop.checkpointer is not None and loop.checkpointer.stop_requested
    assert state.step == 3 and state.epoch == 0  # one rank: the step it was asked in
    assert [i.step for i in ek.CheckpointStore(str(tmp_path)).list()] == [3]
