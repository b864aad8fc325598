"""This user's snapshot runs on this host, and removing the ones left behind.

A run's snapshots live in shared memory (``<root>/elastic_kit-<uid>/<run>-<hash>/``)
as long as the run lives, so that restarted workers find them; a finished run removes
them. A run abandoned for good (its job killed with no restart to come, a node taken
out of service) leaves them: RAM that stays in use until the host reboots. Nothing can
tell from inside the tree that no restart will come, so nothing removes a run's tree
on its own; :func:`snapshot_runs` lists what is there, with the signs of life a run
leaves (a snapshot writer's live process, the newest write), and
:func:`remove_idle_runs` removes runs without either (``python -m elastic_kit
snapshots --remove``).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field

from elastic_kit._agent import command_line, is_agent, torchrun_agent_pid
from elastic_kit.snapshot._private import check_root, is_private_entry, private_dir, user_dir_name
from elastic_kit.snapshot._slots import owner_alive, process_start, slot_owner_alive, slot_pid

__all__ = ["SnapshotRun", "host_node_alive", "host_node_name", "host_node_owner", "host_node_pid",
           "snapshot_runs", "remove_idle_runs"]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def host_node_name(agent_pid: int) -> str:
    """A node directory's name where ``$ELASTIC_KIT_SNAPSHOT_NODE`` does not set one:
    this host's name, the pid of the node's agent (the workers' parent, which outlives
    the restarts it drives) and, where it can be read, the agent's start time
    (``<host>-<pid>_<start>``, see :func:`~elastic_kit.snapshot._slots.process_start`):
    a pid alone names a later process too once the agent is gone (a container
    restarted in its pod gets the same pids again)."""
    start = process_start(agent_pid)
    owner = f"{agent_pid}" if start is None else f"{agent_pid}_{start}"
    return _safe(f"{socket.gethostname()[:120]}-{owner}")


def host_node_owner(name: str) -> tuple[int, int | None] | None:
    """``(pid, start)`` of the agent in a node directory's name made on this host by
    :func:`host_node_name` (``start`` None in a name without it), else None."""
    m = re.fullmatch(re.escape(_safe(socket.gethostname()[:120])) + r"-([0-9]+)(?:_([0-9]+))?",
                     name)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)) if m.group(2) else None


def host_node_pid(name: str) -> int | None:
    """The agent's pid in a node directory's name made on this host by
    :func:`host_node_name`, else None."""
    owner = host_node_owner(name)
    return None if owner is None else owner[0]


def host_node_alive(name: str) -> bool:
    """Whether the agent a node directory on this host is named after still runs (the
    same process, not a later one with its pid); False for another name."""
    owner = host_node_owner(name)
    return owner is not None and owner_alive(*owner)


@dataclass
class SnapshotRun:
    """One run's snapshot tree.

    Attributes:
        path: the run's directory.
        size_bytes: the bytes of its files.
        newest: the newest modification time in it (seconds since the epoch).
        writers: the live processes whose snapshot files are in it (pids).
        agents: the live agents of its node directories on this host (pids): while
            an agent waits for its next round, no worker of the node lives.
    """

    path: str
    size_bytes: int = 0
    newest: float = 0.0
    writers: list[int] = field(default_factory=list)
    agents: list[int] = field(default_factory=list)

    def idle_s(self, now: float | None = None) -> float:
        """Seconds since anything in it was written."""
        return max(0.0, (time.time() if now is None else now) - self.newest)


def _user_dir(root: str) -> str | None:
    check_root(root)
    try:
        return private_dir(root, [user_dir_name()], create=False)
    except FileNotFoundError:
        return None


def _runs_an_agent(pid: int) -> bool:
    """Whether process ``pid`` is a torchrun agent, or the fork server of one (a node
    directory is named after its workers' parent)."""
    argv = command_line(pid)
    if argv is None:
        return False
    return is_agent(argv) or torchrun_agent_pid(pid, levels=1) is not None


def _survey(path: str) -> SnapshotRun:
    run = SnapshotRun(path=path, newest=os.lstat(path).st_mtime)
    # A run outside torchrun (run id "local") names its node after its parent too: a
    # shell, a notebook server, which lives on after the run and is no sign of it; its
    # parent counts only if it is an agent after all. Under torchrun the parent counts
    # while it lives (a launcher that runs torchrun's agent in its own process, such
    # as accelerate's, has a command line of its own).
    plain = os.path.basename(path).startswith("local-")
    for name in sorted(os.listdir(path)):
        agent = host_node_pid(name)
        if agent is not None and host_node_alive(name) and (
                not plain or _runs_an_agent(agent)):
            run.agents.append(agent)
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            run.newest = max(run.newest, st.st_mtime)
            if name in filenames:
                run.size_bytes += st.st_size
            pid = slot_pid(name)
            if pid is not None and pid not in run.writers and slot_owner_alive(name):
                run.writers.append(pid)
    return run


def snapshot_runs(root: str) -> list[SnapshotRun]:
    """This user's snapshot runs under ``root`` (``/dev/shm`` by default in the tier),
    oldest write first. Only real directories of this user's are looked into.

    Raises:
        UnsafeTreeError: the root or this user's directory in it is not to be trusted.
    """
    user = _user_dir(root)
    if user is None:
        return []
    runs = [_survey(os.path.join(user, n)) for n in sorted(os.listdir(user))
            if is_private_entry(os.path.join(user, n))]
    return sorted(runs, key=lambda r: r.newest)


def remove_idle_runs(root: str, *, idle_s: float, dry_run: bool = False,
                     now: float | None = None) -> list[SnapshotRun]:
    """Remove (unless ``dry_run``) this user's snapshot runs under ``root`` that no live
    snapshot writer uses, whose nodes on this host have no live agent, and where
    nothing was written for ``idle_s`` seconds; the runs removed (or that would be).

    Raises:
        ValueError: ``idle_s`` is negative.
    """
    if idle_s < 0:
        raise ValueError(f"idle_s={idle_s!r} must be >= 0 seconds")
    doomed = [r for r in snapshot_runs(root)
              if not r.writers and not r.agents and r.idle_s(now) >= idle_s]
    if not dry_run:
        for r in doomed:
            shutil.rmtree(r.path)  # fd-based on Linux: a symlink inside is not followed
    return doomed
