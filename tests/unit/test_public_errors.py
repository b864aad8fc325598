"""The exception types the docs tell users to catch are reachable as
``elastic_kit.<name>``, and the documented split holds: a wrong argument raises a
builtin ``TypeError``/``ValueError`` (not an ``ElasticKitError``), elastic_kit's own
errors subclass ``ElasticKitError`` and a builtin."""

from __future__ import annotations

import pytest
import torch

import elastic_kit as ek
from elastic_kit import errors

NAMES = ["CheckpointConflictError", "BatchPolicyError", "UnsafeCheckpointError",
         "CheckpointError", "CheckpointCorruptError", "CheckpointMismatchError",
         "SampleAuditError", "ElasticKitError"]


@pytest.mark.parametrize("name", NAMES)
def test_every_error_type_is_exported_at_the_top(name: str) -> None:
    assert getattr(ek, name) is getattr(errors, name)
    assert name in ek.__all__ and name in errors.__all__


def test_every_type_in_errors_is_exported() -> None:
    assert sorted(errors.__all__) == sorted(NAMES)


@pytest.mark.parametrize("name, builtin", [
    ("CheckpointConflictError", RuntimeError), ("UnsafeCheckpointError", RuntimeError),
    ("CheckpointError", RuntimeError), ("SampleAuditError", RuntimeError),
    ("BatchPolicyError", ValueError), ("CheckpointMismatchError", ValueError),
])
def test_our_errors_subclass_the_base_and_a_builtin(name: str, builtin: type) -> None:
    cls = getattr(ek, name)
    assert issubclass(cls, ek.ElasticKitError) and issubclass(cls, builtin)


def test_the_loop_configs_batch_error_is_caught_by_its_exported_name() -> None:
    with pytest.raises(ek.BatchPolicyError, match="needs global_batch_size"):
        ek.LoopConfig()


def test_a_wrong_argument_is_a_builtin_error_not_ours(tmp_path) -> None:
    for call, builtin in ((lambda: ek.CheckpointStore("foo://x"), ValueError),
                          (lambda: ek.CheckpointStore(str(tmp_path), keep_last=0), ValueError),
                          (lambda: ek.CheckpointStore(None), TypeError),
                          (lambda: ek.Checkpointer(ek.TrainState(torch.nn.Linear(1, 1)), None,
                                                   every_steps=0), ValueError)):
        with pytest.raises(builtin) as caught:
            call()
        assert not isinstance(caught.value, ek.ElasticKitError)
