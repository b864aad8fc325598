"""Process-tree and polling helpers for :class:`~elastic_kit.testing.LocalCluster`.

torchrun starts workers in their own sessions, so a lost node is simulated by walking
the agent's process tree (psutil) and SIGKILLing every process in it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from types import ModuleType
from typing import Any, Callable, Sequence

__all__ = ["MARKER_ENV", "die_with_this_process", "kill_process_tree", "signal_pending", "wait_for"]

log = logging.getLogger(__name__)

#: Environment variable carrying a cluster's private marker into every process it starts.
MARKER_ENV = "ELASTIC_KIT_LOCAL_CLUSTER_ID"


def _psutil() -> ModuleType:
    """psutil, imported only when processes are actually walked (it is a test extra)."""
    try:
        import psutil
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "elastic_kit.testing needs psutil to find and stop process trees; "
            "install it with `pip install psutil` or `pip install elastic_kit[testing]`"
        ) from e
    return psutil


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


#: Run in a new interpreter before the real command: asks the kernel for a signal when
#: the process that started it ends (``PR_SET_PDEATHSIG``, Linux), then ``exec``s the
#: command in place (same pid). Not Linux: execs at once.
_DIE_WITH_PARENT = (
    "import os, sys\n"
    "sig, parent = int(sys.argv[1]), int(sys.argv[2])\n"
    "try:\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != parent:\n"
    "    sys.exit(f'not started: the process that started it ({parent}) is gone')\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def die_with_this_process(cmd: Sequence[str], sig: int = signal.SIGTERM) -> list[str]:
    """``cmd`` wrapped so that the process it becomes gets ``sig`` when this process
    ends, however it ends (a test runner SIGKILLed by a time limit included).

    The agents and servers a test starts run in sessions of their own (a Ctrl-C must
    not reach them twice), so nothing else stops them once the test process is gone:
    a torchrun agent left behind went on training on the GPU. With ``SIGTERM`` an
    agent still stops its workers. The signal comes when the *thread* that started
    the process ends (Linux ties it to the thread): start them from a thread that
    outlives them.
    """
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(int(sig)), str(os.getpid()), *cmd]


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    *,
    interval: float = 0.1,
    what: str = "condition",
    abort_if: Callable[[], Any] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that value.

    Args:
        predicate: the condition; exceptions it raises propagate.
        timeout: seconds before giving up with :class:`TimeoutError`.
        interval: seconds between polls.
        what: a description for the error message.
        abort_if: checked after each failed poll; when truthy, give up at once with
            :class:`RuntimeError` (e.g. "every agent has exited", so a test does not sit
            out the whole timeout waiting for a file that will never appear).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if abort_if is not None and abort_if():
            value = predicate()  # the event may have landed just before the abort
            if value:
                return value
            raise RuntimeError(f"gave up waiting for {what}: abort condition met")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def signal_pending(pid: int, sig: int) -> bool:
    """True when ``sig`` was sent to process ``pid`` and is not delivered yet.

    A stopped (SIGSTOP) process keeps the signals sent to it pending until it is
    continued, so this tells a test that, for example, torchrun has asked a paused
    worker to stop. Reads ``/proc/PID/status`` (Linux); False when the process is gone.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return False
    bit = 1 << (int(sig) - 1)
    for line in status.splitlines():
        # SigPnd: sent to this thread; ShdPnd: sent to the process (kill, killpg).
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit:
            return True
    return False


def _descendants(pid: int) -> list[Any]:
    psutil = _psutil()
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _parent_pid(proc: Any) -> int | None:
    try:
        return int(proc.ppid())
    except Exception:  # gone already: nothing to reap
        return None


def kill_process_tree(pid: int, sig: int = signal.SIGKILL, *, timeout: float = 10.0) -> list[int]:
    """Send ``sig`` to ``pid`` and to every descendant, found *before* signalling.

    Descendants are collected first because once their parent dies they are
    re-parented and no longer reachable from ``pid``. Returns the pids signalled.
    With SIGKILL, waits (up to ``timeout``) until they are all gone, except the
    caller's own children, which the caller reaps (``Popen.wait``) to keep their status.
    """
    psutil = _psutil()
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    procs = [root, *_descendants(pid)]
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    if sig == signal.SIGKILL:
        # Never reap our own children here: their Popen object must collect the exit
        # status (psutil's wait would take it and Popen would then report 0).
        others = [p for p in procs if _parent_pid(p) != os.getpid()]
        _, alive = psutil.wait_procs(others, timeout=timeout)
        if alive:
            log.warning("processes still alive after SIGKILL: %s", [p.pid for p in alive])
    return [p.pid for p in procs]
