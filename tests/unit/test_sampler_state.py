"""ElasticDistributedSampler.load_state_dict: every entry checked, with the key named."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from elastic_kit.errors import CheckpointMismatchError
from elastic_kit.sampler import ElasticDistributedSampler

LOGGER = "elastic_kit.sampler"


def _sampler(**kwargs) -> ElasticDistributedSampler:
    s = ElasticDistributedSampler(range(10), 2, 1, seed=3, **kwargs)
    s.set_epoch(2)
    s.advance(4)
    return s


GOOD = {"epoch": 5, "consumed": 6, "seed": 3, "dataset_length": 10, "shuffle": True,
        "drop_last": False}


@pytest.mark.parametrize(("key", "bad", "expected"), [
    ("consumed", 3.7, "an int"), ("consumed", "3", "an int"), ("consumed", True, "an int"),
    ("consumed", None, "an int"), ("consumed", torch.tensor([1, 2]), "an int"),
    ("epoch", 1.5, "an int"), ("epoch", np.float32(0.5), "an int"),
    ("seed", "0", "an int"), ("dataset_length", 10.5, "an int"),
    ("shuffle", "yes", "a bool"), ("shuffle", 2, "a bool"), ("drop_last", "no", "a bool"),
    ("drop_last", 0.0, "a bool"),
])
def test_entry_of_the_wrong_type_is_refused_naming_key_and_value(
    key: str, bad: object, expected: str
) -> None:
    s = _sampler()
    before = s.state_dict()
    with pytest.raises(TypeError) as err:
        s.load_state_dict({**GOOD, key: bad})
    message = str(err.value)
    assert message.startswith(f"sampler state {key!r}={bad!r}: expected {expected}")
    assert s.state_dict() == before  # nothing adopted


@pytest.mark.parametrize("make", [int, np.int64, torch.tensor, float, np.float64])
def test_integer_valued_entries_of_numpy_torch_or_float_type_are_adopted_as_ints(make) -> None:
    s = _sampler()
    s.load_state_dict({**GOOD, "epoch": make(5), "consumed": make(6), "seed": make(3),
                       "dataset_length": make(10)})
    assert s.state_dict() == GOOD
    assert all(type(getattr(s, k)) is int for k in ("epoch", "consumed", "seed"))
    assert (len(s), list(s)) == (2, s.permutation(5)[7::2].tolist())


def test_numpy_torch_and_integer_booleans_are_adopted_as_bools() -> None:
    s = _sampler()
    s.load_state_dict({**GOOD, "shuffle": np.False_, "drop_last": torch.tensor(False)})
    assert (s.shuffle, type(s.shuffle), s.drop_last) == (False, bool, False)
    s.load_state_dict({**GOOD, "shuffle": 1})
    assert (s.shuffle, type(s.shuffle)) == (True, bool)


def test_out_of_range_position_and_epoch_are_refused_naming_key() -> None:
    s = _sampler()
    with pytest.raises(ValueError, match=r"^sampler state 'consumed'=-1: expected 0 <= "):
        s.load_state_dict({**GOOD, "consumed": -1})
    with pytest.raises(ValueError, match=r"^sampler state 'epoch'=-2: expected >= 0$"):
        s.load_state_dict({**GOOD, "epoch": -2})
    with pytest.raises(CheckpointMismatchError, match=r"length 11.*length 10"):
        s.load_state_dict({**GOOD, "dataset_length": 11})
    assert (s.epoch, s.consumed) == (2, 4)


def test_state_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(TypeError, match=r"sampler state of type list: expected a mapping"):
        _sampler().load_state_dict([("epoch", 1)])  # type: ignore[arg-type]


def test_checkpointed_drop_last_does_not_override_how_this_script_consumes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Saved by a drop_last=True script at 7 of 11; resumed by a padding script.
    src = ElasticDistributedSampler(range(11), 2, 0, drop_last=True)
    src.advance(7)
    state = src.state_dict()
    assert state["drop_last"] is True
    samplers = [ElasticDistributedSampler(range(11), 3, r) for r in range(3)]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for s in samplers:
            s.load_state_dict(state)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 3 and "drop_last=True" in infos[0].getMessage()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [s.drop_last for s in samplers] == [False] * 3
    assert [s.state_dict()["drop_last"] for s in samplers] == [False] * 3
    # The rest of the epoch (4 samples) padded to 2 per rank, every sample once.
    assert [len(s) for s in samplers] == [2, 2, 2]
    real = [i for s in samplers for i, pad in zip(s.local_indices().tolist(),
                                                  s.local_padding_mask().tolist()) if not pad]
    assert sorted(real) == sorted(src.permutation()[7:].tolist())
    for s in samplers:
        s.advance(3)
        s.advance(1)  # to the end: the padding loop's last step
    assert [s.remaining for s in samplers] == [0] * 3


def test_seed_and_shuffle_come_from_the_state_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = ElasticDistributedSampler(range(10), 1, 0, shuffle=True, seed=1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s.load_state_dict({**GOOD, "seed": 9, "shuffle": False, "consumed": 4})
    assert (s.seed, s.shuffle) == (9, False)
    assert "seed=9, constructor had 1" in caplog.text
    assert "shuffle=False, constructor had True" in caplog.text
    assert list(s) == [4, 5, 6, 7, 8, 9]
