"""A planned leave: an announced departure costs no step.

When a node is told it will go (a cloud's preemption notice, the scheduler's signal;
see :class:`~elastic_kit.health.PreemptionWatcher`), its ranks raise the ``leave``
flag of the next exchange, so every rank learns it at the same step. There:

1. the ranks learn which nodes leave (one small gather);
2. the state of that step goes into memory: a snapshot on every node, each streamed
   to the next node as always; the close that follows waits until this node's
   snapshot is written and its stream has landed in the peer's memory, and its
   barrier lets no rank go on before every node got that far. Without snapshots, or
   when every node leaves (no memory survives), a durable checkpoint instead. A
   durable save still in flight (a periodic one) is waited for after that barrier:
   a leaving node does not stay for a staying node's upload, which may take longer
   than its notice, while the staying ranks wait for one another's writes (one's
   exit would make its agent stop the others, a writer among them);
3. the leaving ranks exit 0 and local rank 0 of a leaving node stops its torchrun
   agent without closing the rendezvous (a finished agent would close it, ending the
   job for everyone): an agent of ``python -m elastic_kit.run`` leaves the
   rendezvous at once; plain torchrun's gets SIGTERM, and the rendezvous drops the
   node once its keep-alives lapse;
4. the staying ranks exit with the checkpointer's ``exit_code``, torchrun restarts
   them without the leaving node, and the restore finds the step just taken in their
   own memory: nothing is redone.

torchrun counts the survivors' restart against ``--max-restarts``, as every
scale-down: its agents restart a healthy group only for a node that joins.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable, NoReturn

from elastic_kit._agent import (command_line, hosts_c10d_endpoint, python_module,
                                torchrun_agent_pid)
from elastic_kit._console import say
from elastic_kit.distributed import DistInfo, all_gather_object, is_dist_ready
from elastic_kit.health import LEAVE_ENV, LEAVE_SIGNAL, PreemptionWatcher

__all__ = ["Departure"]

log = logging.getLogger(__name__)


class Departure:
    """This rank's preemption watcher and the leave it leads to.

    Args:
        enabled: watch for notices at all (``CheckpointerConfig.handle_preemption``).
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.notice: str | None = None
        self._noticed = threading.Event()
        self._watcher: PreemptionWatcher | None = None
        #: a leave agreed at an epoch's last step waits for the epoch's end
        self.pending = False

    def start(self, info: DistInfo) -> None:
        """Start watching (each node's local rank 0 polls the metadata service; every
        rank catches the notice signals)."""
        if not self.enabled or self._watcher is not None:
            return
        try:
            self._watcher = PreemptionWatcher(self._on_notice,
                                              poll_metadata=info.local_rank == 0).start()
        except ValueError as e:  # a bad ELASTIC_KIT_* setting: say so, train on
            log.warning("preemption notices are not watched: %s", e)

    def _on_notice(self, what: str) -> None:
        self.notice = what
        self._noticed.set()

    def noticed(self) -> bool:
        """Whether this rank was told its node will go (the exchange's ``leave`` flag)."""
        return self._noticed.is_set()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None

    def leave(self, info: DistInfo, step: int, *, snapshot: Callable[[], bool],
              save: Callable[[], None], close: Callable[[list[int]], None],
              exit_code: int) -> NoReturn:
        """Carry out the agreed leave at ``step`` (collective: every rank, at the same step).

        ``snapshot`` takes one now and says whether snapshots are on; ``save`` saves
        durably; ``close(staying)`` closes the checkpointer for a leave (waits for the
        snapshots and the replica streams, a barrier, then for this rank's own
        durable writes, and on the ranks that stay for those of every rank that
        stays: a staying rank's exit makes its torchrun agent stop the node's other
        workers, a writer among them, whose upload would then be cut off).
        """
        # torchrun has no restart left for this node (its default --max-restarts is 0;
        # each agent counts its own restarts: a node that joined later has more left)
        mine = info.under_torchrun and info.restart_count >= info.max_restarts
        # this node's agent serves the c10d rendezvous: its exit ends it for every node
        host = info.is_local_main and info.under_torchrun and _hosts_rendezvous()
        me = (info.node_rank, self.notice, mine, host)
        gathered = all_gather_object(me) if is_dist_ready() else [me]
        notices = [(node, what) for node, what, _, _ in gathered]
        leaving = sorted({node for node, what in notices if what is not None})
        staying = [rank for rank, (node, _) in enumerate(notices) if node not in leaving]
        what = next(w for _, w in notices if w is not None)
        everyone = set(leaving) >= {node for node, _ in notices}
        # a staying node's agent with no restart left: its exit ends the job, and the
        # step must outlive it; every rank must take the same branch (collectives)
        last = any(no_restart for node, _, no_restart, _ in gathered if node not in leaving)
        host_leaves = any(hosts for node, _, _, hosts in gathered if node in leaving)
        ends = last or host_leaves
        durable = everyone or ends or not snapshot()
        if durable:
            save()
        close(staying)
        step_kept = "a durable checkpoint" if durable else "memory on the nodes that stay"
        if info.node_rank in leaving:
            stopped = True
            if info.is_local_main:
                # every agent then ends without an error: say what brings the job back
                say(log, "this node leaves at step %d (%s): the state is in %s%s", step, what,
                    step_kept, "; every node leaves, so the job ends: relaunch it to resume "
                    "there" if everyone else "; its agent serves the c10d rendezvous "
                    "endpoint, so the job ends: relaunch it to resume there" if host
                    else "")
                stopped = _stop_agent(info)
            # a worker that ends with 0 under an agent that goes on tells it the job is
            # done, and the agent closes the rendezvous for every node: without a stopped
            # agent, fail, and the group restarts (with this node, until it is gone)
            raise SystemExit(exit_code if everyone or not stopped else 0)
        if info.rank == min(staying):  # the staying nodes say it, rank 0 or not
            then = ("the leaving node's agent serves the c10d rendezvous endpoint: the job "
                    "ends; relaunch it to resume there" if host_leaves
                    else f"torchrun has no restart left (--max-restarts={info.max_restarts}): "
                    f"the job ends; relaunch it to resume there" if last
                    else "restarting without them")
            say(log, "node(s) %s leave at step %d (%s): the state is in %s; %s (status %d)",
                leaving, step, what, step_kept, then, exit_code)
        raise SystemExit(exit_code)


