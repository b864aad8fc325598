"""``keep_last``, ``node_local`` and ``storage_options`` configure the store a
Checkpointer makes from a URL. Given beside a store object they were dropped in
silence (the object's own retention won); they are refused with a ``TypeError``, as
``save_checkpoint`` refuses them, and leaving them out stays fine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import elastic_kit as ek


def _state() -> ek.TrainState:
    model = nn.Linear(2, 1)
    return ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("options, named", [
    ({"keep_last": 10}, "['keep_last']"),
    ({"keep_last": 3}, "['keep_last']"),          # the default's value, but given
    ({"keep_last": None}, "['keep_last']"),
    ({"node_local": True}, "['node_local']"),
    ({"node_local": False}, "['node_local']"),
    ({"storage_options": {"anon": True}}, "['storage_options']"),
    ({"keep_last": 10, "node_local": True}, "['keep_last', 'node_local']"),
])
def test_store_options_beside_a_store_object_are_refused(
        tmp_path: Path, options: dict[str, Any], named: str) -> None:
    store = ek.CheckpointStore(str(tmp_path), keep_last=2, info=ek.DistInfo())
    with pytest.raises(TypeError) as caught:
        ek.Checkpointer(_state(), store, info=ek.DistInfo(), **options)
    message = str(caught.value)
    assert f"options {named} configure a new store" in message
    assert f"CheckpointStore({str(tmp_path)!r}, keep_last=2" in message
    assert store.keep_last == 2


def test_a_store_object_alone_and_the_configs_options_are_taken(tmp_path: Path) -> None:
    store = ek.CheckpointStore(str(tmp_path), keep_last=2, info=ek.DistInfo())
    plain = ek.Checkpointer(_state(), store, info=ek.DistInfo())
    assert plain.store is store and store.keep_last == 2
    cfg = dataclasses.replace(ek.CheckpointerConfig(every_steps=5), blocking=True)
    assert cfg.keep_last == 3 and repr(cfg.keep_last) == "3"
    looped = ek.Checkpointer(_state(), store, **cfg.options(), info=ek.DistInfo())
    assert looped.store is store and looped.every_steps == 5


def test_a_url_still_takes_the_options_and_their_defaults(tmp_path: Path) -> None:
    made = ek.Checkpointer(_state(), str(tmp_path / "a"), keep_last=10, node_local=True,
                           info=ek.DistInfo())
    assert (made.store.keep_last, made.store.node_local) == (10, True)
    default = ek.Checkpointer(_state(), str(tmp_path / "b"), info=ek.DistInfo())
    assert (default.store.keep_last, default.store.node_local) == (3, False)
    assert type(default.store.keep_last) is int
    made.store.close()
    default.store.close()


def test_the_loop_refuses_a_keep_last_beside_its_store_object_when_made(tmp_path: Path) -> None:
    store = ek.CheckpointStore(str(tmp_path), keep_last=2, info=ek.DistInfo())
    data = [(torch.randn(2), torch.randn(1)) for _ in range(4)]

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        return (model(batch[0]) - batch[1]).pow(2).squeeze(1)

    config = ek.LoopConfig(global_batch_size=4,
                           checkpoint=ek.CheckpointerConfig(keep_last=10))
    with pytest.raises(TypeError, match=r"config.checkpoint.keep_last=10 configures a store "
                                        r"made from a URL"):
        ek.ElasticLoop(_state(), data, loss_fn=loss, store=store, config=config)
    fine = ek.ElasticLoop(_state(), data, loss_fn=loss, store=store,
                          config=ek.LoopConfig(global_batch_size=4))
    assert fine.store is store
