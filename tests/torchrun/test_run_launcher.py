"""``python -m elastic_kit.run``: torchrun with the agent's slow imports done first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic_kit.run import split_preload


def test_leading_preload_options_are_taken_off_and_the_rest_is_torchrun_s() -> None:
    argv = ["--preload", "torchvision", "--preload=json,csv", "--nnodes=2", "train.py",
            "--preload", "x"]
    assert split_preload(argv) == (["torchvision", "json", "csv"],
                                   ["--nnodes=2", "train.py", "--preload", "x"])
    assert split_preload(["--standalone", "t.py"]) == ([], ["--standalone", "t.py"])


@pytest.mark.parametrize("argv,message", [
    (["--preload"], "--preload needs a value"),
    (["--preload=a,,b", "t.py"], "no empty names"),
])
def test_a_bad_preload_option_is_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_preload(argv)


def _launch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic_kit.run", *argv],
                          capture_output=True, text=True, timeout=120)


def test_a_module_that_does_not_import_exits_2_naming_it() -> None:
    out = _launch("--preload", "no_such_module_xyz", "--standalone", "t.py")
    assert out.returncode == 2
    assert "cannot import 'no_such_module_xyz'" in out.stderr


def test_the_agent_has_torch_dynamo_and_the_preloads_before_torchrun_runs(tmp_path) -> None:
    # A forked worker is a copy of the agent: a --run-path script sees its modules
    # (under plain torchrun neither would be imported yet).
    script = tmp_path / "probe.py"
    out_file = tmp_path / "modules.txt"
    script.write_text(
        "import sys\n"
        f"open({str(out_file)!r}, 'w').write(' '.join(sorted(m for m in sys.modules "
        "if m in ('torch._dynamo', 'csv'))))\n")
    out = _launch("--preload", "csv", "--standalone", "--nproc-per-node=1",
                  "--start-method=fork", "--run-path", str(script))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out_file.read_text() == "csv torch._dynamo"