def _hosts_rendezvous() -> bool:
    """Whether this worker's torchrun agent serves the job's c10d rendezvous endpoint."""
    agent = torchrun_agent_pid()
    return agent is not None and hosts_c10d_endpoint(agent)


def _stop_agent(info: DistInfo) -> bool:
    """Stop this worker's torchrun agent without closing the rendezvous; whether it
    was told to (False: none found, or the signal failed).

    An agent started by ``python -m elastic_kit.run`` is sent the launcher's leave
    signal: it leaves the rendezvous at once, then stops (see
    :mod:`elastic_kit.health._agent_leave`); this worker then waits for the agent to stop it,
    so the agent never sees its workers succeed (which would close the rendezvous).
    Any other agent is sent SIGTERM: it stops its workers and exits, and the
    rendezvous drops the node once its keep-alives lapse."""
    agent = torchrun_agent_pid() if info.under_torchrun else None
    if agent is None:
        log.warning("no torchrun agent found above this worker: it cannot take the node "
                    "out of the job; the workers fail, so that the group restarts rather "
                    "than ends")
        return False
    leave = _leave_signal(agent)
    say(log, "stopping its torchrun agent (pid %d): the node leaves the rendezvous%s", agent,
        " at once" if leave is not None else "")
    try:
        os.kill(agent, signal.SIGTERM if leave is None else leave)
    except OSError as e:
        log.warning("could not stop the torchrun agent (pid %d): %r", agent, e)
        return False
    if leave is not None:
        deadline = time.monotonic() + AGENT_STOP_WAIT_S
        while time.monotonic() < deadline and os.path.exists(f"/proc/{agent}"):
            time.sleep(0.02)  # the agent SIGTERMs this worker once it left
    return True


#: Seconds a leaving worker waits for its agent (started by ``elastic_kit.run``) to
#: leave the rendezvous and stop it.
AGENT_STOP_WAIT_S = 15.0


def _leave_signal(agent: int) -> int | None:
    """The leave signal of an agent started by ``python -m elastic_kit.run`` (it says
    so in its workers' environment, and its command line runs that module), else None."""
    name = os.environ.get(LEAVE_ENV)
    if name != LEAVE_SIGNAL.name:
        return None
    argv = command_line(agent)
    if argv is None:
        return None
    return LEAVE_SIGNAL if python_module(argv) == b"elastic_kit.run" else None
