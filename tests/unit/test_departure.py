"""The planned leave stops the torchrun agent above the worker, and nothing else: the
agent is found by its command line, never taken to be whatever the parent is."""

from __future__ import annotations

from pathlib import Path

from elastic_kit._agent import torchrun_agent_pid


def _proc(root: Path, pid: int, ppid: int, argv: list[str]) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "stat").write_text(f"{pid} (py thon) S {ppid} 1 1 0\n")
    (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_the_agent_is_the_nearest_ancestor_running_torchrun(tmp_path: Path) -> None:
    _proc(tmp_path, 10, 1, ["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=2",
                            "train.py"])
    _proc(tmp_path, 50, 10, ["/usr/bin/python3", "-c",
                             "from multiprocessing.forkserver import main; main()"])
    _proc(tmp_path, 100, 50, ["/usr/bin/python3", "-u", "train.py"])
    _proc(tmp_path, 101, 10, ["/usr/bin/python3", "-u", "train.py"])
    assert torchrun_agent_pid(101, proc=str(tmp_path)) == 10   # the parent
    assert torchrun_agent_pid(100, proc=str(tmp_path)) == 10   # under a fork server
    assert torchrun_agent_pid(100, proc=str(tmp_path), levels=1) is None


def test_a_worker_not_started_by_torchrun_finds_no_agent(tmp_path: Path) -> None:
    # a command line that merely names a torchrun test is not an agent
    _proc(tmp_path, 7, 1, ["/usr/bin/python3", "-m", "pytest", "tests/torchrun/test_x.py"])
    _proc(tmp_path, 8, 7, ["/usr/bin/python3", "-c",
                           "from multiprocessing.forkserver import main; main()",
                           "tests.torchrun.scenarios", "torchrun"])
    _proc(tmp_path, 9, 8, ["/usr/bin/python3", "-c", "worker"])
    assert torchrun_agent_pid(9, proc=str(tmp_path)) is None
    assert torchrun_agent_pid(12345, proc=str(tmp_path)) is None  # gone


def test_torchrun_itself_and_every_launcher_module_are_agents(tmp_path: Path) -> None:
    for pid, argv in enumerate([["/venv/bin/torchrun", "--nnodes=2", "t.py"],
                                ["/usr/bin/python3", "/venv/bin/torchrun", "t.py"],
                                ["python", "-m", "torch.distributed.launch", "t.py"],
                                ["python", "-m", "elastic_kit.run", "--preload", "x", "t.py"]],
                               start=20):
        _proc(tmp_path, pid, 1, argv)
        _proc(tmp_path, pid + 100, pid, ["python", "t.py"])
        assert torchrun_agent_pid(pid + 100, proc=str(tmp_path)) == pid, argv


def test_this_test_process_has_no_agent_above_it() -> None:
    assert torchrun_agent_pid() is None


def test_the_agents_leave_signal_starts_one_leave_however_often_it_comes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A second leave signal (even one arriving while the first's handler starts its
    thread) starts nothing more."""
    from elastic_kit.health import _agent_leave

    started: list[str] = []

    class Recorder:
        def __init__(self, target, name, daemon):  # type: ignore[no-untyped-def]
            self.name = name

        def start(self) -> None:
            started.append(self.name)

    monkeypatch.setattr(_agent_leave, "_signalled", False)
    monkeypatch.setattr(_agent_leave, "_handlers", [])
    monkeypatch.setattr(_agent_leave.threading, "Thread", Recorder)
    _agent_leave._on_signal(0, None)
    _agent_leave._on_signal(0, None)
    assert started == ["ek-agent-leave"]


def test_an_agent_started_with_interpreter_options_is_found(tmp_path: Path) -> None:
    for pid, argv in enumerate([
            ["python", "-X", "dev", "-W", "error", "-m", "elastic_kit.run", "t.py"],
            ["python", "-u", "-Xfrozen_modules=off", "-B", "-m", "torch.distributed.run", "t.py"]],
            start=40):
        _proc(tmp_path, pid, 1, argv)
        _proc(tmp_path, pid + 100, pid, ["python", "t.py"])
        assert torchrun_agent_pid(pid + 100, proc=str(tmp_path)) == pid, argv
    # a module named after the script, or in a command, runs no launcher
    for pid, argv in enumerate([["python", "t.py", "-m", "elastic_kit.run"],
                                ["python", "-c", "x", "-m", "elastic_kit.run"]], start=60):
        _proc(tmp_path, pid, 1, argv)
        _proc(tmp_path, pid + 100, pid, ["python", "t.py"])
        assert torchrun_agent_pid(pid + 100, proc=str(tmp_path)) is None, argv


def _leave(monkeypatch, info, gather, notice=None, hosts=False):  # type: ignore[no-untyped-def]
    """Run ``Departure.leave`` at step 7 on a rank described by ``info``, under a
    (faked) torchrun, with ``gather`` standing for the ranks' all-gather of
    ``(node, notice, no restart left, its agent serves the c10d endpoint)``, this
    rank's agent serving it when ``hosts``; returns (exit status, what it did)."""
    import pytest

    from elastic_kit.checkpointer import _departure
    from elastic_kit.distributed import DistInfo

    monkeypatch.setattr(DistInfo, "under_torchrun", property(lambda self: True))
    monkeypatch.setattr(_departure, "is_dist_ready", lambda: True)
    monkeypatch.setattr(_departure, "all_gather_object", gather)
    monkeypatch.setattr(_departure, "_hosts_rendezvous", lambda: hosts)
    watch = _departure.Departure.__new__(_departure.Departure)
    watch.notice = notice
    done: list[str] = []
    with pytest.raises(SystemExit) as leaving:
        watch.leave(info, 7, snapshot=lambda: done.append("snapshot") or True,
                    save=lambda: done.append("save"), close=lambda staying: done.append("close"),
                    exit_code=143)
    return leaving.value.code, done


def test_a_leave_without_an_agent_to_stop_fails_the_workers(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A worker that ends with 0 under an agent that goes on tells it the job is done
    (the agent then closes the rendezvous for every node): a leaving worker whose agent
    could not be found fails instead, and the group restarts."""
    from elastic_kit.checkpointer import _departure
    from elastic_kit.distributed import DistInfo

    monkeypatch.setattr(_departure, "torchrun_agent_pid", lambda: None)
    info = DistInfo(rank=0, world_size=2, num_nodes=2, run_id="job", max_restarts=3)
    # two nodes: this one (0) was told it will go, node 1 stays
    code, done = _leave(monkeypatch, info, lambda mine: [mine, (1, None, False, False)],
                        notice="signal SIGTERM")
    assert code == 143 and done == ["snapshot", "close"]


def test_a_leave_with_no_restart_left_saves_durably(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """With torchrun's restarts used up (its default --max-restarts is 0), the nodes
    that stay end the job when they exit: the leave step was kept only in their
    memory, and the relaunch went back to the last durable checkpoint."""
    import logging

    from elastic_kit.distributed import DistInfo

    for restarts, kept in ((0, ["save", "close"]), (1, ["snapshot", "close"])):
        info = DistInfo(rank=0, world_size=2, num_nodes=2, run_id="job", restart_count=0,
                        max_restarts=restarts)
        with caplog.at_level(logging.INFO, logger="elastic_kit"):
            # two nodes: this one (0) stays, node 1 was told it will go
            code, done = _leave(monkeypatch, info, lambda mine: [mine, (1, "gce", mine[2], False)])
        assert code == 143 and done == kept
    assert "torchrun has no restart left (--max-restarts=0): the job ends" in caplog.text


def test_every_rank_takes_the_durable_branch_when_any_staying_node_has_no_restart_left(
        monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """Each agent counts its own restarts: a node that joined later has restarts left
    where the older ones have none. Every rank decides as the others do (their leave
    branches make different collectives, which hung until the process group's
    timeout): one staying node without a restart ends the job, so the step is saved
    durably on every rank."""
    import logging

    from elastic_kit.distributed import DistInfo

    # this node (0, joined later: a restart left) stays; node 1 goes; node 2 (no
    # restart left) stays
    gathered: list[object] = []

    def gather(mine: object) -> list[object]:
        gathered.append(mine)
        return [mine, (1, "gce", True, False), (2, None, True, False)]

    info = DistInfo(rank=0, world_size=3, num_nodes=3, run_id="job", restart_count=0,
                    max_restarts=1)
    with caplog.at_level(logging.INFO, logger="elastic_kit"):
        code, done = _leave(monkeypatch, info, gather)
    assert gathered == [(0, None, False, False)]  # this rank's own count goes to the others
    assert code == 143 and done == ["save", "close"]
    assert "the state is in a durable checkpoint; torchrun has no restart left" in caplog.text


def test_the_first_staying_rank_says_who_leaves_when_rank_0_leaves(
        monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    from elastic_kit.distributed import DistInfo

    # rank 0 (node 0) leaves; this is rank 1, on node 1, which stays
    info = DistInfo(rank=1, world_size=2, num_nodes=2, node_rank=1, run_id="job",
                    max_restarts=3)
    with caplog.at_level(logging.INFO, logger="elastic_kit"):
        code, _ = _leave(monkeypatch, info, lambda mine: [(0, "gce", False, False), mine])
    assert code == 143
    assert "node(s) [0] leave at step 7 (gce): the state is in memory on the nodes that " \
           "stay; restarting without them (status 143)" in caplog.text


def test_when_every_node_leaves_each_says_the_job_ends_and_a_relaunch_resumes(
        monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """Every node told it will go: the step is saved durably and every agent ends
    without an error, so the log must say that the job is over until relaunched."""
    import logging

    from elastic_kit.checkpointer import _departure
    from elastic_kit.distributed import DistInfo

    monkeypatch.setattr(_departure, "torchrun_agent_pid", lambda: None)
    info = DistInfo(rank=0, world_size=2, num_nodes=2, run_id="job", max_restarts=3)
    with caplog.at_level(logging.INFO, logger="elastic_kit"):
        code, done = _leave(monkeypatch, info, lambda mine: [mine, (1, "gce", False, False)],
                            notice="gce")
    assert code == 143 and done == ["save", "close"]
    assert "this node leaves at step 7 (gce): the state is in a durable checkpoint; every " \
           "node leaves, so the job ends: relaunch it to resume there" in caplog.text


def test_a_leave_of_the_node_serving_the_c10d_endpoint_saves_durably(
        monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """The staying agents lose the c10d rendezvous with the agent that serves it, and
    the job ends: the leave's step must be durable, not only in their memory, and
    both sides say that a relaunch resumes there."""
    import logging

    from elastic_kit.checkpointer import _departure
    from elastic_kit.distributed import DistInfo

    monkeypatch.setattr(_departure, "torchrun_agent_pid", lambda: None)
    gathered: list[object] = []

    def gather(mine: object) -> list[object]:
        gathered.append(mine)
        return [mine, (1, None, False, False)]

    # node 0 (this rank, its agent the endpoint's server) was told it will go
    info = DistInfo(rank=0, world_size=2, num_nodes=2, run_id="job", max_restarts=3)
    with caplog.at_level(logging.INFO, logger="elastic_kit"):
        code, done = _leave(monkeypatch, info, gather, notice="gce", hosts=True)
    assert gathered == [(0, "gce", False, True)]
    assert done == ["save", "close"] and code == 143  # no agent found: the workers fail
    assert "the state is in a durable checkpoint; its agent serves the c10d rendezvous " \
           "endpoint, so the job ends: relaunch it to resume there" in caplog.text
    caplog.clear()
    # node 1 stays: the same branch, and it says why the job ends
    info = DistInfo(rank=1, world_size=2, num_nodes=2, node_rank=1, run_id="job",
                    max_restarts=3)
    with caplog.at_level(logging.INFO, logger="elastic_kit"):
        code, done = _leave(monkeypatch, info, lambda mine: [(0, "gce", False, True), mine])
    assert code == 143 and done == ["save", "close"]
    assert "the state is in a durable checkpoint; the leaving node's agent serves the c10d " \
           "rendezvous endpoint: the job ends; relaunch it to resume there" in caplog.text


def test_the_c10d_endpoint_port_is_read_as_torchrun_reads_its_options(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from elastic_kit._agent import C10D_DEFAULT_PORT, c10d_endpoint_port

    for name in [k for k in __import__("os").environ if k.startswith("PET_")]:
        monkeypatch.delenv(name)
    run = [b"/venv/bin/torchrun", b"--nnodes=1:3"]
    c10d = [b"--rdzv-backend=c10d"]
    assert c10d_endpoint_port(run + c10d + [b"--rdzv-endpoint=10.0.0.1:1234", b"t.py"]) == 1234
    assert c10d_endpoint_port([b"python", b"-m", b"torch.distributed.run", b"--rdzv_backend",
                               b"c10d", b"--rdzv_endpoint", b"[::1]:77", b"t.py"]) == 77
    assert c10d_endpoint_port(run + c10d + [b"--rdzv-endpoint=head", b"t.py"]) == \
        C10D_DEFAULT_PORT
    assert c10d_endpoint_port(run + c10d + [b"t.py"]) == C10D_DEFAULT_PORT  # localhost
    # argparse's rules: the last of a repeated option, an abbreviation
    assert c10d_endpoint_port(run + c10d + [b"--rdzv-endpoint=h:1", b"--rdzv-endpoint=h:2",
                                            b"t.py"]) == 2
    assert c10d_endpoint_port(run + c10d + [b"--rdzv-endp=h:3", b"t.py"]) == 3
    # the script's own arguments are the script's
    assert c10d_endpoint_port(run + c10d + [b"--rdzv-endpoint=h:4", b"t.py",
                                            b"--rdzv-endpoint", b"x:9", b"--standalone"]) == 4
    assert c10d_endpoint_port(run + [b"t.py", b"--rdzv_backend", b"c10d"]) is None
    # the launcher's own options come first
    assert c10d_endpoint_port([b"python", b"-m", b"elastic_kit.run", b"--preload", b"torchvision",
                               b"--rdzv-poll=0.05", *c10d, b"--rdzv-endpoint=h:5", b"t.py"]) == 5
    # torchrun reads options from PET_* variables too (a worker inherits its agent's)
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "head:6")
    assert c10d_endpoint_port(run + [b"t.py"]) == 6
    monkeypatch.delenv("PET_RDZV_BACKEND")
    # another backend, one node on its own, not an agent: no endpoint whose host could leave
    assert c10d_endpoint_port(run + [b"--rdzv-backend=etcd-v2", b"--rdzv-endpoint=h:2379",
                                     b"t.py"]) is None
    assert c10d_endpoint_port(run + [b"--standalone", b"t.py"]) is None
    assert c10d_endpoint_port([b"python", b"t.py", b"--rdzv-backend=c10d"]) is None


def test_a_listening_socket_is_found_by_its_process_and_port() -> None:
    import os
    import socket

    from elastic_kit._agent import listens_on

    with socket.socket(socket.AF_INET6) as v6, socket.socket() as v4, \
            socket.socket() as bound:
        v6.bind(("::", 0))
        v6.listen()
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        bound.bind(("127.0.0.1", 0))  # bound, not listening
        me = os.getpid()
        assert listens_on(me, v6.getsockname()[1]) and listens_on(me, v4.getsockname()[1])
        assert not listens_on(me, bound.getsockname()[1])
        assert not listens_on(os.getppid(), v4.getsockname()[1])  # not its socket
        assert not listens_on(2 ** 22 + 1, v4.getsockname()[1])   # no such process
