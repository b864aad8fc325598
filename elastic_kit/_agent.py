"""Which process is a torchrun agent: read from ``/proc`` (Linux), by command line.

The planned leave uses it to find the agent a worker stops; kept apart from it so
that other parts of the library can tell an agent from any other parent process.
"""

from __future__ import annotations

import os

__all__ = ["torchrun_agent_pid", "is_agent", "python_module", "command_line"]

_AGENT_MODULES = (b"torch.distributed.run", b"torch.distributed.launch", b"elastic_kit.run")


#: The interpreter's options that take the next argument as their value.
_PYTHON_VALUE_OPTIONS = (b"-X", b"-W", b"--check-hash-based-pycs")


def python_module(argv: list[bytes]) -> bytes | None:
    """The module of ``python [options] -m MODULE ...`` (the interpreter's options read
    as Python reads them: up to the first argument that is not one), else None."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == b"-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if a in _PYTHON_VALUE_OPTIONS:
            i += 2
            continue
        if not a.startswith(b"-") or a == b"-" or a == b"-c":
            return None  # a script, stdin or a command: no module
        i += 1
    return None


def is_agent(argv: list[bytes]) -> bool:
    """``torchrun ...``, ``python /path/torchrun ...`` or ``python [options] -m
    <launcher> ...`` (exactly: a test file under ``tests/torchrun/`` on a command line
    is no agent)."""
    if any(os.path.basename(a) == b"torchrun" for a in argv[:2]):
        return True
    return python_module(argv) in _AGENT_MODULES


def command_line(pid: int, *, proc: str = "/proc") -> list[bytes] | None:
    """Process ``pid``'s arguments, or None when it cannot be read (gone, another
    user's under ``hidepid``, no ``/proc``)."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def torchrun_agent_pid(pid: int | None = None, *, proc: str = "/proc",
                       levels: int = 3) -> int | None:
    """The pid of the torchrun agent above process ``pid`` (default: this one), or None.

    The agent is the nearest ancestor, within ``levels``, whose command line runs
    torchrun (``torchrun``, ``python -m torch.distributed.run``, ``python -m
    elastic_kit.run``): the parent for torchrun's default start methods, the
    grandparent under a fork server. Never a process that is not an agent: a worker
    started some other way (a test's spawned ranks) finds none.
    """
    pid = os.getpid() if pid is None else pid
    for _ in range(levels):
        try:
            with open(f"{proc}/{pid}/stat", "rb") as f:
                stat = f.read()
            pid = int(stat[stat.rfind(b")") + 2:].split()[1])  # the parent's pid
        except (OSError, ValueError, IndexError):
            return None
        argv = command_line(pid, proc=proc)
        if argv is None or pid <= 1:
            return None
        if is_agent(argv):
            return pid
    return None
