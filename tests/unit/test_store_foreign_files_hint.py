"""A store directory that holds only a script's own ``torch.save`` file has no
checkpoint to restore: that is said with a pointer to the carry-over recipe, once,
so a user who pointed a resumed run at it does not retrain from scratch unwarned."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from elastic_kit.store import CheckpointStore

_HINT = "is not an elastic_kit checkpoint (a torch.save file?)"


def test_a_torch_save_file_alone_is_named_once_with_the_recipe(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "checkpoint.pth.tar")
    (tmp_path / "notes.txt").write_text("not a checkpoint either, but no hint")
    store = CheckpointStore(tmp_path.as_uri())
    with caplog.at_level(logging.WARNING, logger="elastic_kit.store"):
        assert store.latest_step() is None
        assert store.load() is None
        assert store.latest_step() is None
    hints = [r.getMessage() for r in caplog.records if _HINT in r.getMessage()]
    assert len(hints) == 1, hints
    assert hints[0].startswith("checkpoint.pth.tar in ")
    assert "Coming from torch.save" in hints[0]
    assert "notes.txt" not in caplog.text


def test_no_hint_once_the_store_holds_its_own_checkpoints(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path.as_uri())
    store.save({"w": torch.ones(2)}, step=3)
    torch.save({"w": torch.ones(2)}, tmp_path / "model_best.pth")  # a script's extra file
    with caplog.at_level(logging.WARNING, logger="elastic_kit.store"):
        assert store.latest_step() == 3
        loaded = store.load()
    assert loaded is not None and loaded.step == 3
    assert _HINT not in caplog.text
