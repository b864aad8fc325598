"""A module state dict's ``_metadata`` (each module's ``version``, which
``load_state_dict`` reads to migrate older formats) survives every way the library
copies, saves and restores a state: without it a module takes a current state for the
oldest format and migrates it (a quantization observer resets its ``eps``).
"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch.ao.quantization.observer import MinMaxObserver

from elastic_kit.store import (
    CheckpointStore, Layout, commit_flat, copy_tensors, hash_flat, map_file, map_tree, open_flat,
    plan_flat, split_state, tensor_views,
)
from elastic_kit.store._broadcast import fill_tensors, split_tensors
from elastic_kit.store._serialize import prepare_state


class _Doubled(torch.nn.Module):
    """Version 1 stored ``half``; version 2 stores ``scale`` = 2 * half."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.zeros(3))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], *args: Any) -> None:
        if local_metadata.get("version", 1) < 2:
            state_dict[prefix + "scale"] = 2 * state_dict.pop(prefix + "half")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def _model() -> torch.nn.Module:
    m = torch.nn.Sequential(MinMaxObserver(eps=1e-3), _Doubled())
    m[0](torch.linspace(-2.0, 3.0, 10))
    m[1].scale.copy_(torch.tensor([1.0, 2.0, 3.0]))
    return m


def _check_restores(saved: collections.OrderedDict, loaded: Any) -> None:
    assert type(loaded) is collections.OrderedDict
    assert loaded._metadata == saved._metadata
    fresh = torch.nn.Sequential(MinMaxObserver(eps=1e-3), _Doubled())
    fresh.load_state_dict(loaded)
    assert fresh[0].eps.item() == pytest.approx(1e-3)
    assert fresh[0].min_val.item() == -2.0 and fresh[0].max_val.item() == 3.0
    assert fresh[1].scale.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_saved_module_state_keeps_its_versions_and_loads_like_the_original(
        tmp_path: Path, blocking: bool) -> None:
    sd = _model().state_dict()
    assert sd._metadata == {"": {"version": 1}, "0": {"version": 3}, "1": {"version": 2}}
    store = CheckpointStore(str(tmp_path / "ck"))
    store.save({"model": sd, "step": 4}, step=4, blocking=blocking).wait()
    loaded = store.load()
    store.close()
    assert loaded is not None and loaded.step == 4
    _check_restores(sd, loaded.state["model"])


def test_a_flat_snapshot_keeps_the_versions_in_its_payload(tmp_path: Path) -> None:
    sd = _model().state_dict()
    layout = Layout(fsspec.filesystem("file"), str(tmp_path / "store"),
                    url=str(tmp_path / "store"))
    payload, items = split_state({"model": sd})
    plan = plan_flat(items)
    mapped = map_file(str(tmp_path / "slot.bin"), plan.size)
    copy_tensors([(v, t) for v, (_, t) in zip(tensor_views(mapped, plan), items)])
    commit_flat(layout, step=1, flat_path=str(tmp_path / "slot.bin"), plan=plan,
                hashes=hash_flat(mapped, plan), payload=payload, metadata={})
    restored = open_flat(layout, layout.dir_of(1), map_location="cpu").state
    _check_restores(sd, restored["model"])


def test_the_broadcast_skeleton_keeps_the_versions() -> None:
    sd = _model().state_dict()
    tensors: list[torch.Tensor] = []
    skeleton = pickle.loads(pickle.dumps(split_tensors({"model": sd}, tensors)))
    _check_restores(sd, fill_tensors(skeleton, tensors)["model"])


def test_a_staged_copy_holds_its_own_versions() -> None:
    sd = _model().state_dict()
    staged = prepare_state({"model": sd}, copy=True)["model"]
    sd._metadata["1"]["version"] = 1  # the live state changes after staging
    assert staged._metadata == {"": {"version": 1}, "0": {"version": 3}, "1": {"version": 2}}


@pytest.mark.parametrize("metadata", [
    {"": {"version": object()}},           # a value weights-only loading refuses
    {1: {"version": 1}},                   # not a module prefix
    {"": [("version", 1)]},                # not a dict
    ["version"],
])
def test_metadata_of_another_form_is_dropped(metadata: Any) -> None:
    od = collections.OrderedDict(w=torch.ones(2))
    od._metadata = metadata
    out = map_tree(od, lambda _, v: v)
    assert list(out) == ["w"] and torch.equal(out["w"], torch.ones(2))
    assert not hasattr(out, "_metadata")
