"""``python -m elastic_kit.run``: torchrun with the agent's slow imports done first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic_kit.run import LauncherOptions, parse_options


def test_leading_launcher_options_are_taken_off_and_the_rest_is_torchrun_s() -> None:
    argv = ["--preload", "torchvision", "--rdzv-poll", "0.25", "--preload=json,csv",
            "--nnodes=2", "train.py", "--preload", "x", "--rdzv-poll=1"]
    assert parse_options(argv) == LauncherOptions(
        ["torchvision", "json", "csv"], 0.25,
        ["--nnodes=2", "train.py", "--preload", "x", "--rdzv-poll=1"])
    assert parse_options(["--standalone", "t.py"]) == LauncherOptions([], None,
                                                                     ["--standalone", "t.py"])


@pytest.mark.parametrize("argv,message", [
    (["--preload"], "--preload needs a value"),
    (["--preload=a,,b", "t.py"], "no empty names"),
    (["--rdzv-poll"], "--rdzv-poll needs a value"),
    (["--rdzv-poll=0", "t.py"], r"--rdzv-poll '0': expected seconds in \(0, 1\]"),
    (["--rdzv-poll", "2", "t.py"], r"--rdzv-poll '2'"),
    (["--rdzv-poll", "soon", "t.py"], r"--rdzv-poll 'soon'"),
    (["--rdzv-poll", "nan", "t.py"], r"--rdzv-poll 'nan'"),
])
def test_a_bad_launcher_option_is_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(argv)


def _launch(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic_kit.run", *argv],
                          capture_output=True, text=True, timeout=120)


def test_a_module_that_does_not_import_exits_2_naming_it() -> None:
    out = _launch("--preload", "no_such_module_xyz", "--standalone", "t.py")
    assert out.returncode == 2
    assert "cannot import 'no_such_module_xyz'" in out.stderr


def test_a_bad_node_count_exits_2_naming_it() -> None:
    out = _launch("--nnodes=two", "t.py")
    assert out.returncode == 2
    assert "--nnodes 'two': expected N or MIN:MAX" in out.stderr


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


def test_the_agents_rendezvous_reads_its_state_at_the_chosen_poll(tmp_path) -> None:
    # the forked worker, a copy of the agent, reports the agent's rendezvous poll
    script = tmp_path / "probe.py"
    out_file = tmp_path / "poll.txt"
    script.write_text(
        "from datetime import timedelta\n"
        "from types import SimpleNamespace\n"
        "from torch.distributed.elastic.rendezvous import dynamic_rendezvous as d, utils\n"
        "slept = []\n"
        "utils.time = SimpleNamespace(sleep=slept.append)  # what torch's _delay sleeps\n"
        "d._delay(seconds=1)\n"
        "s = d.RendezvousSettings('r', 1, 2, d.RendezvousTimeout(), timedelta(seconds=1), 3)\n"
        f"open({str(out_file)!r}, 'w').write(\n"
        "    f'{slept} {d._BackendRendezvousStateHolder(None, s)._cache_duration}')\n")
    out = _launch("--rdzv-poll", "0.25", "--standalone", "--nproc-per-node=1",
                  "--start-method=fork", "--run-path", str(script))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out_file.read_text() == "[0.25] 0.25"
