"""The cluster of torchrun agents and its :class:`Agent` handles (see the package docstring)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Mapping, Sequence

from elastic_kit.testing._proc import (
    MARKER_ENV, _descendants, _port_open, _psutil, die_with_this_process, kill_process_tree,
    signal_pending, wait_for,
)
from elastic_kit.testing._ports import ReservedPort, reserve_port

__all__ = ["Agent", "LocalCluster"]

log = logging.getLogger(__name__)


@dataclass
class Agent:
    """One torchrun agent (one "node") of a :class:`LocalCluster`.

    Attributes:
        index: position in :attr:`LocalCluster.agents` (0 is the first started).
        proc: the agent process.
        log_path: the file holding the agent's and its workers' stdout and stderr.
    """

    index: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """The agent's process id."""
        return self.proc.pid

    @property
    def alive(self) -> bool:
        """True while the agent process has not exited."""
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The agent's exit status (negative: killed by that signal), None while running."""
        return self.proc.poll()

    def read_log(self) -> str:
        """Everything the agent and its workers have written so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def worker_pids(self) -> list[int]:
        """Pids of the agent's live descendants that run the training script.

        torchrun's workers are its direct children (in their own sessions); helper
        processes such as data-loader workers are below them.
        """
        psutil = _psutil()
        try:
            return [c.pid for c in psutil.Process(self.pid).children(recursive=False)]
        except psutil.NoSuchProcess:
            return []


class LocalCluster:
    """Start, kill and preempt torchrun agents on 127.0.0.1 that form one elastic job.

    Args:
        script_and_args: the training script and its arguments, as after ``torchrun``'s
            own options. A leading ``"-m"`` runs a module (``["-m", "pkg.train", ...]``).
        nnodes: torchrun's ``--nnodes`` (``"MIN:MAX"`` for an elastic job).
        nproc_per_node: workers per agent.
        rdzv_backend: ``"c10d"`` or ``"etcd-v2"`` (then give the etcd endpoint).
        rdzv_endpoint: ``HOST:PORT``; when None, a port on 127.0.0.1 that the cluster
            holds (:func:`reserve_port`) until :meth:`close`, so that no other socket
            takes it before the first agent's store binds it, or while that agent is
            down (the c10d backend would join whatever store it found there).
        rdzv_id: the job id; a fresh uuid when None (a finished run closes its
            rendezvous, so ids must not be reused).
        max_restarts: torchrun's ``--max-restarts`` (failures and scale-downs count).
        rdzv_conf: torchrun's ``--rdzv-conf``; the default keeps re-rendezvous at ~2 s
            instead of the 30 s default last call.
        env: extra environment for every agent (and so every worker).
        log_dir: where ``agent-<index>.log`` files go (created if missing).
        monitor_interval: how often agents poll their workers, in seconds.
        python: the interpreter that runs ``torch.distributed.run``.
        torchrun_args: more torchrun options, placed before the script (e.g.
            ``["--start-method=fork", "--run-path"]``; see the example's README on
            fast restarts).
        launcher: the module that runs each agent (``python -m <launcher>``):
            ``"torch.distributed.run"`` (torchrun) or ``"elastic_kit.run"`` (torchrun
            with ``torch._dynamo`` imported into the agent first), followed by any
            ``--preload`` options in ``launcher_args``.
        launcher_args: options of the launcher itself, before torchrun's.
        cuda: whether the workers see the machine's GPUs. False (the default) sets
            ``CUDA_VISIBLE_DEVICES=""`` for every agent: the "nodes" of one machine
            cannot each have their own GPUs (``init_distributed`` counts only one
            agent's ranks, so every agent would put NCCL ranks on the same device),
            and the job runs with gloo on the CPU, the same on a GPU workstation as on
            a laptop. With True, give each agent its own devices through
            ``add_agent(env={"CUDA_VISIBLE_DEVICES": ...})``.
    """

    def __init__(
        self,
        script_and_args: Sequence[str],
        *,
        nnodes: str = "1:3",
        nproc_per_node: int = 1,
        rdzv_backend: str = "c10d",
        rdzv_endpoint: str | None = None,
        rdzv_id: str | None = None,
        max_restarts: int = 3,
        rdzv_conf: str = "last_call_timeout=1,join_timeout=60",
        env: Mapping[str, str] | None = None,
        log_dir: str | Path,
        monitor_interval: float = 0.5,
        python: str = sys.executable,
        torchrun_args: Sequence[str] = (),
        launcher: str = "torch.distributed.run",
        launcher_args: Sequence[str] = (),
        cuda: bool = False,
    ) -> None:
        if not script_and_args:
            raise ValueError("script_and_args is empty: give the training script to run")
        if nproc_per_node < 1:
            raise ValueError(f"nproc_per_node={nproc_per_node} must be >= 1")
        if max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts} must be >= 0")
        if rdzv_backend != "c10d" and rdzv_endpoint is None:
            raise ValueError(
                f"rdzv_backend={rdzv_backend!r} needs rdzv_endpoint (e.g. EtcdServer().endpoint)"
            )
        self.script_and_args = list(script_and_args)
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.rdzv_backend = rdzv_backend
        self._rdzv_port: ReservedPort | None = None
        if rdzv_endpoint is None:
            self._rdzv_port = reserve_port()
            rdzv_endpoint = self._rdzv_port.endpoint
        self.rdzv_endpoint = rdzv_endpoint
        self.rdzv_id = rdzv_id or uuid.uuid4().hex
        self.max_restarts = max_restarts
        self.rdzv_conf = rdzv_conf
        self.env = dict(env or {})
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.monitor_interval = monitor_interval
        self.python = python
        self.torchrun_args = list(torchrun_args)
        self.launcher = launcher
        self.launcher_args = list(launcher_args)
        self.cuda = cuda
        self.agents: list[Agent] = []
        self.marker = f"{self.rdzv_id}-{uuid.uuid4().hex[:8]}"
        self._closed = False

    # -- building the command ---------------------------------------------------------

    def command(self) -> list[str]:
        """The argv of one agent (the same for every agent)."""
        script = list(self.script_and_args)
        if script[0] == "-m":
            script = ["--module", *script[1:]]
        return [
            self.python, "-m", self.launcher, *self.launcher_args,
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--rdzv-backend={self.rdzv_backend}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={self.rdzv_conf}",
            f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval}",
            *self.torchrun_args,
            *script,
        ]

    def _agent_env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        env.update(extra or {})
        if not self.cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        # Without it, scale-up hangs on these torch versions (the joining round waits
        # forever for role_info keys), and a restarted gloo group sometimes fails to form
        # on the dead group's addresses; see the README (Launching).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env.setdefault("PYTHONUNBUFFERED", "1")
        # torchrun's own logger (rendezvous rounds, restarts, world sizes) is silent
        # below WARNING by default; those lines are what a failing test needs to show.
        env.setdefault("LOGLEVEL", "INFO")
        # A worker that dies of a signal (SIGABRT, SIGSEGV) prints every Python
        # thread's stack: where it was is otherwise lost with the process.
        env.setdefault("PYTHONFAULTHANDLER", "1")
        # Snapshot replicas stream between the "nodes" on loopback, like everything here.
        env.setdefault("ELASTIC_KIT_SNAPSHOT_ADDR", "127.0.0.1")
        env[MARKER_ENV] = self.marker
        return env

    # -- lifecycle --------------------------------------------------------------------

    def add_agent(self, *, env: Mapping[str, str] | None = None,
                  host_timeout: float | None = 60.0) -> Agent:
        """Start one more torchrun agent: one more node asks to join the job.

        With c10d, the first agent must own the rendezvous store (the notes say the
        job dies with it, so tests must know which agent it is): this waits until the
        first agent listens on the endpoint port before a second one may race it.

        Args:
            env: environment for this agent only (e.g. its node-local checkpoint dir).
            host_timeout: seconds to wait for the first c10d agent's store to listen;
                None to start at once.
        """
        if self._closed:
            raise RuntimeError("LocalCluster is closed; create a new one")
        if self.rdzv_backend == "c10d" and self.agents and host_timeout is not None:
            self.wait_for_store(host_timeout)
        index = len(self.agents)
        log_path = self.log_dir / f"agent-{index}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        log_file.write(f"### {' '.join(self.command())}\n".encode())
        log_file.flush()
        proc = subprocess.Popen(
            # Dies with the test process (a time limit's SIGKILL skips close()): an
            # agent left behind goes on training, on a GPU machine on its GPU.
            die_with_this_process(self.command()),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=self._agent_env(env),
            start_new_session=True,  # a Ctrl-C in the test runner must not hit agents twice
        )
        agent = Agent(index=index, proc=proc, log_path=log_path, _log_file=log_file)
        self.agents.append(agent)
        log.info("started agent %d (pid %d), log %s", index, proc.pid, log_path)
        return agent

    def wait_for_store(self, timeout: float = 60.0) -> None:
        """Wait until the c10d rendezvous endpoint accepts connections."""
        host, _, port = self.rdzv_endpoint.rpartition(":")
        first = self.agents[0] if self.agents else None
        wait_for(
            lambda: _port_open(host, int(port)),
            timeout,
            what=f"the c10d store on {self.rdzv_endpoint}",
            abort_if=(lambda: not first.alive) if first is not None else None,
        )

    def kill_agent(self, agent: Agent, sig: int = signal.SIGKILL) -> list[int]:
        """Stop ``agent`` and every process below it with ``sig``: the node is lost.

        Returns the pids that were signalled (the agent first).
        """
        log.info("killing agent %d (pid %d) and its descendants with %s",
                 agent.index, agent.pid, signal.Signals(sig).name)
        pids = kill_process_tree(agent.pid, sig)
        if sig == signal.SIGKILL:
            agent.proc.wait(timeout=10)
        return pids

    def kill_worker(self, agent: Agent, local_rank: int = 0, sig: int = signal.SIGKILL) -> int:
        """Kill one worker of ``agent`` (and its own children), leaving the agent alive.

        The agent notices at its next monitor tick and restarts the worker group.
        Returns the worker's pid.
        """
        pids = sorted(agent.worker_pids())
        if local_rank >= len(pids):
            raise RuntimeError(
                f"agent {agent.index} has {len(pids)} live workers; no local_rank={local_rank}"
            )
        # Children are started in local-rank order, so pid order is rank order except
        # after pid wrap-around; the LOCAL_RANK in the environment is authoritative.
        psutil = _psutil()
        pid = pids[local_rank]
        for candidate in pids:
            try:
                if psutil.Process(candidate).environ().get("LOCAL_RANK") == str(local_rank):
                    pid = candidate
                    break
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        log.info("killing worker pid %d (local rank %d) of agent %d", pid, local_rank, agent.index)
        kill_process_tree(pid, sig)
        return pid

    def pause_workers(self) -> list[int]:
        """SIGSTOP every worker (and its children) of every live agent; return their pids.

        Lets a test hold training still while a new agent starts (several seconds of
        Python and torch imports), so that "add a node while training" does not depend
        on how fast the machine is. The agents keep running, so they still see the new
        node and restart the group; a stopped worker acts on torchrun's SIGTERM only once
        resumed, so resume it well before torchrun's SIGKILL (30 s after the SIGTERM).
        Pass the result to :meth:`resume_workers`.
        """
        pids: list[int] = []
        for agent in self.alive_agents():
            for p in _descendants(agent.pid):
                try:
                    p.suspend()
                    pids.append(p.pid)
                except _psutil().NoSuchProcess:
                    pass
        log.info("paused %d worker processes", len(pids))
        return pids

    def resume_workers(self, pids: Sequence[int]) -> None:
        """SIGCONT the processes :meth:`pause_workers` stopped (those still alive)."""
        psutil = _psutil()
        for pid in pids:
            try:
                psutil.Process(pid).resume()
            except psutil.NoSuchProcess:
                pass

    def add_agent_while_paused(self, *, env: Mapping[str, str] | None = None,
                               timeout: float = 120.0) -> Agent:
        """Add an agent with training held still until torchrun restarts the group for it.

        Every worker is paused (SIGSTOP) before the agent starts, and resumed only once
        torchrun has sent each of them the SIGTERM of the restart that lets the new node
        in (the signal stays pending while a process is stopped). So the running group
        makes no progress while the new agent starts and joins, however slow the
        machine, and on resuming it stops after its current step, exactly as on a real
        scale-up: the larger group is certain to form before training can finish.

        Call it while a group is training (workers alive, their SIGTERM handling
        installed); with no live workers it only starts the agent.

        Raises:
            TimeoutError: torchrun did not stop the workers within ``timeout`` seconds
                (the workers are resumed first).
            RuntimeError: the new agent exited before that.
        """
        workers = [pid for a in self.alive_agents() for pid in a.worker_pids()]
        paused = self.pause_workers()
        try:
            agent = self.add_agent(env=env)
            psutil = _psutil()

            def all_asked_to_stop() -> bool:
                return all(signal_pending(pid, signal.SIGTERM) or not psutil.pid_exists(pid)
                           for pid in workers)

            wait_for(all_asked_to_stop, timeout, interval=0.05,
                     what=f"torchrun to stop workers {workers} for agent {agent.index}",
                     abort_if=lambda: not agent.alive)
        finally:
            self.resume_workers(paused)
        return agent

    def terminate_agent(self, agent: Agent) -> None:
        """SIGTERM to the agent only: a preemption notice that torchrun forwards to workers."""
        log.info("sending SIGTERM to agent %d (pid %d)", agent.index, agent.pid)
        if agent.alive:
            agent.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> list[int | None]:
        """Wait up to ``timeout`` s for every agent to exit; their exit codes.

        An agent still running at the deadline is reported as None (it is not killed:
        :meth:`close` does that).
        """
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            remaining = max(deadline - time.monotonic(), 0.0)
            try:
                agent.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                pass
        return [a.returncode for a in self.agents]

    def alive_agents(self) -> list[Agent]:
        """The agents that have not exited."""
        return [a for a in self.agents if a.alive]

    def all_exited(self) -> bool:
        """True when every started agent has exited (an ``abort_if`` for :func:`wait_for`)."""
        return bool(self.agents) and not self.alive_agents()

    def logs(self) -> str:
        """All agents' logs, each under a header; for assertion messages."""
        return "\n".join(f"===== agent {a.index} (rc={a.returncode}) =====\n{a.read_log()}"
                         for a in self.agents)

    def _marked_processes(self) -> list[Any]:
        """Every live process carrying this cluster's marker, orphans included."""
        psutil = _psutil()
        found = []
        for p in psutil.process_iter(["pid"]):
            if p.pid == os.getpid():
                continue
            try:
                if p.environ().get(MARKER_ENV) == self.marker:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
                continue
        return found

    def close(self) -> None:
        """Kill every agent and worker this cluster started that is still alive.

        Safe to call more than once; also called on leaving a ``with`` block.
        """
        if self._closed:
            return
        self._closed = True
        psutil = _psutil()
        for agent in self.agents:
            if agent.alive:
                kill_process_tree(agent.pid, signal.SIGKILL)
        leftovers = self._marked_processes()
        for p in leftovers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if leftovers:
            log.info("killed %d orphaned processes of cluster %s", len(leftovers), self.rdzv_id)
            psutil.wait_procs(leftovers, timeout=10)
        for agent in self.agents:
            try:
                agent.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                log.warning("agent %d (pid %d) did not exit after SIGKILL", agent.index, agent.pid)
            if agent._log_file is not None:
                agent._log_file.close()
                agent._log_file = None
        if self._rdzv_port is not None:
            self._rdzv_port.close()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


