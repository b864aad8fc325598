"""``python -m elastic_kit.run``: torchrun with the agent's slow imports done first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from elastic_kit.run import LauncherOptions, parse_options
from elastic_kit.testing import LocalCluster, wait_for

pytestmark = pytest.mark.integration


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
    (["--rdzv-poll=0", "t.py"], r"--rdzv-poll '0': expected seconds in \[0.01, 1\]"),
    (["--rdzv-poll=0.001", "t.py"], r"--rdzv-poll '0.001': expected seconds in \[0.01, 1\]"),
    (["--rdzv-poll", "2", "t.py"], r"--rdzv-poll '2'"),
    (["--rdzv-poll", "soon", "t.py"], r"--rdzv-poll 'soon'"),
    (["--rdzv-poll", "nan", "t.py"], r"--rdzv-poll 'nan'"),
])
def test_a_bad_launcher_option_is_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(argv)


def _launch(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic_kit.run", *argv],
                          capture_output=True, text=True, timeout=120, env=env)


def test_a_module_that_does_not_import_exits_2_naming_it() -> None:
    out = _launch("--preload", "no_such_module_xyz", "--standalone", "t.py")
    assert out.returncode == 2
    assert "cannot import 'no_such_module_xyz'" in out.stderr


def test_a_bad_node_count_exits_2_naming_it() -> None:
    out = _launch("--nnodes=two", "t.py")
    assert out.returncode == 2
    assert "--nnodes 'two': expected N or MIN:MAX" in out.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_names_the_launchers_own_options_then_torchrun_s(flag: str) -> None:
    out = _launch(flag)
    assert out.returncode == 0, out.stderr
    ours = out.stdout.index("--preload MODULE[,MODULE...]")
    assert "--rdzv-poll SECONDS" in out.stdout
    assert "python -m elastic_kit.run" in out.stdout
    assert out.stdout.index("--nnodes") > ours  # torchrun's own options follow


def test_the_agent_has_torch_dynamo_and_the_preloads_before_torchrun_runs(tmp_path) -> None:
    # A forked worker is a copy of the agent: a --run-path script sees its modules
    # (under plain torchrun neither would be imported yet).
    script = tmp_path / "probe.py"
    out_file = tmp_path / "modules.txt"
    script.write_text(
        "import os, sys\n"
        f"open({str(out_file)!r}, 'w').write(' '.join(sorted(m for m in sys.modules "
        "if m in ('torch._dynamo', 'csv'))) + ' ' + "
        "os.environ.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE', 'unset'))\n")
    # and the agent's worker groups get stores of their own unless told otherwise
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    out = _launch("--preload", "csv", "--standalone", "--nproc-per-node=1",
                  "--start-method=fork", "--run-path", str(script), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out_file.read_text() == "csv torch._dynamo 1"


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


LAST_CALL_S = 15  # torch closes an elastic job's open round this long after its minimum

_RECORD = """\
import json, os, time
T0 = time.time()  # the process's start: right after its agent's round closed
starts = {starts!r}
node = os.environ['GROUP_RANK']
again = any(n.startswith(node + '-') for n in os.listdir(starts))


def record():
    with open(os.path.join(starts, f'{{node}}-{{os.getpid()}}'), 'w') as f:
        json.dump({{'node': int(node), 't': T0,
                   'world': int(os.environ['WORLD_SIZE'])}}, f)


"""
#: a node's first worker waits to be killed, or stopped for the restart
_SLEEP = """\
record()
if not again:
    time.sleep(300)
"""
#: ... in a loop of all-reduces, which fails when a peer dies (recorded once in the group)
_COLLECTIVES = """\
import torch, torch.distributed as dist
dist.init_process_group('gloo')
t = torch.zeros(1)
dist.all_reduce(t)
record()
while not again:
    dist.all_reduce(t)
    time.sleep(0.05)
