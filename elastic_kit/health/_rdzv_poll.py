"""The launcher's rendezvous poll: a waiting agent looks again in 0.1 s, not 1 s.

Why. torch's dynamic rendezvous (the c10d and etcd-v2 backends) moves through a
round in small operations on a shared state (leave the old round, join the wait
list, join the participants, close the round once the last call is over). An agent
that waits for the others sleeps a fixed second before it reads the state again,
and a read state is served from the agent's cache for a second ("to avoid
overloading the backend"). A running agent notices a node waiting to join (its
restarted peer) through that cache. So a restart after a worker's failure took
about 2 s on the 2-core test machine with ``last_call_timeout=1``: up to a second
before the other agent saw the waiting node, then the last call's second, and the
poll after it.

``python -m elastic_kit.run`` shortens both, in its agent, to
:func:`poll_seconds` of the job's largest node count: :data:`MIN_POLL_S` for up to
ten nodes, growing with the node count to torch's second at a hundred, so that the
backend's load (each poll reads the state; its size grows with the nodes) stays
what torch's one-second poll gives a hundred-node job. ``--rdzv-poll SECONDS``
chooses it.

This reaches into torch's rendezvous module, whose ``_delay`` and state holder are not
public API: where they are missing (another torch), the agent polls as before.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, NoReturn, Sequence

__all__ = ["LOWEST_POLL_S", "MIN_POLL_S", "TORCH_POLL_S", "install", "max_nodes", "poll_seconds"]

log = logging.getLogger(__name__)

#: torch's poll: the second a waiting agent sleeps between two reads of the state.
TORCH_POLL_S = 1.0
#: The shortest poll the launcher chooses (up to ten nodes).
MIN_POLL_S = 0.1
#: The shortest poll ``--rdzv-poll`` takes: a waiting agent reads the whole state from
#: the backend at each poll, so a shorter one would hammer it to save nothing a
#: restart can notice.
LOWEST_POLL_S = 0.01


def max_nodes(torchrun_argv: Sequence[str]) -> int:
    """The largest node count torchrun's ``--nnodes`` allows (``N`` or ``MIN:MAX``;
    torchrun's default, 1, without it), read with torchrun's own parser.

    Raises:
        ValueError: torchrun's parser refuses the options (naming why), or
            ``--nnodes`` is not ``N`` or ``MIN:MAX`` with positive integers.
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> NoReturn:
        raise ValueError(f"torchrun's options: {message}")

    parser.error = error  # type: ignore[method-assign]
    args, _ = parser.parse_known_args(list(torchrun_argv))
    value = str(args.nnodes)
    top = value.rsplit(":", 1)[-1]
    if not top.isdigit() or int(top) < 1:
        raise ValueError(f"--nnodes {value!r}: expected N or MIN:MAX (positive integers)")
    return int(top)


def poll_seconds(nodes: int) -> float:
    """The poll for a job of at most ``nodes`` nodes: :data:`MIN_POLL_S` up to ten
    nodes, then 0.01 s per node, at most torch's :data:`TORCH_POLL_S`."""
    return min(TORCH_POLL_S, max(MIN_POLL_S, 0.01 * nodes))


def install(seconds: float) -> bool:
    """Make this process's dynamic rendezvous read its state every ``seconds``
    (instead of torch's second); whether it could (False, logged, where torch's
    rendezvous module lacks what is replaced).

    Two waits of torch's are shortened, both a second: the sleep between two reads
    while an agent waits for the others, and how long a read state is served from the
    agent's cache (which is what a running agent's check for nodes waiting to join
    reads, every monitor interval). torch's other delays (the random one before a
    first round) stay.

    Raises:
        ValueError: ``seconds`` is not in (0, :data:`TORCH_POLL_S`].
    """
    if not 0 < seconds <= TORCH_POLL_S:
        raise ValueError(f"rendezvous poll {seconds!r} s: expected a number of seconds in "
                         f"(0, {TORCH_POLL_S}]")
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError as e:
        log.info("the rendezvous polls as torch does (%r)", e)
        return False
    original: Callable[..., Any] | None = getattr(dynamic_rendezvous, "_delay", None)
    holder = getattr(dynamic_rendezvous, "_BackendRendezvousStateHolder", None)
    init = getattr(holder, "__init__", None)
    init = getattr(init, "_elastic_kit_original", init)
    if original is None or holder is None or init is None or (
            "cache_duration" not in inspect.signature(init).parameters):
        log.info("the rendezvous polls as torch does: this torch's dynamic_rendezvous has "
                 "no _delay or state cache to shorten")
        return False
    original = getattr(original, "_elastic_kit_original", original)
    poll = seconds

    def _delay(seconds: float | tuple[float, float]) -> None:  # torch's signature
        if seconds == TORCH_POLL_S:  # the poll between two reads of the state
            seconds = poll
        original(seconds)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(init).bind(self, *args, **kwargs)
        bound.apply_defaults()
        bound.arguments["cache_duration"] = min(bound.arguments["cache_duration"], poll)
        init(*bound.args, **bound.kwargs)

    _delay._elastic_kit_original = original  # type: ignore[attr-defined]
    __init__._elastic_kit_original = init  # type: ignore[attr-defined]
    dynamic_rendezvous._delay = _delay  # type: ignore[attr-defined]
    holder.__init__ = __init__  # type: ignore[misc]
    log.debug("the rendezvous reads its state every %.2f s", seconds)
    return True
