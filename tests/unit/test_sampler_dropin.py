"""ElasticDistributedSampler as a drop-in for torch's DistributedSampler and elastic sampler.

Compared against ``torch.utils.data.DistributedSampler`` itself: the constructor, the
attributes, ``len()`` and (without shuffling, where both orders are ``0..N-1``) the
very indices each rank yields.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch.distributed.elastic.utils.data import (
    ElasticDistributedSampler as TorchElasticSampler,
)
from torch.utils.data import DistributedSampler

from elastic_kit.sampler import ElasticDistributedSampler

ATTRS = ("num_samples", "total_size", "num_replicas", "rank", "epoch", "shuffle", "seed",
         "drop_last")


def _params(cls: type) -> list[tuple[str, object]]:
    sig = inspect.signature(cls.__init__)
    return [(p.name, p.default) for p in list(sig.parameters.values())[1:]
            if p.kind is p.POSITIONAL_OR_KEYWORD]


def test_positional_parameters_match_distributed_sampler_in_name_order_and_default() -> None:
    assert _params(ElasticDistributedSampler) == _params(DistributedSampler) == [
        ("dataset", inspect.Parameter.empty), ("num_replicas", None), ("rank", None),
        ("shuffle", True), ("seed", 0), ("drop_last", False),
    ]
    # torch's elastic sampler shares the first three; its start_index is keyword-only here.
    assert [name for name, _ in _params(TorchElasticSampler)][:3] == [
        "dataset", "num_replicas", "rank"]
    start = inspect.signature(ElasticDistributedSampler.__init__).parameters["start_index"]
    assert (start.kind, start.default) == (inspect.Parameter.KEYWORD_ONLY, 0)


def _attrs(sampler: object) -> dict[str, object]:
    return {name: getattr(sampler, name) for name in ATTRS}


@pytest.mark.parametrize("n", [1, 3, 10, 12, 13, 17])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_attributes_len_and_unshuffled_indices_equal_distributed_samplers(
    n: int, world: int, drop_last: bool
) -> None:
    for rank in range(world):
        theirs = DistributedSampler(range(n), world, rank, False, 7, drop_last)
        if n < world:
            # DistributedSampler deals some ranks only padding (with drop_last, every
            # rank nothing); a dataset smaller than the world size is refused here.
            assert theirs.num_samples <= 1
            with pytest.raises(ValueError, match=f"fewer than num_replicas={world}"):
                ElasticDistributedSampler(range(n), world, rank, False, 7, drop_last)
            continue
        ours = ElasticDistributedSampler(range(n), world, rank, False, 7, drop_last)
        assert _attrs(ours) == _attrs(theirs)
        assert len(ours) == len(theirs)
        # Without shuffling both deal 0..N-1 padded by cycling from the start.
        assert list(ours) == list(theirs)
        assert _attrs(ours) == _attrs(theirs)  # iterating keeps the same meaning
        shuffled = ElasticDistributedSampler(range(n), world, rank, True, 7, drop_last)
        reference = DistributedSampler(range(n), world, rank, True, 7, drop_last)
        shuffled.set_epoch(3)
        reference.set_epoch(3)
        assert _attrs(shuffled) == _attrs(reference)
        assert len(shuffled) == len(reference) == len(list(shuffled))


def test_keyword_and_positional_construction_give_the_same_sampler() -> None:
    positional = ElasticDistributedSampler(range(20), 4, 1, False, 9, True)
    keywords = ElasticDistributedSampler(
        dataset=range(20), num_replicas=4, rank=1, shuffle=False, seed=9, drop_last=True)
    assert _attrs(positional) == _attrs(keywords) == {
        "num_samples": 5, "total_size": 20, "num_replicas": 4, "rank": 1, "epoch": 0,
        "shuffle": False, "seed": 9, "drop_last": True,
    }
    assert list(positional) == list(keywords) == [1, 5, 9, 13, 17]
    # The three-argument call of torch's elastic sampler and scripts built on it.
    s = ElasticDistributedSampler(range(10), 2, 0)
    assert (s.num_replicas, s.rank, s.shuffle, s.consumed) == (2, 0, True, 0)
    assert ElasticDistributedSampler(range(10), 2, 0, start_index=4).consumed == 4


def test_start_index_given_fourth_as_for_torchs_elastic_sampler_is_refused() -> None:
    # Silently reading 5 as shuffle=True would drop the resume position.
    with pytest.raises(TypeError, match=r"shuffle=5: expected a bool.*start_index=") as err:
        ElasticDistributedSampler(range(10), 2, 0, 5)  # type: ignore[arg-type]
    assert "keyword-only" in str(err.value)


@pytest.mark.parametrize("make", [np.int64, np.int32, np.uint8, torch.tensor, int])
def test_numpy_and_torch_integers_are_accepted_wherever_an_int_is(make) -> None:
    s = ElasticDistributedSampler(range(10), make(2), make(1), seed=make(3),
                                  start_index=make(2))
    plain = ElasticDistributedSampler(range(10), 2, 1, seed=3, start_index=2)
    assert _attrs(s) == _attrs(plain)
    assert all(type(getattr(s, a)) is int for a in ("num_replicas", "rank", "seed", "epoch"))
    s.set_epoch(make(2))
    plain.set_epoch(2)
    assert (s.epoch, type(s.epoch), s.consumed) == (2, int, 2)
    s.advance(make(2))
    plain.advance(2)
    assert list(s) == list(plain)
    assert s.local_indices(position=make(4)).tolist() == plain.local_indices(position=4).tolist()
    assert torch.equal(s.permutation(make(5)), plain.permutation(5))


@pytest.mark.parametrize("bad", [2.0, 1.5, np.float64(2.0), torch.tensor(2.0), "2", None])
def test_non_integer_epoch_is_refused_with_the_value(bad) -> None:
    s = ElasticDistributedSampler(range(10), 2, 0)
    with pytest.raises(TypeError, match=r"epoch=.*: expected an int") as err:
        s.set_epoch(bad)
    assert repr(bad) in str(err.value)
    assert s.epoch == 0


@pytest.mark.parametrize("bad", [True, np.True_, torch.tensor(True)])
def test_booleans_are_refused_as_ints(bad) -> None:
    with pytest.raises(TypeError, match=r"rank=.*: expected an int, got a bool$"):
        ElasticDistributedSampler(range(10), 2, bad)
    with pytest.raises(TypeError, match=r"epoch=.*: expected an int, got a bool$"):
        ElasticDistributedSampler(range(10), 2, 0).set_epoch(bad)


@pytest.mark.parametrize("name", ["num_replicas", "rank", "seed", "start_index"])
def test_float_constructor_arguments_are_refused_naming_the_argument(name: str) -> None:
    kwargs = {"num_replicas": 2, "rank": 0, "seed": 0, "start_index": 0, name: 1.0}
    with pytest.raises(TypeError, match=rf"^{name}=1.0: expected an int .*got float$"):
        ElasticDistributedSampler(range(10), **kwargs)


def test_numpy_and_torch_booleans_are_accepted_for_shuffle_and_drop_last() -> None:
    s = ElasticDistributedSampler(range(10), 3, 0, np.False_, drop_last=torch.tensor(True))
    assert (s.shuffle, s.drop_last, type(s.shuffle), type(s.drop_last)) == (
        False, True, bool, bool)
    assert list(s) == [0, 3, 6]
    with pytest.raises(TypeError, match=r"drop_last='yes': expected a bool, got str"):
        ElasticDistributedSampler(range(10), 3, 0, drop_last="yes")  # type: ignore[arg-type]


def test_is_a_distributed_sampler_so_frameworks_keep_it_instead_of_wrapping_it() -> None:
    """Lightning replaces or wraps a loader's sampler unless
    ``isinstance(sampler, DistributedSampler)``: wrapped, each rank would train on a
    shard of its own share."""
    ours = ElasticDistributedSampler(range(12), 3, 2, seed=4)
    assert isinstance(ours, DistributedSampler)
    ours.set_epoch(1)
    # every method DistributedSampler has is ours: nothing falls back to its state
    for name in ("__init__", "__iter__", "__len__", "set_epoch"):
        assert getattr(ElasticDistributedSampler, name) is not getattr(DistributedSampler, name)
    assert len(list(ours)) == len(ours) == ours.num_samples == 4 and ours.total_size == 12

