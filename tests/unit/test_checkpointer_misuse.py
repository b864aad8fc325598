"""A script's own loop that uses the checkpointer wrongly is told so, naming the fix,
instead of training on samples its accounting does not describe."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader

import elastic_kit as ek

N, BATCH = 10, 4


def _setup(tmp_path, **options: object) -> tuple[ek.TrainState, ek.Checkpointer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    sampler = ek.ElasticDistributedSampler(range(N), num_replicas=1, rank=0, seed=1)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler)
    ck = ek.Checkpointer(state, str(tmp_path / "ck"), handle_signals=False,
                         heartbeat_timeout=0, handle_preemption=False, snapshot_every=None,
                         **options)
    return state, ck


def test_a_loader_that_does_not_iterate_the_sampler_is_refused(tmp_path) -> None:
    state, ck = _setup(tmp_path)
    ck.restore()
    loader = DataLoader(range(N), batch_size=BATCH, shuffle=True)  # not state.sampler
    batch = next(iter(loader))
    with pytest.raises(RuntimeError, match=r"step\(n=4\): state.sampler dealt no samples "
                                           r"since epoch 0 was set at position 0"):
        ck.step(len(batch))
    assert state.step == 0 and state.sampler.consumed == 0
    ck.close()


def test_a_second_step_call_per_step_is_refused_at_the_end_of_the_pass(tmp_path) -> None:
    state, ck = _setup(tmp_path)
    ck.restore()
    calls = 0
    with pytest.raises(ValueError, match=r"step\(n=4\) starts past the end of the pass "
                                         r"state.sampler dealt: .* has 10 samples, and "
                                         r"earlier steps took them all"):
        for x in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler):
            ck.step(len(x))
            calls += 1
            ck.step(len(x))  # twice per step: the second half of the epoch at weight 0
            calls += 1
    assert calls == 3 and state.sampler.consumed == N  # 4, 4, then 4 (2 left): the 4th refused
    ck.close()


def test_record_step_twice_per_step_is_refused_too(tmp_path) -> None:
    state, ck = _setup(tmp_path)
    ck.restore()
    with pytest.raises(ValueError, match=r"step\(n=4\) starts past the end"):
        for x in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler):
            for _ in range(2):
                ck.record_step(len(x))
                ck.after_step()
    ck.close()


def test_the_global_batch_size_for_n_is_refused(tmp_path) -> None:
    state, ck = _setup(tmp_path)
    ck.restore()
    loader = iter(DataLoader(range(N), batch_size=BATCH, sampler=state.sampler))
    ck.step(len(next(loader)) * 3)  # "the global batch" of three ranks: the pass is gone
    with pytest.raises(ValueError, match=r"this rank's batch size \(len\(x\), not the global"):
        ck.step(len(next(loader)) * 3)
    ck.close()


def test_the_nominal_batch_size_for_the_short_last_step_is_taken(tmp_path) -> None:
    """``step(batch_size)`` where the last batch held fewer: the overshoot is padding."""
    state, ck = _setup(tmp_path, audit="error")
    for epoch in range(ck.restore(), 2):
        state.sampler.set_epoch(epoch)
        for _ in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler):
            ck.step(BATCH)
        audit = ck.finish_audit()
        assert audit is not None and audit.ok
        ck.end_epoch()
    assert (state.step, state.epoch) == (6, 2)
    ck.close()


def test_a_loader_iterator_made_before_restore_is_named(tmp_path) -> None:
    state, ck = _setup(tmp_path)
    ck.restore()
    loader = DataLoader(range(N), batch_size=BATCH, sampler=state.sampler)
    for x in loader:
        ck.step(len(x))
        break
    ck.save()
    ck.close()
    state, ck = _setup(tmp_path)
    batches = iter(DataLoader(range(N), batch_size=BATCH, sampler=state.sampler))
    next(batches)  # what a loader with workers does when its iterator is made
    ck.restore()   # the position is set: the iterator's pass is not the epoch's rest
    with pytest.raises(RuntimeError, match=r"since epoch 0 was set at position 4: .* its "
                                           r"iterator must be made after restore\(\)"):
        ck.step(len(next(batches)))
    ck.close()


def test_a_correct_loop_steps_through_the_epoch(tmp_path) -> None:
    state, ck = _setup(tmp_path)
    for epoch in range(ck.restore(), 2):
        state.sampler.set_epoch(epoch)
        for x in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler):
            ck.step(len(x))
        ck.end_epoch()
    assert (state.step, state.epoch) == (6, 2)
    ck.close()


@pytest.mark.parametrize("call", ["step", "end_epoch"])
def test_the_loop_before_restore_is_refused(tmp_path, call: str) -> None:
    state, ck = _setup(tmp_path)
    x = next(iter(DataLoader(range(N), batch_size=BATCH, sampler=state.sampler)))
    with pytest.raises(RuntimeError, match=rf"{call}\(\) before restore\(\): start the loop "
                                           r"with `for epoch in range\(ckpt.restore\(\)"):
        ck.step(len(x)) if call == "step" else ck.end_epoch()
    state.sampler.set_epoch(1)  # nothing iterated the sampler since: still the restore
    with pytest.raises(RuntimeError, match=r"step\(\) before restore\(\)"):
        ck.step(4)
    assert state.step == 0 and state.epoch == 0
    ck.close()


def test_a_loader_dropping_the_last_batch_is_named_at_the_epochs_end(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    state, ck = _setup(tmp_path)
    with caplog.at_level(logging.WARNING, logger="elastic_kit"):
        for epoch in range(ck.restore(), 2):
            state.sampler.set_epoch(epoch)
            for x in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler,
                                drop_last=True):
                ck.step(len(x))
            ck.end_epoch()
    warned = [r.getMessage() for r in caplog.records if "never stepped" in r.getMessage()]
    assert warned == ["end_epoch(): 2 of epoch 0's 10 samples were never stepped, and are "
                      "not trained this epoch (a DataLoader with drop_last=True drops the "
                      "epoch's last partial batch: give it drop_last=False, sample_weights() "
                      "weights the short step; step(n) given fewer samples than the batch "
                      "held, such as len() of an (x, y) pair or of a dict, undercounts every "
                      "step; a loop that leaves the epoch early leaves the rest; logged once)"]
    ck.close()


def test_the_audit_names_a_dropped_last_batch(tmp_path) -> None:
    state, ck = _setup(tmp_path, audit="error")
    ck.restore()
    for x in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler, drop_last=True):
        ck.step(len(x))
    with pytest.raises(ek.SampleAuditError, match=r"2 samples were never stepped before the "
                                                  r"epoch ended \(a DataLoader with "
                                                  r"drop_last=True"):
        ck.end_epoch()
    ck.close()


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_samplers_own_drop_last_tail_is_not_unstepped(drop_last: bool) -> None:
    from elastic_kit.checkpointer._progress import Progress

    model = torch.nn.Linear(2, 1)
    sampler = ek.ElasticDistributedSampler(range(N), num_replicas=3, rank=1, seed=1,
                                           drop_last=drop_last)
    progress = Progress(ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      sampler=sampler))
    batches = [len(x) for x in DataLoader(range(N), batch_size=2, sampler=sampler)]
    assert batches == ([2, 1] if drop_last else [2, 2])
    progress.advance(batches[0], audited=False)
    assert progress.unstepped() == (N - 6 if not drop_last else 3)
    progress.advance(batches[1], audited=False)
    assert progress.unstepped() == 0
    assert sampler.remaining == (1 if drop_last else 0)  # the tail the sampler drops


def test_a_closed_checkpointer_refuses_every_use_naming_the_fix(tmp_path) -> None:
    """Used again after close(), a checkpointer half re-armed itself: its next close()
    did nothing (a non-blocking save never waited for, the SIGTERM handler and
    threads left installed) and step() stopped saving without a word."""
    state, ck = _setup(tmp_path, every_steps=1)
    ck.restore()
    for x in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler):
        ck.step(len(x))
    ck.close()
    ck.close()  # twice is fine
    saved = [i.step for i in ek.CheckpointStore(str(tmp_path / "ck")).list()]
    for call in (ck.restore, lambda: ck.step(1), lambda: ck.record_step(1), ck.after_step,
                 ck.end_epoch, ck.save, ck.snapshot):
        with pytest.raises(RuntimeError, match=r"on a closed Checkpointer: .*make a new "
                                               r"Checkpointer"):
            call()
    assert state.step == 3 and state.sampler.consumed == N
    assert [i.step for i in ek.CheckpointStore(str(tmp_path / "ck")).list()] == saved
    # a new checkpointer is the way to train on
    _, again = _setup(tmp_path)
    assert again.restore() == 0 and again.state.step == saved[-1] == 2  # the 3rd: end_epoch's
    again.close()


def _last_step_weights(world: int, step_n: bool) -> dict[int, float]:
    """Each sample's weight in the epoch's last, partial step (58 samples, a global
    step of 12 in 2 micro-batches), summed over the ranks as DDP's average does."""
    from elastic_kit.checkpointer._progress import Progress

    n, global_batch, micro = 58, 12, 2
    per_rank = global_batch // world // micro
    weight: dict[int, float] = {}
    for rank in range(world):
        model = torch.nn.Linear(2, 1)
        sampler = ek.ElasticDistributedSampler(range(n), num_replicas=world, rank=rank,
                                               shuffle=False)
        progress = Progress(ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          sampler=sampler))
        batches = [x.tolist() for x in DataLoader(range(n), batch_size=per_rank, sampler=sampler)]
        for first in range(0, len(batches), micro):
            done, last = 0, first + micro >= len(batches)
            for idx in batches[first:first + micro]:
                w = progress.weights(len(idx), offset=done, device=None, dtype=torch.float64,
                                     step_n=per_rank * micro if step_n else None)
                if not step_n:
                    w = w / micro
                if last:
                    for i, wi in zip(idx, w.tolist()):
                        weight[i] = weight.get(i, 0.0) + wi / world
                done += len(idx)
            progress.advance(done, audited=False)
    return weight


