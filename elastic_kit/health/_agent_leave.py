"""The launcher's half of a planned leave: the agent leaves the rendezvous at once.

When a node leaves on purpose (a preemption notice, see
:mod:`elastic_kit.checkpointer._departure`), its agent must go without closing the
rendezvous (a finished agent closes it: the job would end for everyone). Plain
torchrun offers one way: SIGTERM, after which the agent stops but stays a participant
of the finished round until its keep-alives lapse (``keep_alive_interval *
keep_alive_max_attempt``, about 3 s with the README's settings); the survivors'
next round cannot start before, since a round restarts only once every participant
of the last one left it.

``python -m elastic_kit.run`` installs, in the agent, a handler for
:data:`LEAVE_SIGNAL`: it removes this node from the rendezvous' participants (the
same step torchrun's own agents take before every new round), then SIGTERMs the
agent, which stops as before. The survivors' round starts as soon as they ask. The
launcher tells its workers so through :data:`LEAVE_ENV`; a worker under plain
torchrun sends SIGTERM as before.

This reaches into torch's dynamic rendezvous handler (the c10d and etcd-v2
backends), whose operations are not public API: where they are missing (another
torch, another backend), the agent only stops, as with SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

__all__ = ["LEAVE_ENV", "LEAVE_SIGNAL", "install", "leave_rendezvous", "uninstall"]

log = logging.getLogger(__name__)

#: The signal a leaving worker sends an agent started by ``python -m elastic_kit.run``.
LEAVE_SIGNAL = signal.SIGUSR2
#: Set by the launcher for its workers: the name of :data:`LEAVE_SIGNAL`.
LEAVE_ENV = "ELASTIC_KIT_AGENT_LEAVE_SIGNAL"
#: Seconds the agent tries to leave the rendezvous before it stops anyway.
LEAVE_TIMEOUT_S = 10.0

_handlers: list[Any] = []
_leaving = threading.Lock()
#: the leave signal was handled (checked first in the handler: a second signal arriving
#: while the first's handler starts its thread must not start another, nor take
#: threading's internal lock that the interrupted start may hold on this very thread)
_signalled = False


def install() -> None:
    """In the agent, before torchrun's ``main``: remember the rendezvous handler the
    agent creates, and leave it on :data:`LEAVE_SIGNAL`."""
    from torch.distributed.elastic.rendezvous import registry

    create = registry.get_rendezvous_handler

    def capture(params: Any) -> Any:
        handler = create(params)
        _handlers.append(handler)
        return handler

    registry.get_rendezvous_handler = capture
    signal.signal(LEAVE_SIGNAL, _on_signal)
    os.environ[LEAVE_ENV] = LEAVE_SIGNAL.name


def left() -> bool:
    """Whether this agent was told to leave (a worker's planned leave): the SIGTERM it
    then sends itself ends torchrun's ``main`` with ``SignalException``, which is this
    node's orderly end, not a failure."""
    return _signalled


def uninstall() -> None:
    """In a worker forked from the agent: forget the agent's rendezvous handlers (their
    store connection is the agent's; the leave is the agent's to make) and give
    :data:`LEAVE_SIGNAL` its default action. ``$`` :data:`LEAVE_ENV` stays: it tells
    the worker which signal makes its agent leave."""
    global _signalled
    _handlers.clear()
    _signalled = False
    if threading.current_thread() is threading.main_thread():
        signal.signal(LEAVE_SIGNAL, signal.SIG_DFL)


def _on_signal(signum: int, frame: Any) -> None:
    global _signalled
    if _signalled:
        return
    _signalled = True
    # From now on the agent must not start a new round: the others' restart makes them
    # wait for one, which its monitor would take for a node joining and rejoin (then
    # its new worker would see the notice and leave a second time).
    for handler in _handlers:
        handler.num_nodes_waiting = lambda: 0
        handler.next_rendezvous = _wait_for_stop
    # the main thread may be inside the handler's own state sync: leave on a thread,
    # which takes the handler's lock like torchrun's keep-alives do
    threading.Thread(target=_leave_then_stop, name="ek-agent-leave", daemon=True).start()


def _wait_for_stop(*args: Any, **kwargs: Any) -> Any:
    """A leaving agent's next round: none; the SIGTERM that follows the leave ends it."""
    time.sleep(2 * LEAVE_TIMEOUT_S)
    raise RuntimeError("this node is leaving the job; it joins no new round")


def _leave_then_stop() -> None:
    if not _leaving.acquire(blocking=False):
        return  # a second signal: already leaving
    for handler in list(_handlers):
        leave_rendezvous(handler)
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's own stop: workers, then exit


def leave_rendezvous(handler: Any, *, timeout: float = LEAVE_TIMEOUT_S) -> bool:
    """Remove this node from ``handler``'s rendezvous participants and stop its
    keep-alives; whether that happened (False, with a warning, where the handler is not
    torch's dynamic one or the backend did not answer within ``timeout`` s)."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler._stop_heartbeats()
        with handler._heartbeat_lock:
            handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + timeout)
    except Exception as e:
        log.warning("this node could not leave the rendezvous at once (%r): the others "
                    "wait until its keep-alives lapse", e)
        return False
    log.info("this node left the rendezvous: the others restart without waiting for it")
    return True
