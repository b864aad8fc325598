"""Storage options given for a local path: fsspec's local filesystem takes any keyword
and ignores it, so a typo (or an S3 credential for a path meant to be on S3) passed in
silence, and the CLI's "bad storage option" exit status did not hold for local paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_kit.cli import EXIT_USAGE, main
from elastic_kit.store import CheckpointStore


def test_an_option_the_local_filesystem_does_not_use_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"storage_options=\{'zzz': 1\}.*'file'.*\['zzz'\]"):
        CheckpointStore(str(tmp_path), storage_options={"zzz": 1})


def test_the_cli_exits_2_for_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(tmp_path), "--storage-options", '{"key": "AKIA"}']) == EXIT_USAGE
    assert "'key'" in capsys.readouterr().err


def test_the_options_it_does_use_are_taken(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), storage_options={"auto_mkdir": True,
                                                            "skip_instance_cache": True})
    store.save({"w": torch.ones(3)}, step=1)
    loaded = store.load()
    assert loaded is not None and loaded.step == 1
