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
- every node of the last round this agent completed is a participant again (a node
  between leaving the old round and joining the new one is still counted as
  coming: it holds no keep-alive then),
- no node waits to join and every node with a live keep-alive is a participant, and
- the round has its minimum number of nodes.

Otherwise torch decides, as before: a round that misses a node of the last one (a
node died, or left on a preemption notice) still waits out the last call, as does a
round where a node is waiting. A node that starts while such a round closes waits
for the next round, as one asking after the last call does.

Marking the round complete is torch's own step (its ranks, its write to the shared
state): the write is a compare-and-set, so a state that changed meanwhile (a node
joined) is read again and the decision taken again on it.

This reaches into torch's rendezvous module, whose join operation and actions are not
public API: where they are missing (another torch), rounds close as torch closes them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

__all__ = ["install", "may_close"]

log = logging.getLogger(__name__)

#: run id -> (round, nodes): the last round this process's agent saw complete with
#: itself a participant.
_completed: dict[str, tuple[int, frozenset[Any]]] = {}


def may_close(state: Any, node: Any, min_nodes: int,
              completed: tuple[int, frozenset[Any]] | None) -> bool:
    """Whether ``node``, a participant of ``state``'s open round, may close it now:
    every node of the ``completed`` round (``(round, nodes)``, None before any) is back,
    nobody waits, every node with a live keep-alive is in, and there are at least
    ``min_nodes`` (see the module)."""
    if completed is None or state.complete or state.closed:
        return False
    done_round, nodes = completed
    participants = state.participants
    return (state.round > done_round
            and node in participants
            and len(participants) >= min_nodes
            and all(n in participants for n in nodes)
            and not state.wait_list
            and not state.redundancy_list
            and all(n in participants for n in state.last_heartbeats))


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
        state, run_id = ctx.state, ctx.settings.run_id
        if action == finish and state.complete and ctx.node in state.participants:
            _completed[run_id] = (state.round, frozenset(state.participants))
        elif action == sync and may_close(state, ctx.node, ctx.settings.min_nodes,
                                          _completed.get(run_id)):
            log.info("rendezvous %s: round %d closed with %d nodes, every node of round "
                     "%d being back", run_id, state.round, len(state.participants),
                     _completed[run_id][0])
            return complete
        return action

    __call__._elastic_kit_original = call  # type: ignore[attr-defined]
    op.__call__ = __call__
    return True
