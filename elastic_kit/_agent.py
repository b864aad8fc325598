"""Which process is a torchrun agent, and whether it hosts the c10d rendezvous: read
from ``/proc`` (Linux), by command line and listening sockets.

The planned leave uses it to find the agent a worker stops, and to tell whether that
agent's exit takes the rendezvous with it; kept apart from it so that other parts of
the library can tell an agent from any other parent process.
"""

from __future__ import annotations

import os
from typing import NoReturn

__all__ = ["torchrun_agent_pid", "is_agent", "python_module", "command_line",
           "c10d_endpoint_port", "listens_on", "hosts_c10d_endpoint", "C10D_DEFAULT_PORT",
           "LAUNCHER_OPTIONS"]

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
    return _torchrun_args(argv) is not None


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


#: torch's port for a c10d rendezvous endpoint given without one.
C10D_DEFAULT_PORT = 29400


#: ``python -m elastic_kit.run``'s own options (each with a value), which come before
#: torchrun's.
LAUNCHER_OPTIONS = ("--preload", "--rdzv-poll")


def _torchrun_args(argv: list[bytes]) -> list[str] | None:
    """The arguments torchrun parses in an agent's command line ``argv`` (after
    ``torchrun``, ``python /path/torchrun`` or ``python -m <launcher>``, without
    ``elastic_kit.run``'s own leading options), or None: not an agent's."""
    args = [a.decode(errors="replace") for a in argv]
    if args and os.path.basename(args[0]) == "torchrun":
        return args[1:]
    if len(args) > 1 and os.path.basename(args[1]) == "torchrun":
        return args[2:]
    module = python_module(argv)
    if module not in _AGENT_MODULES:
        return None
    rest = args[args.index(module.decode()) + 1:]  # the first "-m MODULE" is python's
    while module == b"elastic_kit.run" and rest and rest[0].split("=", 1)[0] in LAUNCHER_OPTIONS:
        rest = rest[1:] if "=" in rest[0] else rest[2:]
    return rest


def c10d_endpoint_port(argv: list[bytes]) -> int | None:
    """The port of the c10d rendezvous endpoint an agent run as ``argv`` serves or
    joins, read as torchrun reads its options (its own parser, whose defaults are
    this process's ``PET_*`` variables: a worker inherits its agent's), or None: not
    an agent, another backend, or ``--standalone`` (one node: nothing to leave)."""
    args = _torchrun_args(argv)
    if args is None:
        return None
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import get_args_parser

    def refuse(message: str) -> NoReturn:  # argparse prints its usage, then exits
        raise ValueError(message)

    parser = get_args_parser()
    parser.error = refuse  # type: ignore[method-assign]
    try:
        parsed, _ = parser.parse_known_args(args)
        if parsed.standalone or parsed.rdzv_backend != "c10d":
            return None
        return parse_rendezvous_endpoint(parsed.rdzv_endpoint, C10D_DEFAULT_PORT)[1]
    except (SystemExit, ValueError):  # argparse's error; a malformed endpoint
        return None


def listens_on(pid: int, port: int, *, proc: str = "/proc") -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (IPv4 or IPv6):
    its descriptors' socket inodes against its network namespace's socket tables.
    False when they cannot be read (another user's process, no ``/proc``)."""
    try:
        inodes = set()
        for fd in os.listdir(f"{proc}/{pid}/fd"):
            try:
                target = os.readlink(f"{proc}/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return False
    want = f"{port:04X}"
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/{pid}/net/{table}") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    # local address "ADDR:PORT" (hex), state 0A = LISTEN, inode 10th
                    if (len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes
                            and fields[1].rpartition(":")[2] == want):
                        return True
        except OSError:
            continue
    return False


def hosts_c10d_endpoint(agent: int, *, proc: str = "/proc") -> bool:
    """Whether torchrun agent ``agent`` serves its c10d rendezvous endpoint (the other
    agents lose the rendezvous when it exits). On one machine every agent names the
    same endpoint host, so the socket decides, not the address."""
    argv = command_line(agent, proc=proc)
    if argv is None:
        return False
    port = c10d_endpoint_port(argv)
    return port is not None and listens_on(agent, port, proc=proc)
