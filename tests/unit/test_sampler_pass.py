"""ElasticDistributedSampler passes: constant len(), pass_start, and forgotten set_epoch().

A *pass* is what one ``__iter__`` deals. These tests drive the sampler the way a
script does (``set_epoch``, iterate a DataLoader, ``advance`` after each step) and
check what a DataLoader and a progress logger see.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from elastic_kit.sampler import ElasticDistributedSampler

FAST = settings(max_examples=60, deadline=None)
LOGGER = "elastic_kit.sampler"


def _ranks(n: int, world: int, **kwargs) -> list[ElasticDistributedSampler]:
    return [ElasticDistributedSampler(range(n), world, r, **kwargs) for r in range(world)]


def _train_pass(samplers: list[ElasticDistributedSampler], batch: int) -> dict:
    """One pass over per-rank DataLoaders in lockstep, advancing after every step.

    Checks at every step that ``len()`` of sampler and loader is what it was when the
    pass began, and that ``pass_start`` with ``local_padding_mask(position=...)``
    identifies the padding of the batch being trained. Returns the real samples
    trained and the lengths seen.
    """
    world = len(samplers)
    loaders = [DataLoader(list(range(samplers[0].dataset_length)), batch_size=batch,
                          sampler=s) for s in samplers]
    before = [len(s) for s in samplers]
    before_loader = [len(x) for x in loaders]
    iters = [iter(x) for x in loaders]
    first = [next(it, None) for it in iters]  # the sampler's __iter__ runs here
    starts = [s.pass_start for s in samplers]
    assert starts == [samplers[0].consumed] * world
    masks = [s.local_padding_mask(position=s.pass_start) for s in samplers]
    dealt = [s.local_indices(position=s.pass_start).tolist() for s in samplers]
    lengths = {len(s) for s in samplers}
    assert len(lengths) == 1, "ranks must agree on the pass length"
    (length,) = lengths
    assert [len(d) for d in dealt] == [length] * world
    trained: list[int] = []
    got: list[list[int]] = [[] for _ in range(world)]
    current = first
    steps = 0
    while current[0] is not None:
        assert all(c is not None for c in current), "ranks must take the same steps"
        real = 0
        for r, (s, b) in enumerate(zip(samplers, current)):
            j = (s.consumed - s.pass_start) // world
            assert j == steps * batch
            keep = ~masks[r][j:j + len(b)]
            trained.extend(torch.as_tensor(b)[keep].tolist())
            got[r].extend(torch.as_tensor(b).tolist())
            real += int(keep.sum())
            assert len(s) == length and s.num_samples == length
            assert s.total_size == length * world
            assert len(loaders[r]) == math.ceil(length / batch)
        if not samplers[0].drop_last:
            assert real == min(batch * world, samplers[0].remaining)
        for s in samplers:
            s.advance(real)
        steps += 1
        assert [len(s) for s in samplers] == [length] * world
        current = [next(it, None) for it in iters]
    assert all(c is None for c in current)
    assert got == dealt  # what __iter__ yielded is local_indices(position=pass_start)
    assert [len(x) for x in loaders] == [math.ceil(length / batch)] * world
    return {"trained": trained, "length": length, "before": before,
            "before_loader": before_loader, "steps": steps}


@FAST
@given(n=st.integers(1, 60), world=st.integers(2, 3), batch=st.integers(1, 5),
       start=st.integers(0, 60), drop_last=st.booleans(), epoch=st.integers(0, 3))
def test_len_is_constant_while_a_pass_is_advanced_through(
    n: int, world: int, batch: int, start: int, drop_last: bool, epoch: int
) -> None:
    start = min(start, n)
    world = min(world, n)  # a dataset smaller than the world size is refused
    state = {"epoch": epoch, "consumed": start, "seed": 3, "dataset_length": n,
             "shuffle": True, "drop_last": drop_last}
    samplers = _ranks(n, world, seed=3, drop_last=drop_last)
    for s in samplers:
        s.load_state_dict(state)
        s.set_epoch(epoch)
    rem = n - start
    expected = rem // world if drop_last else math.ceil(rem / world)
    out = _train_pass(samplers, batch)
    assert out["length"] == expected
    assert out["before"] == [expected] * world  # len() before the first batch agrees
    assert out["before_loader"] == [math.ceil(expected / batch)] * world
    assert out["steps"] == math.ceil(expected / batch)
    rest = samplers[0].permutation(epoch)[start:].tolist()
    if drop_last:
        assert sorted(out["trained"]) == sorted(rest[: expected * world])
    else:
        assert Counter(out["trained"]) == Counter(rest)  # exactly once
        assert samplers[0].consumed == n


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("batch", [1, 4])
def test_epochs_with_set_epoch_each_train_every_sample_once_with_constant_len(
    world: int, batch: int
) -> None:
    n = 23
    samplers = _ranks(n, world, seed=1)
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        assert [s.pass_start for s in samplers] == [0] * world
        out = _train_pass(samplers, batch)
        assert out["length"] == math.ceil(n / world)
        assert Counter(out["trained"]) == Counter(range(n))
        assert [s.epoch for s in samplers] == [epoch] * world


def test_second_pass_without_set_epoch_warns_and_starts_the_next_epoch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    n, world = 10, 2
    samplers = _ranks(n, world, seed=5)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = _train_pass(samplers, 2)
    assert caplog.records == []
    assert Counter(first["trained"]) == Counter(range(n))
    assert [(s.epoch, s.consumed) for s in samplers] == [(0, n)] * world
    # The progress logger asks before the next pass starts: the last pass's length.
    assert [len(s) for s in samplers] == [5, 5]

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        second = _train_pass(samplers, 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == world  # once per sampler
    assert all("set_epoch() was not called" in w and "starting epoch 1" in w
               for w in warnings)
    assert [s.epoch for s in samplers] == [1] * world
    assert [s.pass_start for s in samplers] == [0] * world
    assert second["length"] == 5
    expected = ElasticDistributedSampler(range(n), world, 0, seed=5)
    expected.set_epoch(1)
    assert sorted(second["trained"][:4]) == sorted(expected.permutation()[:4].tolist())
    assert Counter(second["trained"]) == Counter(range(n))

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        third = _train_pass(samplers, 2)
    assert caplog.records == []  # already said once
    assert [s.epoch for s in samplers] == [2] * world
    assert Counter(third["trained"]) == Counter(range(n))
    assert samplers[0].local_indices(position=0).tolist() == list(
        samplers[0].permutation(2)[0::2].tolist())


def test_dataloader_len_before_a_forgotten_set_epoch_pass_is_the_full_epoch() -> None:
    s = ElasticDistributedSampler(range(8), 2, 1)
    loader = DataLoader(list(range(8)), batch_size=2, sampler=s)
    seen = []
    for epoch in range(3):
        assert len(loader) == 2
        for b in loader:
            seen.append(b.tolist())
            s.advance(4)
        assert s.epoch == epoch
    assert all(len(b) == 2 for b in seen) and len(seen) == 6


def test_drop_last_pass_that_cannot_go_further_counts_as_the_end_of_the_epoch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 5 samples over 2 ranks with drop_last: 4 are dealt and the fifth is dropped,
    # so the position stops at 4, not 5; iterating again must still move on.
    samplers = _ranks(5, 2, drop_last=True)
    first = _train_pass(samplers, 1)
    assert len(first["trained"]) == 4 and samplers[0].consumed == 4
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        second = _train_pass(samplers, 1)
    assert "starting epoch 1" in caplog.text
    assert second["length"] == 2 and samplers[0].epoch == 1


def test_pass_after_loading_an_end_of_epoch_state_is_empty_without_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    n = 12
    src = ElasticDistributedSampler(range(n), 3, 0, seed=2)
    src.set_epoch(4)
    src.advance(n)  # saved after the epoch's last step, before the epoch-end work
    state = src.state_dict()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for world in (2, 4):
            s = ElasticDistributedSampler(range(n), world, world - 1, seed=2)
            s.load_state_dict(state)
            assert (len(s), s.pass_start) == (0, n)
            assert list(s) == []
            s.set_epoch(4)  # the loop's set_epoch at the top of the epoch: still empty
            assert (list(s), len(s), s.num_samples, s.total_size) == ([], 0, 0, 0)
            assert s.epoch == 4
            s.set_epoch(5)  # end-of-epoch work done: the next epoch is full
            assert len(s) == len(list(s)) == n // world
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_forgotten_set_epoch_after_resuming_at_the_end_of_an_epoch_moves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # torchvision's reference outside distributed mode: no set_epoch at all.
    s = ElasticDistributedSampler(range(6), 2, 0)
    s.load_state_dict({**s.state_dict(), "epoch": 2, "consumed": 6})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert list(s) == []  # the end-of-epoch pass: legitimately empty
        assert caplog.records == []
        assert list(s) == s.permutation(3)[0::2].tolist()
    assert s.epoch == 3 and "starting epoch 3" in caplog.text


def test_set_epoch_with_the_same_number_after_a_finished_pass_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = ElasticDistributedSampler(range(4), 1, 0)
    s.set_epoch(0)
    for _ in s:
        s.advance(1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s.set_epoch(0)
    assert "set_epoch(0) keeps the position of epoch 0" in caplog.text
    assert "set_epoch(1)" in caplog.text
    assert (list(s), s.epoch) == ([], 0)


def test_never_advanced_sampler_deals_the_same_full_pass_like_distributed_sampler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for drop_last in (False, True):
        ours = ElasticDistributedSampler(range(11), 3, 2, seed=4, drop_last=drop_last)
        theirs = DistributedSampler(range(11), 3, 2, seed=4, drop_last=drop_last)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            passes = [list(ours) for _ in range(4)]
        assert caplog.records == []
        assert all(p == passes[0] for p in passes)
        assert len(passes[0]) == len(ours) == len(theirs) == len(list(theirs))
        assert (ours.epoch, ours.consumed, ours.pass_start) == (0, 0, 0)


def test_pass_start_follows_construction_set_epoch_load_and_iter() -> None:
    s = ElasticDistributedSampler(range(20), 2, 1, start_index=6)
    assert (s.pass_start, len(s)) == (6, 7)
    s.advance(4)  # before any pass: len() is the pass that would be dealt now
    assert (s.pass_start, s.consumed, len(s)) == (6, 10, 5)
    it = iter(s)
    assert (s.pass_start, len(s)) == (10, 5)
    assert list(it) == s.local_indices(position=10).tolist()
    s.advance(4)
    assert (s.pass_start, s.consumed, len(s)) == (10, 14, 5)
    s.set_epoch(0)  # same epoch: the pass and its position stand
    assert (s.pass_start, s.consumed, len(s)) == (10, 14, 5)
    iter(s)
    assert (s.pass_start, len(s)) == (14, 3)
    s.set_epoch(1)
    assert (s.pass_start, s.consumed, len(s)) == (0, 0, 10)
    s.load_state_dict({**s.state_dict(), "consumed": 9})
    assert (s.pass_start, s.consumed, len(s)) == (9, 9, 6)


def test_local_indices_and_mask_at_a_position_are_what_iter_deals_from_there() -> None:
    n, world = 17, 3
    for rank in range(world):
        s = ElasticDistributedSampler(range(n), world, rank, seed=8)
        for position in range(n + 1):
            probe = ElasticDistributedSampler(range(n), world, rank, seed=8,
                                              start_index=position)
            dealt = list(probe)
            assert s.local_indices(position=position).tolist() == dealt
            mask = s.local_padding_mask(position=position)
            assert mask.tolist() == probe.local_padding_mask().tolist()
            assert int((~mask).sum()) == probe.num_local_real
            assert len(mask) == len(dealt)
        assert s.consumed == 0  # asking about a position does not move the sampler


def test_local_indices_position_outside_the_epoch_is_refused() -> None:
    s = ElasticDistributedSampler(range(10), 2, 0)
    with pytest.raises(ValueError, match=r"position=11 is outside .* 0 <= position <= 10"):
        s.local_indices(position=11)
    with pytest.raises(ValueError, match=r"position=-1 is outside"):
        s.local_padding_mask(position=-1)
    with pytest.raises(TypeError, match=r"position=2.5: expected an int"):
        s.local_indices(position=2.5)  # type: ignore[arg-type]


@FAST
@given(n=st.integers(1, 40), world=st.integers(1, 5), drop_last=st.booleans(),
       position=st.integers(0, 40), first=st.integers(0, 12), count=st.integers(0, 12))
def test_real_mask_is_the_padding_mask_inverted_and_past_the_share_is_padding(
        n: int, world: int, drop_last: bool, position: int, first: int, count: int) -> None:
    """The loss weights and the audit ask ``real_mask`` which local positions hold real
    samples; it agrees with ``local_padding_mask`` over the share and calls every
    position past the share's real samples padding."""
    position = min(position, n)
    world = min(world, n)  # a dataset smaller than the world size is refused
    for rank in range(world):
        s = ElasticDistributedSampler(range(n), world, rank, drop_last=drop_last)
        pad = s.local_padding_mask(position=position)
        assert s.real_mask(0, len(pad), position=position).tolist() == (~pad).tolist()
        real = s.real_mask(first, first + count, position=position).tolist()
        share = len(pad)  # with drop_last shorter than the samples left would fill
        assert real == [rank + j * world < n - position and j < share
                        for j in range(first, first + count)]
