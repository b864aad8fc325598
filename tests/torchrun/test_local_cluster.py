"""Fast checks of elastic_kit.testing itself (no training, no torch in the children).

The point of the utility is that a killed "node" really is gone, workers in their own
sessions included, and that nothing a cluster started outlives ``close()``.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

from elastic_kit.testing import (  # noqa: E402
    MARKER_ENV,
    EtcdServer,
    LocalCluster,
    kill_process_tree,
    reserve_port,
    wait_for,
)
from elastic_kit.testing._proc import signal_pending  # noqa: E402

pytestmark = pytest.mark.integration

# A stand-in for torchrun: it starts a "worker" in its own session (as torchrun does),
# writes the worker's pid to a file, and then sleeps.
_FAKE_AGENT = textwrap.dedent("""
    import subprocess, sys, time
    out = sys.argv[1]
    w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
    open(out + ".tmp", "w").write(str(w.pid))
    import os; os.replace(out + ".tmp", out)
    time.sleep(600)
""")


def _read_pid(path: Path, timeout: float = 30.0) -> int:
    return int(wait_for(lambda: path.exists() and path.read_text(), timeout, what=f"{path}"))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def fake_agent(tmp_path: Path):
    """A process tree like an agent's: parent plus a child in a new session."""
    script = tmp_path / "fake_agent.py"
    script.write_text(_FAKE_AGENT)
    pid_file = tmp_path / "worker.pid"
    proc = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    worker = _read_pid(pid_file)
    yield proc, worker
    for pid in (proc.pid, worker):
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_kill_process_tree_kills_children_in_other_sessions(fake_agent) -> None:
    proc, worker = fake_agent
    assert os.getsid(worker) != os.getsid(proc.pid), "the fake worker must be in its own session"
    killed = kill_process_tree(proc.pid)
    proc.wait(timeout=10)
    assert proc.pid in killed and worker in killed
    wait_for(lambda: not _alive(worker), 60, what=f"worker {worker} to die")


def test_kill_process_tree_of_a_gone_pid_is_a_no_op() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert kill_process_tree(p.pid) == []


def test_command_carries_every_torchrun_option(tmp_path: Path) -> None:
    c = LocalCluster(["train.py", "--lr", "0.1"], nnodes="2:4", nproc_per_node=2,
                     rdzv_id="abc", max_restarts=5, log_dir=tmp_path, monitor_interval=0.25)
    cmd = c.command()
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    for opt in ("--nnodes=2:4", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-id=abc",
                "--max-restarts=5", "--monitor-interval=0.25",
                "--rdzv-conf=last_call_timeout=1,join_timeout=60"):
        assert opt in cmd, (opt, cmd)
    assert cmd[-3:] == ["train.py", "--lr", "0.1"]
    assert c.rdzv_endpoint.startswith("127.0.0.1:")
    with LocalCluster(["-m", "pkg.train"], log_dir=tmp_path) as m:
        assert m.command()[-2:] == ["--module", "pkg.train"]
    env = c._agent_env({"X": "1"})
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["X"] == "1"
    assert env[MARKER_ENV] == c.marker
    c.close()


def test_fresh_ids_and_ports_per_cluster(tmp_path: Path) -> None:
    with LocalCluster(["t.py"], log_dir=tmp_path) as a, \
            LocalCluster(["t.py"], log_dir=tmp_path) as b:
        assert a.rdzv_id != b.rdzv_id and a.marker != b.marker
        assert a.rdzv_endpoint != b.rdzv_endpoint


