"""ElasticDistributedSampler: exactly-once epochs across resumes and world-size changes."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.utils.data import (
    ElasticDistributedSampler as TorchElasticSampler,
)

from elastic_kit.errors import CheckpointMismatchError
from elastic_kit.sampler import ElasticDistributedSampler

FAST = settings(max_examples=60, deadline=None)


def _ranks(n: int, world: int, **kwargs) -> list[ElasticDistributedSampler]:
    return [
        ElasticDistributedSampler(range(n), num_replicas=world, rank=r, **kwargs)
        for r in range(world)
    ]


def _run_segment(
    samplers: list[ElasticDistributedSampler], per_rank: int, steps: int | None
) -> tuple[list[list[int]], int]:
    """Take `steps` global batches (None: to the end of the epoch) as a loop would.

    Returns the global batches (real samples only, in padded-position order) and the
    number of real samples consumed; every sampler is advanced after each step.
    """
    world = len(samplers)
    shares = [s.local_indices().tolist() for s in samplers]
    masks = [s.local_padding_mask().tolist() for s in samplers]
    assert len({len(x) for x in shares}) == 1, "padding must keep rank lengths equal"
    assert [len(m) for m in masks] == [len(x) for x in shares]
    local_len = len(shares[0])
    total_steps = math.ceil(local_len / per_rank)
    steps = total_steps if steps is None else min(steps, total_steps)
    batches, consumed = [], 0
    for k in range(steps):
        batch = [
            shares[r][j]
            for j in range(k * per_rank, min((k + 1) * per_rank, local_len))
            for r in range(world)
            if not masks[r][j]
        ]
        batches.append(batch)
        consumed += len(batch)
        for s in samplers:
            s.advance(len(batch))
    return batches, consumed


segment = st.tuples(
    st.integers(1, 5),            # world size
    st.integers(1, 4),            # samples per rank per step
    st.integers(0, 6),            # steps before the next "restart"
    st.booleans(),                # resume via load_state_dict (else start_index)
)


@FAST
@given(
    n=st.one_of(st.integers(1, 6), st.integers(7, 80)),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 3),
    shuffle=st.booleans(),
    plan=st.lists(segment, min_size=1, max_size=5),
    last_world=st.integers(1, 5),
)
def test_resume_after_world_size_changes_sees_each_sample_once(
    n: int, seed: int, epoch: int, shuffle: bool, plan: list, last_world: int
) -> None:
    order = ElasticDistributedSampler(
        range(n), num_replicas=1, rank=0, seed=seed, shuffle=shuffle
    ).permutation(epoch).tolist()
    seen: Counter[int] = Counter()
    state = None
    position = 0
    for world, per_rank, steps, via_state in [*plan, (last_world, 2, None, True)]:
        world = min(world, n)  # a dataset smaller than the world size is refused
        if state is None or via_state:
            samplers = _ranks(n, world, seed=seed, shuffle=shuffle)
            if state is not None:
                for s in samplers:
                    s.load_state_dict(state)
            for s in samplers:
                s.set_epoch(epoch)
        else:
            samplers = _ranks(n, world, seed=seed, shuffle=shuffle, start_index=position)
            for s in samplers:
                s.set_epoch(epoch)  # start_index applies to the first epoch set
        assert all(s.consumed == position for s in samplers)
        batches, consumed = _run_segment(samplers, per_rank, steps)
        for k, batch in enumerate(batches):
            g = per_rank * world
            assert batch == order[position + k * g: position + (k + 1) * g][: len(batch)]
            seen.update(batch)
        position += consumed
        state = samplers[0].state_dict()
        assert all(s.state_dict() == state for s in samplers)
    assert position == n
    assert seen == Counter(range(n))


@FAST
@given(n=st.integers(1, 60), world=st.integers(1, 6), consumed=st.integers(0, 60),
       drop_last=st.booleans(), seed=st.integers(0, 10))
def test_rank_shares_have_equal_length_and_match_len(
    n: int, world: int, consumed: int, drop_last: bool, seed: int
) -> None:
    consumed = min(consumed, n)
    world = min(world, n)  # a dataset smaller than the world size is refused
    samplers = _ranks(n, world, seed=seed, drop_last=drop_last, start_index=consumed)
    shares = [s.local_indices() for s in samplers]
    masks = [s.local_padding_mask() for s in samplers]
    rem = n - consumed
    expected = rem // world if drop_last else math.ceil(rem / world)
    assert [len(x) for x in shares] == [expected] * world
    assert [len(s) for s in samplers] == [expected] * world
    assert [list(s) for s in samplers] == [x.tolist() for x in shares]
    assert [int((~m).sum()) for m in masks] == [s.num_local_real for s in samplers]
    real = torch.cat([x[~m] for x, m in zip(shares, masks)]).tolist()
    rest = samplers[0].permutation()[consumed:].tolist()
    if drop_last:
        assert not any(m.any() for m in masks)
        assert sorted(real) == sorted(rest[: expected * world])
    else:
        assert sorted(real) == sorted(rest)
        # padding repeats the epoch's permutation from its start, wherever the pass began
        pads = torch.cat([x[m] for x, m in zip(shares, masks)]).tolist()
        perm = samplers[0].permutation().tolist()
        assert sorted(pads) == sorted((perm * world)[: expected * world - rem])
    assert all(x.dtype == torch.int64 for x in shares)
    assert all(m.dtype == torch.bool for m in masks)


@FAST
@given(n=st.integers(3, 50), seed=st.integers(-5, 2**40), epoch=st.integers(0, 5),
       consumed=st.integers(0, 50), shuffle=st.booleans(), drop_last=st.booleans())
def test_state_dict_round_trip_restores_position_and_order(
    n: int, seed: int, epoch: int, consumed: int, shuffle: bool, drop_last: bool
) -> None:
    a = ElasticDistributedSampler(range(n), num_replicas=3, rank=1, seed=seed,
                                  shuffle=shuffle, drop_last=drop_last)
    a.set_epoch(epoch)
    a.advance(min(consumed, n))
    sd = a.state_dict()
    assert set(sd) == {"epoch", "consumed", "seed", "dataset_length", "shuffle", "drop_last"}
    assert all(type(v) in (int, bool) for v in sd.values())
    b = ElasticDistributedSampler(range(n), num_replicas=2, rank=0, drop_last=drop_last)
    b.load_state_dict(sd)
    assert b.state_dict() == sd
    assert torch.equal(b.permutation(), a.permutation())
    b.set_epoch(epoch)  # same epoch keeps the position
    assert b.consumed == min(consumed, n)


def test_permutation_is_world_size_independent_and_seeded_by_seed_and_epoch() -> None:
    perms = {w: _ranks(1000, w, seed=7)[0].permutation(2) for w in (1, 2, 5)}
    assert torch.equal(perms[1], perms[2]) and torch.equal(perms[1], perms[5])
    assert sorted(perms[1].tolist()) == list(range(1000))
    s = ElasticDistributedSampler(range(1000), num_replicas=1, rank=0, seed=0)
    t = ElasticDistributedSampler(range(1000), num_replicas=1, rank=0, seed=1)
    assert not torch.equal(s.permutation(1), t.permutation(0))
    assert not torch.equal(s.permutation(0), s.permutation(1))
    u = ElasticDistributedSampler(range(10), num_replicas=1, rank=0, shuffle=False)
    assert u.permutation(3).tolist() == list(range(10))


def test_set_epoch_restarts_new_epoch_and_keeps_position_in_same_epoch() -> None:
    s = ElasticDistributedSampler(range(10), num_replicas=2, rank=0)
    s.advance(4)
    s.set_epoch(0)
    assert (s.epoch, s.consumed, s.remaining) == (0, 4, 6)
    s.set_epoch(1)
    assert (s.epoch, s.consumed, s.remaining) == (1, 0, 10)


def test_start_index_offsets_the_permutation_of_the_first_epoch_set() -> None:
    s = ElasticDistributedSampler(range(20), num_replicas=1, rank=0, start_index=5)
    s.set_epoch(3)
    assert s.consumed == 5
    assert s.local_indices().tolist() == s.permutation(3)[5:].tolist()
    s.set_epoch(4)
    assert s.consumed == 0


def test_fewer_remaining_samples_than_ranks_pads_every_rank_to_one() -> None:
    samplers = _ranks(5, 5, start_index=3)
    assert [len(s) for s in samplers] == [1] * 5
    assert [s.num_local_real for s in samplers] == [1, 1, 0, 0, 0]
    perm = samplers[0].permutation().tolist()
    # the 2 remaining samples, then the epoch's permutation from its start as padding
    assert [s.local_indices().tolist() for s in samplers] == [[perm[3]], [perm[4]], [perm[0]],
                                                              [perm[1]], [perm[2]]]


@pytest.mark.parametrize("drop_last", [False, True])
def test_dataset_smaller_than_the_world_size_is_refused_naming_both(drop_last: bool) -> None:
    with pytest.raises(ValueError, match=r"dataset has 3 samples, fewer than num_replicas=5.*"
                                         r"at least 5 samples or at most 3 ranks"):
        ElasticDistributedSampler(range(3), 5, 4, drop_last=drop_last)
    with pytest.raises(ValueError, match=r"dataset has 1 sample, fewer than num_replicas=2"):
        ElasticDistributedSampler(range(1), 2, 0, drop_last=drop_last)
    assert len(ElasticDistributedSampler(range(5), 5, 4, drop_last=drop_last)) == 1


def test_defaults_come_from_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    s = ElasticDistributedSampler(range(10))
    assert (s.num_replicas, s.rank, s.epoch, s.consumed) == (4, 3, 0, 0)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    s = ElasticDistributedSampler(range(10))
    assert (s.num_replicas, s.rank) == (1, 0)


def test_advance_exactly_to_the_end_leaves_nothing_to_yield() -> None:
    s = ElasticDistributedSampler(range(9), num_replicas=2, rank=1)
    s.advance(9)
    assert (s.remaining, len(s), list(s), s.num_local_real) == (0, 0, [], 0)


def test_torch_elastic_sampler_repeats_and_skips_on_resize_but_ours_does_not() -> None:
    n, global_batch = 120, 12
    # Phase 1: 4 ranks train 3 steps of 12 (3 per rank), then the job shrinks to 3.
    done = 3 * global_batch

    theirs: Counter[int] = Counter()
    first = [list(TorchElasticSampler(range(n), num_replicas=4, rank=r)) for r in range(4)]
    for share in first:
        theirs.update(share[:3 * 3])
    resumed = [list(TorchElasticSampler(range(n), num_replicas=3, rank=r, start_index=done))
               for r in range(3)]
    for share in resumed:
        theirs.update(share)
    # Padding cannot be told apart in torch's sampler, but 84 rest samples over 3 ranks
    # need none, so every count != 1 is a real repeat or a skip.
    assert sum(len(x) for x in resumed) == n - done
    repeated = [i for i in range(n) if theirs[i] > 1]
    skipped = [i for i in range(n) if theirs[i] == 0]
    assert repeated and skipped and len(repeated) == len(skipped)

    ours: Counter[int] = Counter()
    samplers = _ranks(n, 4)
    batches, consumed = _run_segment(samplers, 3, 3)
    for batch in batches:
        ours.update(batch)
    state = samplers[0].state_dict()
    for r in range(3):
        s = ElasticDistributedSampler(range(n), num_replicas=3, rank=r)
        s.load_state_dict(state)
        s.set_epoch(0)
        ours.update(s.local_indices()[~s.local_padding_mask()].tolist())
    assert consumed == done
    assert ours == Counter(range(n))


def test_dataloader_with_sampler_loads_this_ranks_share() -> None:
    from torch.utils.data import DataLoader

    data = torch.arange(100, 130)
    sampler = ElasticDistributedSampler(data, num_replicas=3, rank=2, seed=4, start_index=7)
    loaded = torch.cat(list(DataLoader(data, batch_size=4, sampler=sampler))).tolist()
    assert loaded == [100 + i for i in sampler.local_indices().tolist()]
    assert len(loaded) == len(sampler) == 8


# -- bad input ------------------------------------------------------------------------


def test_rank_outside_world_is_rejected_with_the_interval() -> None:
    expected = r"Invalid rank 3, rank should be in the interval \[0, 2\]"
    with pytest.raises(ValueError, match=expected):
        ElasticDistributedSampler(range(10), num_replicas=3, rank=3)
    with pytest.raises(ValueError, match=r"Invalid rank -1"):
        ElasticDistributedSampler(range(10), num_replicas=3, rank=-1)


def test_num_replicas_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_replicas=0 must be >= 1"):
        ElasticDistributedSampler(range(10), num_replicas=0, rank=0)


def test_start_index_past_the_end_or_negative_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"start_index=11 .* length 10"):
        ElasticDistributedSampler(range(10), num_replicas=1, rank=0, start_index=11)
    with pytest.raises(ValueError, match=r"start_index=-1"):
        ElasticDistributedSampler(range(10), num_replicas=1, rank=0, start_index=-1)


def test_state_from_dataset_of_other_length_names_both_lengths() -> None:
    sd = ElasticDistributedSampler(range(12), num_replicas=1, rank=0).state_dict()
    s = ElasticDistributedSampler(range(10), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"length 12.*length 10"):
        s.load_state_dict(sd)
    with pytest.raises(CheckpointMismatchError):
        s.load_state_dict(sd)


def test_state_with_missing_keys_or_bad_position_is_rejected() -> None:
    s = ElasticDistributedSampler(range(10), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"missing keys \['consumed'\]"):
        s.load_state_dict({k: v for k, v in s.state_dict().items() if k != "consumed"})
    expected = r"sampler state 'consumed'=11: expected 0 <= consumed <= 10"
    with pytest.raises(ValueError, match=expected):
        s.load_state_dict({**s.state_dict(), "consumed": 11})


def test_zero_length_dataset_is_rejected() -> None:
    with pytest.raises(ValueError, match="dataset has length 0"):
        ElasticDistributedSampler([], num_replicas=1, rank=0)


def test_dataset_without_len_is_rejected() -> None:
    with pytest.raises(TypeError, match="has no __len__"):
        ElasticDistributedSampler(iter(range(3)), num_replicas=1, rank=0)  # type: ignore[arg-type]


def test_advance_past_the_end_or_negative_is_rejected() -> None:
    s = ElasticDistributedSampler(range(10), num_replicas=2, rank=0, start_index=8)
    with pytest.raises(ValueError, match=r"advance\(n=3\) moves past the end.*8 of 10.*2 remain"):
        s.advance(3)
    with pytest.raises(ValueError, match=r"advance\(n=-1\)"):
        s.advance(-1)
    assert s.consumed == 8


@pytest.mark.parametrize("n,w", [(101, 2), (100, 3), (37, 4), (7, 5)])
def test_a_pass_resumed_at_the_same_world_size_pads_as_the_uninterrupted_one(
        n: int, w: int) -> None:
    # The padding has zero weight, but a model that mixes a batch's samples (BatchNorm)
    # sees it: a resume at the same world size must put the same samples through every
    # step, padding included, for the run to stay bitwise the uninterrupted one.
    for rank in range(w):
        whole = ElasticDistributedSampler(range(n), num_replicas=w, rank=rank, seed=3)
        full = whole.local_indices().tolist()
        for start in range(0, n, w):  # a resume lands at a whole step, a multiple of w
            resumed = ElasticDistributedSampler(range(n), num_replicas=w, rank=rank, seed=3)
            resumed.load_state_dict({**resumed.state_dict(), "consumed": start})
            assert resumed.local_indices().tolist() == full[start // w:], (rank, start)
            assert (resumed.local_padding_mask().tolist()
                    == whole.local_padding_mask().tolist()[start // w:])


def test_an_iterator_made_and_never_read_does_not_end_the_epoch() -> None:
    """torch's DataLoader with workers and ``batch_size=None`` calls ``iter(sampler)``
    twice and reads only the second: resumed at an epoch's end, the first (empty)
    iterator marked the epoch ended, and the second dealt the whole epoch again."""
    from elastic_kit import ElasticDistributedSampler

    done = ElasticDistributedSampler(range(6), num_replicas=1, rank=0, seed=0)
    done.set_epoch(0)
    for _ in done:
        pass
    done.advance(6)
    resumed = ElasticDistributedSampler(range(6), num_replicas=1, rank=0, seed=0)
    resumed.load_state_dict(done.state_dict())
    resumed.set_epoch(0)
    unread = iter(resumed)  # made by the loader, never read
    assert list(iter(resumed)) == [] and resumed.remaining == 0
    del unread