@pytest.mark.parametrize("world", [1, 2, 3])
def test_with_the_steps_size_every_real_sample_of_a_partial_step_weighs_the_same(
        world: int) -> None:
    """With each micro-batch averaged over its own real samples, a sample's weight in
    the epoch's last step depended on the world size (1/10 at one rank; 1/12 and 1/6
    at two): given the step's size, every real sample weighs 1/n_real."""
    weight = _last_step_weights(world, step_n=True)
    assert sorted(i for i, w in weight.items() if w) == list(range(48, 58))  # else padding
    assert all(w == pytest.approx(0.1) for i, w in weight.items() if i >= 48), weight
    if world > 1:  # without it: not the mean over the step's real samples
        assert any(w != pytest.approx(0.1) for w in _last_step_weights(world, False).values())


@pytest.mark.parametrize("audit", [False, True])
def test_a_forgotten_end_epoch_is_named_at_the_next_epochs_first_step(tmp_path, audit) -> None:
    """The sampler rolls over to the next epoch on its own, the checkpointer's epoch
    does not: without the audit the run trained on with its accounting an epoch
    behind; with it, the next save failed with an internal AssertionError."""
    state, ck = _setup(tmp_path, audit=audit, every_steps=2)
    ck.restore()
    for x in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler):
        ck.step(len(x))
    # no ck.end_epoch()
    state.sampler.set_epoch(1)
    batch = next(iter(DataLoader(range(N), batch_size=BATCH, sampler=state.sampler)))
    with pytest.raises(RuntimeError, match=r"state.sampler is at epoch 1, but the "
                                           r"checkpointer's epoch is 0: call end_epoch\(\)"):
        ck.step(len(batch))
    ck.abandon()


