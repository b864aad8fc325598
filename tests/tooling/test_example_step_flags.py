"""Every example takes ``--checkpoint-every`` and ``--snapshot-every`` as numbers of
steps >= 0 (``auto`` for snapshots), and refuses anything else at parse time with the
value named, before any process group is set up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"own_loop": ROOT / "examples" / "own_loop" / "train.py",
            "fsdp": ROOT / "examples" / "fsdp" / "train.py",
            "imagenet": ROOT / "examples" / "imagenet" / "main.py"}


def _load(name: str) -> ModuleType:
    key = f"elastic_kit_example_{name}_flags"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES[name])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_numbers_of_steps_and_auto_parse(name: str) -> None:
    p = _load(name).build_parser()
    args = p.parse_args(["--checkpoint-every", "0", "--snapshot-every", "0"])
    assert (args.checkpoint_every, args.snapshot_every) == (0, 0)
    args = p.parse_args(["--checkpoint-every", "7", "--snapshot-every", "auto"])
    assert (args.checkpoint_every, args.snapshot_every) == (7, "auto")
    assert p.parse_args(["--snapshot-every", "5"]).snapshot_every == 5


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.parametrize("flag,value", [("--checkpoint-every", "-1"),
                                        ("--checkpoint-every", "auto"),
                                        ("--snapshot-every", "x"),
                                        ("--snapshot-every", "-2")])
def test_a_bad_number_of_steps_is_a_usage_error_naming_it(
        name: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _load(name).build_parser().parse_args([flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: '{value}': expected" in err and "steps >= 0" in err