"""


def _recorder(tmp_path: Path, body: str) -> tuple[Path, Callable[[], list[dict[str, Any]]]]:
    """A script whose workers record each start (node, the process's start time, world
    size), then at a node's first start wait (``body``), at a later one exit at once;
    and the reader of the starts, oldest first. The time is taken before any import
    that takes long (torch's), so it measures the rendezvous, not a loaded machine's
    imports."""
    script, starts = tmp_path / "starts.py", tmp_path / "starts"
    starts.mkdir()
    script.write_text(_RECORD.format(starts=str(starts)) + body)

    def started() -> list[dict[str, Any]]:
        return sorted((json.loads(p.read_text()) for p in starts.iterdir()
                       if p.stat().st_size), key=lambda s: s["t"])

    return script, started


def _cluster(tmp_path: Path, script: Path) -> LocalCluster:
    return LocalCluster(
        [str(script)], nnodes="1:3", max_restarts=2, log_dir=tmp_path / "logs",
        rdzv_conf=(f"last_call_timeout={LAST_CALL_S},join_timeout=120,"
                   "keep_alive_interval=1,keep_alive_max_attempt=3"),
        monitor_interval=0.1, launcher="elastic_kit.run", env={"OMP_NUM_THREADS": "1"})


def test_a_restarts_round_closes_when_every_node_is_back_not_after_the_last_call(
        tmp_path: Path) -> None:
    """Two agents of a 1-3 node job under the launcher: a worker's SIGKILL restarts
    both, and their new round closes as soon as both are back (torch's agents would
    wait out the 15 s last call for a third node), with both nodes in it: one restart,
    world size 2 again. The job's first round keeps torch's last call."""
    script, started = _recorder(tmp_path, _SLEEP)
    with _cluster(tmp_path, script) as cluster:
        first = cluster.add_agent()
        cluster.add_agent()
        wait_for(lambda: len(started()) == 2, 120, what="both nodes' first workers",
                 abort_if=cluster.all_exited)
        killed_at = time.time()
        cluster.kill_worker(first)
        assert cluster.wait(120) == [0, 0], cluster.logs()[-6000:]
    # each node's worker started twice (a restart of the group, not a round of one node
    # first and another restart when the second came back), both times with both nodes
    assert sorted(s["node"] for s in started()) == [0, 0, 1, 1], started()
    assert [s["world"] for s in started()] == [2, 2, 2, 2], started()
    restarted = started()[2:]
    assert max(s["t"] for s in restarted) - killed_at < LAST_CALL_S - 5, (killed_at, started())


def test_a_round_that_lost_a_node_closes_once_its_keep_alives_lapse(tmp_path: Path) -> None:
    """The second node is SIGKILLed (agent and worker): the survivor's worker fails,
    and its agent's new round closes once the dead node's keep-alives lapsed (3 s, when
    torch drops the node) instead of a 15 s last call after that."""
    script, started = _recorder(tmp_path, _COLLECTIVES)
    with _cluster(tmp_path, script) as cluster:
        cluster.add_agent()
        second = cluster.add_agent()
        wait_for(lambda: len(started()) == 2, 120, what="both nodes' first workers",
                 abort_if=cluster.all_exited)
        killed_at = time.time()
        cluster.kill_agent(second)
        assert cluster.wait(120)[0] == 0, cluster.logs()[-6000:]
    assert [(s["node"], s["world"]) for s in started()][2:] == [(0, 1)], started()
    assert started()[2]["t"] - killed_at < LAST_CALL_S - 5, (killed_at, started())


def test_forked_workers_start_as_new_processes_would(tmp_path) -> None:
    """Workers forked from the agent: torchrun's thread count applies (the agent's torch
    sized its pool before torchrun set OMP_NUM_THREADS), the agent's signal handlers are
    gone, numpy's and torch's generators differ per worker, the script's directory comes
    first on sys.path (a module beside it imports), the script may choose
    multiprocessing's start method, and the worker's exit handlers run at its end
    (multiprocessing ends a forked child with os._exit)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "beside.py").write_text("WHERE = 'beside the script'\n")
    # a module of the launch directory (python -m's sys.path[0]) still imports
    (tmp_path / "at_launch.py").write_text("WHERE = 'where it was launched'\n")
    script = proj / "probe.py"
    script.write_text(
        "import atexit, json, multiprocessing, os, signal, sys, numpy, torch\n"
        "import beside, at_launch\n"
        "multiprocessing.set_start_method('spawn')\n"
        "rank = os.environ['RANK']\n"
        f"out = {str(tmp_path)!r}\n"
        "facts = {'threads': torch.get_num_threads(), 'omp': os.environ.get('OMP_NUM_THREADS'),\n"
        "         'sigterm': signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,\n"
        "         'sigusr2': signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL,\n"
        "         'draw': float(numpy.random.random_sample()),\n"
        "         'torch_draw': torch.randperm(20).tolist(),\n"
        "         'path0': sys.path[0], 'beside': beside.WHERE,\n"
        "         'start': multiprocessing.get_start_method()}\n"
        "open(os.path.join(out, f'facts{rank}.json'), 'w').write(json.dumps(facts))\n"
        "atexit.register(lambda: open(os.path.join(out, f'exited{rank}'), 'w').close())\n")
    out = subprocess.run([sys.executable, "-m", "elastic_kit.run", "--standalone",
                          "--nproc-per-node=2", "--start-method=fork", "--run-path",
                          str(script)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = [json.loads((tmp_path / f"facts{r}.json").read_text()) for r in (0, 1)]
    for f in facts:
        assert f["omp"] == "1" and f["threads"] == 1, f
        assert f["sigterm"] and f["sigusr2"], f
        assert f["path0"] == str(proj.resolve()) and f["beside"] == "beside the script", f
        assert f["start"] == "spawn", f
    assert facts[0]["draw"] != facts[1]["draw"]
    assert facts[0]["torch_draw"] != facts[1]["torch_draw"]
    assert (tmp_path / "exited0").exists() and (tmp_path / "exited1").exists()


def test_a_forked_worker_that_finished_runs_its_exit_handlers_before_a_peer_fails(
        tmp_path) -> None:
    """Rank 0's script returns, rank 1's fails a moment later: rank 0's exit handlers
    have run, as a new process's do when its script ends (a forked worker waits for the
    agent to collect every worker's result, and the peer's failure ends it with
    SIGTERM there), after the script's other threads ended."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import atexit, os, sys, threading, time\n"
        "rank = os.environ['RANK']\n"
        f"out = {str(tmp_path)!r}\n"
        "def work():\n"
        "    time.sleep(0.5)\n"
        "    open(os.path.join(out, f'order{rank}'), 'a').write('thread done\\n')\n"
        "threading.Thread(target=work).start()\n"
        "atexit.register(lambda: open(os.path.join(out, f'order{rank}'), 'a').write('atexit\\n'))\n"
        "if rank == '1':\n"
        "    time.sleep(2)\n"
        "    sys.exit(3)\n")
    out = _launch("--standalone", "--nproc-per-node=2", "--start-method=fork",
                  "--run-path", str(script))
    assert out.returncode == 1, out.stderr[-3000:]
    assert "exitcode  : 3" in out.stderr, out.stderr[-3000:]
    # as in a new process: the script's threads end before its exit handlers run
    for rank in (0, 1):
        assert (tmp_path / f"order{rank}").read_text().splitlines() == [
            "thread done", "atexit"], rank

