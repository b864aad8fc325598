"""What a test's snapshot root holds after a run: this user's directory in it stays
when runs end (gone, another user could make one of its name), so a finished run
leaves nothing but that empty directory."""

from __future__ import annotations

import os
import re
from pathlib import Path


def left_in(root: str | os.PathLike[str]) -> list[str]:
    """The entries below ``root`` (relative paths), except this user's empty
    ``elastic_kit-<uid>`` directory."""
    root = Path(root)
    user = root / f"elastic_kit-{os.geteuid()}"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if not (p == user and p.is_dir() and not any(p.iterdir())))


def replica_step_dirs(root: str | os.PathLike[str], agent_pid: int,
                      peer_pid: int | None = None) -> list[Path]:
    """The ``step-<n>`` directories of the replicas in the node directory of the agent
    ``agent_pid`` (``<root>/<user>/<run>/<host>-<pid>_<start>/replicas/<peer>/``),
    of the peer node whose agent is ``peer_pid`` only, when given (a sharded part's
    source ends in ``.p<local rank>``)."""
    def named_after(name: str, pid: int) -> bool:
        return re.search(rf"-{pid}(_[0-9]+)?(\.p[0-9]+)?$", name) is not None

    return sorted(step for node in Path(root).glob("elastic_kit-*/*/*")
                  if named_after(node.name, agent_pid)
                  for peer in (node / "replicas").glob("*")
                  if peer_pid is None or named_after(peer.name, peer_pid)
                  for step in peer.glob("step-*"))