def test_a_loop_that_ignores_the_epoch_restore_returns_is_named(tmp_path) -> None:
    """``for epoch in range(epochs)`` after a restore into epoch 1 would retrain epoch 0."""
    state, ck = _setup(tmp_path, every_steps=1000)
    ck.restore()
    for x in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler):
        ck.step(len(x))
    ck.end_epoch()
    ck.save()
    ck.close()
    state, ck = _setup(tmp_path, every_steps=1000)
    assert ck.restore() == 1
    state.sampler.set_epoch(0)  # the script's range(epochs)
    batch = next(iter(DataLoader(range(N), batch_size=BATCH, sampler=state.sampler)))
    with pytest.raises(RuntimeError, match=r"state.sampler is at epoch 0, but the "
                                           r"checkpointer's epoch is 1: .*range\(ckpt.restore"):
        ck.step(len(batch))
    ck.abandon()


def test_an_epoch_set_before_a_restore_that_finds_nothing_is_where_the_sampler_starts(
        tmp_path) -> None:
    """A run carried over from ``torch.save`` (docs/checkpoints.md) sets ``state.epoch``
    before the first ``restore()``; a loop that leaves the epochs to ``end_epoch()``
    (no ``set_epoch``) trained the sampler's epoch 0 under the checkpointer's epoch 2
    (now refused at the first step), and a save before any step kept epoch 0."""
    state, ck = _setup(tmp_path, every_steps=1000)
    state.epoch = 2
    assert ck.restore() == 2 and state.sampler.epoch == 2
    ck.save()
    ck.close()
    state, ck = _setup(tmp_path, every_steps=1000)
    assert ck.restore() == 2  # the save kept the epoch
    for _ in range(2, 4):
        for x in DataLoader(range(N), batch_size=BATCH, sampler=state.sampler):
            ck.step(len(x))
        ck.end_epoch()
    assert (state.epoch, state.sampler.epoch, state.step) == (4, 4, 6)
    ck.close()
