"""The launcher's restart rounds close once every node of the last round is back.

Why. torch's dynamic rendezvous closes a round ``last_call_timeout`` after it has the
minimum number of nodes (unless it reaches the maximum), so that a node asking to
join a little later is let in. For an elastic job (``--nnodes=MIN:MAX``) that wait is
paid by every restart, also the commonest one: a worker died, its agent and every
other agent restart their workers and rejoin, and no other node is coming. With the
README's ``last_call_timeout=1`` it was most of the rendezvous' 1.3 s after a
worker's SIGKILL on the 2-core test machine.

``python -m elastic_kit.run`` closes such a round sooner, in its agent: a participant
of a round that is not complete marks it complete as soon as

- this agent took part in an earlier round of the rendezvous (the job's first round
  keeps torch's last call: nobody knows yet how many nodes are starting),
- every node of the last complete round this agent saw (its own, or one it waited
  through) is a participant again (a node between leaving the old round and joining
  the new one is still counted as coming: it holds no keep-alive then), or is dead:
  torch's own sync of the state in this process dropped it for a keep-alive older
  than the expiry (``keep_alive_interval * keep_alive_max_attempt``; the agent syncs
  while it monitors its workers, so a frozen node is usually dropped here first) and
  no newer keep-alive of it was seen since, or its keep-alive left the state
  between two reads of this agent at most an interval apart while the last one this
  agent saw of it was already older than the expiry (another agent's sync dropped
  it; a node that leaves a round itself removes a keep-alive at most two intervals
  old, so it is not taken for dead; after a longer gap between reads nobody can
  tell, and the node counts as one that may come),
- no node waits to join and every node with a live keep-alive is a participant, and
- the round has its minimum number of nodes.

Otherwise torch decides, as before: a round that misses a node of the last one that
is not known dead (one that left on a preemption notice, or died before this agent's
rendezvous began) still waits out the last call, as does a round where a node is
waiting. A node taken for dead that was alive after all (a keep-alive late past the
expiry, a host frozen for seconds) joins the next round: one restart more, as torch
itself has it for a node its sync dropped. A node that starts while such a round closes waits for the next round, as
one asking after the last call does.

Marking the round complete is torch's own step (its ranks, its write to the shared
state): the write is a compare-and-set, so a state that changed meanwhile (a node
joined) is read again and the decision taken again on it.

This reaches into torch's rendezvous module, whose join operation and actions are not
public API: where they are missing (another torch), rounds close as torch closes them.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Collection

__all__ = ["dead_nodes", "install", "may_close"]

log = logging.getLogger(__name__)

#: run id -> (round, nodes): the last complete round this process's agent saw (its
#: participants; the agent itself among them or waiting for the next round).
_completed: dict[str, tuple[int, frozenset[Any]]] = {}
#: run id -> node -> the newest keep-alive this agent saw of it since it last
#: completed a round.
_seen: dict[str, dict[Any, datetime]] = {}
#: run id -> node -> the keep-alive of it that this process's state syncs dropped as
#: dead since then (forgotten when a newer one is seen).
_dropped: dict[str, dict[Any, datetime]] = {}
#: run id -> node -> whether its keep-alive, seen before, left the state already past
#: the expiry (dead) or not (left the round itself); forgotten when it is back.
_vanished: dict[str, dict[Any, bool]] = {}
#: run id -> when the join operation last read the state (this rendezvous).
_last_read: dict[str, datetime] = {}


def may_close(state: Any, node: Any, min_nodes: int,
              completed: tuple[int, frozenset[Any]] | None,
              dead: Collection[Any] = ()) -> bool:
    """Whether ``node``, a participant of ``state``'s open round, may close it now:
    every node of the ``completed`` round (``(round, nodes)``, None before any) is back
    or in ``dead``, nobody waits, every node with a live keep-alive is in, and there
    are at least ``min_nodes`` (see the module)."""
    if completed is None or state.complete or state.closed:
        return False
    done_round, nodes = completed
    participants = state.participants
    return (state.round > done_round
            and node in participants
            and len(participants) >= min_nodes
            and all(n in participants or n in dead for n in nodes)
            and not state.wait_list
            and not state.redundancy_list
            and all(n in participants for n in state.last_heartbeats))


def dead_nodes(seen: dict[Any, datetime], expiry: timedelta,
               now: datetime | None = None) -> set[Any]:
    """The nodes whose newest keep-alive in ``seen`` is older than ``expiry`` (torch's
    own test of a dead node)."""
    cutoff = (now or datetime.now(timezone.utc)) - expiry
    return {n for n, beat in seen.items() if beat < cutoff}


def install() -> bool:
    """Make this process's dynamic rendezvous close a restart's round as soon as every
    node of the last round is back (see the module); whether it could (False, logged,
    where torch's rendezvous module lacks what is wrapped). Installing again keeps one
    wrapper."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError as e:
        log.info("rendezvous rounds close as torch closes them (%r)", e)
        return False
    op = getattr(dynamic_rendezvous, "_RendezvousJoinOp", None)
    actions = getattr(dynamic_rendezvous, "_Action", None)
    call: Callable[..., Any] | None = getattr(op, "__call__", None)
    call = getattr(call, "_elastic_kit_original", call)
    names = ("SYNC", "FINISH", "MARK_RENDEZVOUS_COMPLETE")
    if op is None or call is None or actions is None or not all(
            hasattr(actions, n) for n in names):
        log.info("rendezvous rounds close as torch closes them: this torch's "
                 "dynamic_rendezvous has no join operation to wrap")
        return False
    sync, finish, complete = (getattr(actions, n) for n in names)

    def __call__(self: Any, ctx: Any, deadline: float) -> Any:  # torch's signature
        action = call(self, ctx, deadline)
        state, settings = ctx.state, ctx.settings
        run_id = settings.run_id
        if state.complete and state.round > _completed.get(run_id, (-1, None))[0]:
            _completed[run_id] = (state.round, frozenset(state.participants))
        if action == finish and state.complete and ctx.node in state.participants:
            _seen[run_id] = {}  # the next rendezvous' sightings start afresh
            _dropped[run_id] = {}
            _vanished[run_id] = {}
            _last_read.pop(run_id, None)
            return action
        dead = _sightings(run_id, state.last_heartbeats, settings.keep_alive_interval,
                          settings.keep_alive_interval * settings.keep_alive_max_attempt)
        if action == sync:
            if may_close(state, ctx.node, settings.min_nodes, _completed.get(run_id), dead):
                log.info("rendezvous %s: closing round %d with %d nodes, every node of "
                         "round %d being back or dead", run_id, state.round,
                         len(state.participants), _completed[run_id][0])
                return complete
        return action

    __call__._elastic_kit_original = call  # type: ignore[attr-defined]
    op.__call__ = __call__
    _record_dropped(dynamic_rendezvous)
    return True


def _sightings(run_id: str, beats: dict[Any, datetime], interval: timedelta,
               expiry: timedelta) -> set[Any]:
    """Record the keep-alives ``beats`` of a state this agent read, and return the
    nodes known dead (see the module)."""
    now = datetime.now(timezone.utc)
    previous = _last_read.get(run_id)
    _last_read[run_id] = now
    dense = previous is not None and now - previous <= interval
    seen = _seen.setdefault(run_id, {})
    dropped = _dropped.setdefault(run_id, {})
    vanished = _vanished.setdefault(run_id, {})
    for n, beat in beats.items():
        if n not in seen or beat > seen[n]:
            seen[n] = beat
        if n in dropped and beat > dropped[n]:
            del dropped[n]  # alive after all
        vanished.pop(n, None)
    stale = dead_nodes(seen, expiry, now)
    for n in seen:
        if n not in beats and n not in vanished:
            vanished[n] = dense and n in stale
    return set(dropped) | {n for n, is_dead in vanished.items() if is_dead}


def _record_dropped(dynamic_rendezvous: Any) -> None:
    """Remember the nodes the state holder's sanitizer drops as dead (its
    ``_dead_nodes``), per run; where this torch's holder has no such step, only the
    join operation's sightings say which nodes are dead."""
    holder = getattr(dynamic_rendezvous, "_BackendRendezvousStateHolder", None)
    sanitize: Callable[..., Any] | None = getattr(holder, "_sanitize", None)
    sanitize = getattr(sanitize, "_elastic_kit_original", sanitize)
    if holder is None or sanitize is None:
        log.info("this torch's rendezvous state holder has no sanitizer: dead nodes are "
                 "known from the keep-alives seen while joining only")
        return

    def _sanitize(self: Any) -> None:
        state = getattr(self, "_state", None)
        beats = dict(getattr(state, "last_heartbeats", None) or {})
        sanitize(self)
        dropped = getattr(self, "_dead_nodes", None)
        settings = getattr(self, "_settings", None)
        if settings is None:
            return
        record = _dropped.setdefault(settings.run_id, {})
        for n, beat in beats.items():
            if n in record and beat > record[n]:
                del record[n]  # a newer keep-alive: alive after all
        for n in dropped or ():
            if n in beats:
                record[n] = beats[n]

    _sanitize._elastic_kit_original = sanitize  # type: ignore[attr-defined]
    holder._sanitize = _sanitize
