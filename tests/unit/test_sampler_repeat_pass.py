"""Iterating the loader again after an epoch's training pass and before the next
``set_epoch`` (a training-set evaluation before ``end_epoch()``) deals the epoch's
share again, as ``DistributedSampler`` does, and moves nothing: the epoch, its
position and the checkpoint saved after it stay the epoch just trained. Only a
sampler whose epochs nothing ever names with ``set_epoch`` (a script that forgets it)
starts the next epoch there."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import elastic_kit as ek
from elastic_kit.sampler import ElasticDistributedSampler

LOGGER = "elastic_kit.sampler"


@pytest.mark.parametrize("n, world", [(10, 1), (10, 2), (11, 3)])
def test_a_pass_after_the_epoch_was_trained_deals_the_epoch_again(
        caplog: pytest.LogCaptureFixture, n: int, world: int) -> None:
    for rank in range(world):
        ours = ElasticDistributedSampler(range(n), world, rank, seed=3)
        ours.set_epoch(2)
        trained = list(ours)
        for _ in trained:
            ours.advance(min(world, ours.remaining))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            again = [list(ours) for _ in range(2)]
        assert caplog.records == []
        assert again == [trained, trained]
        assert len(again[0]) == len(DistributedSampler(range(n), world, rank))
        assert (ours.epoch, ours.consumed, len(ours)) == (2, n, len(trained))
        ours.set_epoch(3)
        assert (ours.epoch, ours.consumed) == (3, 0)
        fresh = ElasticDistributedSampler(range(n), world, rank, seed=3)
        fresh.set_epoch(3)
        assert list(ours) == list(fresh)


def test_a_pass_after_a_resumed_epoch_deals_its_whole_share() -> None:
    s = ElasticDistributedSampler(range(12), 2, 1)
    s.load_state_dict({**s.state_dict(), "epoch": 1, "consumed": 4})
    s.set_epoch(1)
    rest = list(s)
    assert len(rest) == 4
    for _ in rest:
        s.advance(2)
    assert list(s) == s.permutation(1)[1::2].tolist() and len(s) == 6


def _life(url: str, lives: list[int], audit: str, set_epoch: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(10, 3)
    data = list(zip(x, x.sum(1, keepdim=True)))
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = ek.ElasticDistributedSampler(data, num_replicas=1, rank=0)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    state = ek.TrainState(model, opt, sampler=sampler)
    ck = ek.Checkpointer(state, url, handle_signals=False, heartbeat_timeout=0,
                         handle_preemption=False, snapshot_every=None, blocking=True,
                         audit=audit)
    start = ck.restore()
    lives.append(start)
    for epoch in range(start, 3):
        if set_epoch:  # end_epoch() moves the sampler on too
            sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = ((model(xb) - yb) ** 2).squeeze(1).mul(ck.sample_weights(len(xb))).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ck.step(len(xb))
        with torch.no_grad():  # the training set's loss, over the training loader
            seen = sum(len(xb) for xb, _ in loader)
        assert seen == 10
        ck.end_epoch()
        assert state.epoch == epoch + 1
        break  # preempted after each epoch
    ck.close()


@pytest.mark.parametrize("audit, set_epoch", [("off", True), ("error", True),
                                               ("error", False)])
def test_a_training_set_evaluation_before_end_epoch_skips_no_epoch(
        tmp_path: Path, audit: str, set_epoch: bool) -> None:
    lives: list[int] = []
    for _ in range(3):
        _life(str(tmp_path / "ck"), lives, audit, set_epoch)
    assert lives == [0, 1, 2]


def test_training_the_next_epoch_without_end_epoch_is_refused(tmp_path: Path) -> None:
    """No set_epoch() and no end_epoch(): the second pass is the first epoch again,
    and training it would count nothing; the step says what to call."""
    model = torch.nn.Linear(1, 1)
    sampler = ek.ElasticDistributedSampler(range(4), num_replicas=1, rank=0)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          sampler=sampler)
    ck = ek.Checkpointer(state, str(tmp_path / "ck"), handle_signals=False,
                         heartbeat_timeout=0, handle_preemption=False, snapshot_every=None)
    ck.restore()
    loader = DataLoader(range(4), batch_size=2, sampler=sampler)
    for x in loader:
        ck.step(len(x))
    with pytest.raises(ValueError, match=r"call end_epoch\(\) after each epoch"):
        for x in loader:
            ck.step(len(x))
    assert (state.step, state.epoch, sampler.consumed) == (2, 0, 4)
    ck.close()
