"""A TrainState checkpoint of a model whose load hooks migrate old key names (a layer
renamed since the checkpoint was written) loads as torch's ``load_state_dict`` loads
it; one that still does not fit after the hooks is refused before anything changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.errors import CheckpointMismatchError


class _Old(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.bn = nn.BatchNorm1d(2)


def _migrate(sd: dict[str, Any], prefix: str, *_: Any) -> None:
    for k in [k for k in sd if k.startswith(prefix + "fc.")]:
        sd[prefix + "proj." + k[len(prefix) + 3:]] = sd.pop(k)


class _New(nn.Module):
    """``_Old`` with ``fc`` renamed ``proj``, and a hook that maps the old names."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.bn = nn.BatchNorm1d(2)
        self._register_load_state_dict_pre_hook(_migrate)


class _Outer(nn.Module):
    """The hook on a submodule: it sees the keys under its own prefix."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(2, 1)


def _save(model: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_()
    ek.save_checkpoint(ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                       path, step=3)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("nested", [False, True])
def test_a_checkpoint_the_load_hooks_migrate_is_loaded(tmp_path: Path, nested: bool) -> None:
    old = _Outer(_Old()) if nested else _Old()
    saved = _save(old, tmp_path)
    new = _Outer(_New()) if nested else _New()
    loaded = ek.load_checkpoint(ek.TrainState(new, torch.optim.SGD(new.parameters(), lr=0.1)),
                                tmp_path)
    assert loaded.step == 3
    got = new.state_dict()
    prefix = "inner." if nested else ""
    for k, v in saved.items():
        assert torch.equal(got[k.replace(prefix + "fc.", prefix + "proj.")], v), k


def test_a_checkpoint_that_does_not_fit_after_the_hooks_changes_nothing(tmp_path: Path) -> None:
    class Other(nn.Module):  # the hook maps fc -> proj, but this model has "out"
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(2, 2)
            self.bn = nn.BatchNorm1d(2)
            self._register_load_state_dict_pre_hook(_migrate)

    _save(_Old(), tmp_path)
    other = Other()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError,
                       match=r"missing keys \['out.weight', 'out.bias'\], unexpected keys "
                             r"\['proj.weight', 'proj.bias'\] \(keys as the model's load "
                             r"hooks leave them\); nothing was loaded"):
        ek.load_checkpoint(ek.TrainState(other, torch.optim.SGD(other.parameters(), lr=0.1)),
                           tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_a_hook_runs_on_meta_copies_before_the_load(tmp_path: Path) -> None:
    # a hook that changes values in place must not change them twice (once in the
    # check, once in the load)
    def double(sd: dict[str, Any], prefix: str, *_: Any) -> None:
        _migrate(sd, prefix)
        sd[prefix + "proj.bias"].mul_(2)

    saved = _save(_Old(), tmp_path)
    new = _New()
    new._register_load_state_dict_pre_hook(double)
    ek.load_checkpoint(ek.TrainState(new, torch.optim.SGD(new.parameters(), lr=0.1)), tmp_path)
    assert torch.equal(new.proj.bias, saved["fc.bias"] * 2)