def _taken(port: int) -> bool:
    """Whether a plain bind (no SO_REUSEADDR, as most sockets) of ``port`` is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            assert e.errno == errno.EADDRINUSE, e
            return True
        return False


def test_a_reserved_port_is_refused_to_others_and_free_once_closed() -> None:
    port = reserve_port()
    assert port.held and port.endpoint == f"127.0.0.1:{port.port}"
    assert _taken(port.port)
    port.close()
    port.close()  # idempotent
    assert not port.held and not _taken(port.port)


def test_a_server_that_reuses_addresses_listens_on_a_reserved_port() -> None:
    """What every server the helpers start does (torch's TCPStore, etcd, http.server)."""
    from datetime import timedelta

    import torch.distributed as dist

    with reserve_port() as port:
        for libuv in (True, False):
            store = dist.TCPStore("127.0.0.1", port.port, 1, True, use_libuv=libuv,
                                  timeout=timedelta(seconds=30))
            store.set("k", "v")
            assert store.get("k") == b"v"
            del store


def test_the_rendezvous_port_is_the_clusters_from_construction_until_close(
        tmp_path: Path) -> None:
    """The first agent binds its store seconds after the port is chosen (it imports
    torch first); a socket that took the port meanwhile would have made torchrun's c10d
    backend join whatever store listened there. Nothing else may take it."""
    cluster = LocalCluster(["t.py"], log_dir=tmp_path)
    port = int(cluster.rdzv_endpoint.rpartition(":")[2])
    assert _taken(port)
    cluster.close()
    assert not _taken(port)


# A stand-in for etcd: reports whether its client port could have been taken by anyone
# else while it started, then answers the health check.
_FAKE_ETCD = textwrap.dedent("""
    import errno, socket, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from pathlib import Path
    args = sys.argv[1:]
    port = int(args[args.index("--listen-client-urls") + 1].rpartition(":")[2])
    data = Path(args[args.index("--data-dir") + 1])
    data.mkdir(parents=True, exist_ok=True)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        seen = "free"
    except OSError as e:
        seen = "taken" if e.errno == errno.EADDRINUSE else repr(e)
    s.close()
    (data / "client-port").write_text(seen)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"health":"true"}')

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


def test_etcd_ports_are_held_while_etcd_starts(tmp_path: Path) -> None:
    fake = tmp_path / "fake-etcd"
    fake.write_text(f"#!{sys.executable}\n{_FAKE_ETCD}")
    fake.chmod(0o700)
    etcd = EtcdServer(binary=str(fake), data_dir=tmp_path / "data",
                      log_path=tmp_path / "etcd.log")
    with etcd:
        assert (tmp_path / "data" / "client-port").read_text() == "taken"
        assert _taken(etcd.peer_port)
        peer = etcd.peer_port
    assert not _taken(peer)


@pytest.mark.parametrize("kwargs, message", [
    ({"nproc_per_node": 0}, "nproc_per_node=0"),
    ({"max_restarts": -1}, "max_restarts=-1"),
    ({"rdzv_backend": "etcd-v2"}, "rdzv_endpoint"),
])
def test_bad_arguments_are_named(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LocalCluster(["t.py"], log_dir=tmp_path, **kwargs)


def test_close_kills_orphans_of_an_agent_that_died_alone(tmp_path: Path) -> None:
    """A worker whose agent already exited is found by the cluster's environment marker."""
    script = tmp_path / "fake_agent.py"
    script.write_text(_FAKE_AGENT)
    pid_file = tmp_path / "worker.pid"
    cluster = LocalCluster(["unused.py"], log_dir=tmp_path, rdzv_backend="c10d")
    # Run the fake agent instead of torchrun, with the cluster's environment.
    cluster.command = lambda: [sys.executable, str(script), str(pid_file)]  # type: ignore[method-assign]
    agent = cluster.add_agent()
    worker = _read_pid(pid_file)
    os.kill(agent.pid, signal.SIGKILL)       # the agent dies on its own: the worker is orphaned
    agent.proc.wait(timeout=10)
    assert _alive(worker)
    cluster.close()
    wait_for(lambda: not _alive(worker), 60, what=f"orphan {worker} to die")
    assert "###" in agent.read_log()


def test_kill_agent_pause_and_resume(tmp_path: Path) -> None:
    script = tmp_path / "fake_agent.py"
    script.write_text(_FAKE_AGENT)
    pid_files = [tmp_path / f"w{i}.pid" for i in range(2)]
    with LocalCluster(["unused.py"], log_dir=tmp_path) as cluster:
        agents, workers = [], []
        for f in pid_files:
            cluster.command = lambda f=f: [sys.executable, str(script), str(f)]  # type: ignore[method-assign]
            # the fake agents open no store port: do not wait for one
            agents.append(cluster.add_agent(host_timeout=None))
            workers.append(_read_pid(f))
        paused = cluster.pause_workers()
        assert set(workers) <= set(paused)
        # SIGSTOP is delivered asynchronously: wait for it rather than race it
        wait_for(lambda: psutil.Process(workers[0]).status() == psutil.STATUS_STOPPED, 60,
                 what="worker to stop")
        cluster.resume_workers(paused)
        wait_for(lambda: psutil.Process(workers[0]).status() != psutil.STATUS_STOPPED, 60,
                 what="worker to resume")
        cluster.kill_agent(agents[1])
        assert not agents[1].alive and agents[0].alive
        wait_for(lambda: not _alive(workers[1]), 60, what="killed agent's worker to die")
        assert _alive(workers[0])
        assert cluster.wait(0.1) == [None, -signal.SIGKILL]
    assert not _alive(workers[0]) and not agents[0].alive


def test_wait_for_returns_value_times_out_and_aborts() -> None:
    assert wait_for(lambda: 7, 1) == 7
    with pytest.raises(TimeoutError, match="the thing"):
        wait_for(lambda: None, 0.2, interval=0.05, what="the thing")
    polls: list[int] = []
    with pytest.raises(RuntimeError, match="abort"):
        wait_for(lambda: polls.append(1), 600, interval=0.05, abort_if=lambda: True)
    # gave up at the first failed poll (and one re-check), not at the 600 s timeout
    assert len(polls) == 2


def test_signal_pending_sees_a_signal_held_by_a_stopped_process() -> None:
    """What ``add_agent_while_paused`` waits for: torchrun's SIGTERM to a paused worker."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        os.kill(p.pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(p.pid).status() == psutil.STATUS_STOPPED, 60,
                 what="the process to stop")
        assert not signal_pending(p.pid, signal.SIGTERM)
        os.kill(p.pid, signal.SIGTERM)
        wait_for(lambda: signal_pending(p.pid, signal.SIGTERM), 60, what="SIGTERM pending")
        assert psutil.Process(p.pid).status() == psutil.STATUS_STOPPED
        os.kill(p.pid, signal.SIGCONT)
        assert p.wait(timeout=60) == -signal.SIGTERM
        assert not signal_pending(p.pid, signal.SIGTERM)  # gone
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=60)


def test_etcd_server_missing_binary_says_how_to_install() -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install etcd-server"):
        EtcdServer(binary="no-such-etcd-binary").start()


def test_etcd_server_starts_and_stops(tmp_path: Path) -> None:
    import shutil
    import urllib.request

    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    with EtcdServer(log_path=tmp_path / "etcd.log") as etcd:
        host, port = etcd.endpoint.split(":")
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://{etcd.endpoint}/v2/keys/", timeout=5) as r:
            assert r.status == 200  # the v2 API torchrun's etcd-v2 backend needs
        pid = etcd.proc.pid
    assert not _alive(pid)


_DRIVER = textwrap.dedent("""
    import os, shutil, sys, time
    from pathlib import Path
    from elastic_kit.testing import EtcdServer, LocalCluster
    out = Path(sys.argv[1])
    cluster = LocalCluster([sys.argv[2], str(out / "worker.pid")], nnodes="1",
                           nproc_per_node=1, log_dir=out / "logs")
    agent = cluster.add_agent()
    pids = {"agent": agent.pid}
    if shutil.which("etcd"):
        etcd = EtcdServer(log_path=out / "etcd.log").start()
        pids["etcd"] = etcd.proc.pid
    (out / "pids.tmp").write_text(repr(pids))
    os.replace(out / "pids.tmp", out / "pids")
    time.sleep(600)  # killed here: neither close() nor stop() ever runs
""")

_WORKER = textwrap.dedent("""
    import os, sys, time
    open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
""")


def test_what_a_cluster_started_stops_when_the_test_process_is_sigkilled(tmp_path: Path) -> None:
    """A test runner ended by a time limit's SIGKILL never reaches ``close()``: its
    agents (in sessions of their own) and their workers, and an etcd server, must
    still not outlive it (a torchrun agent left on a GPU machine went on training)."""
    import ast

    (tmp_path / "driver.py").write_text(_DRIVER)
    (tmp_path / "worker.py").write_text(_WORKER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    driver = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(tmp_path),
                               str(tmp_path / "worker.py")], env=env, start_new_session=True)
    try:
        pids = ast.literal_eval(wait_for(
            lambda: (tmp_path / "pids").exists() and (tmp_path / "pids").read_text(), 120,
            what="the driver's cluster", abort_if=lambda: driver.poll() is not None))
        pids["worker"] = _read_pid(tmp_path / "worker.pid", timeout=120)
        assert all(_alive(p) for p in pids.values()), pids
        driver.kill()
        driver.wait(timeout=10)
        wait_for(lambda: not any(_alive(p) for p in pids.values()), 60,
                 what=f"{ {k: p for k, p in pids.items() if _alive(p)} } to stop")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for p in (tmp_path / "pids", tmp_path / "worker.pid"):
            if p.exists():
                for pid in ast.literal_eval(p.read_text()).values() if p.name == "pids" \
                        else [int(p.read_text())]:
                    kill_process_tree(pid)
