"""What a checkpointer installs into the process and the optimizer, removed once.

A checkpointer closes once: collectively at the end of training, or on one rank
alone while an exception propagates; whichever comes first removes the SIGTERM
handler, the optimizer's staging pre-hook and the exit handler, and the other finds
nothing to do.

The exit handler is for the script that lets an exception end the process (a peer
died and a collective failed) without ``with Checkpointer(...)``: the snapshot taken
last may still be queued on the writer thread, a daemon the interpreter would stop
unwritten, and it is the state a restart resumes from. At exit the checkpointer is
abandoned (no collective): what was taken is written.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from elastic_kit.distributed import get_dist_info
from elastic_kit.state import TerminationFlag

__all__ = ["Hooks", "stop_signals"]


def stop_signals() -> tuple[int, ...]:
    """The signals that make a checkpointer save and exit: SIGTERM (torchrun's restart
    notice, a scheduler's stop), and under torchrun also SIGINT and SIGHUP, which the
    agent forwards to its workers when it is interrupted (Ctrl-C) or loses its
    terminal: it ends the job then, so without a save the steps since the last durable
    checkpoint were lost (the memory snapshot a worker writes on its way out belongs
    to that run id, which a relaunch under ``--standalone`` does not share). Outside
    torchrun, Ctrl-C keeps its ``KeyboardInterrupt``."""
    if get_dist_info().under_torchrun:
        return (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    return (signal.SIGTERM,)


class Hooks:
    """The SIGTERM flag, the optimizer pre-hook, and whether they were removed."""

    def __init__(self) -> None:
        #: set by SIGTERM (under torchrun also SIGINT, SIGHUP; when installed) or by a
        #: request to stop
        self.stop = TerminationFlag(stop_signals())
        #: set by a request to end training for good (save, exit 0: no restart)
        self.finish = threading.Event()
        self._step_hook: Any = None
        #: the optimizer the pre-hook is on (compared by identity), and the hook
        self._optimizer: Any = None
        self._wait_staged: Callable[..., None] | None = None
        self._at_exit: Callable[[], None] | None = None
        #: torch's hook before every optimizer's step (see install)
        self._any_step_hook: Any = None
        self.closed = False
        # the training thread and the heartbeat's (a silent peer) may close at once
        self._lock = threading.Lock()

    def install(self, *, signals: bool, optimizer: torch.optim.Optimizer | None,
                wait_staged: Callable[..., None],
                at_exit: Callable[[], None] | None = None,
                on_unheard: Callable[[int], None] | None = None,
                on_received: Callable[[int], None] | None = None,
                current: Callable[[], Any] | None = None, hook_steps: bool = True) -> None:
        """Catch SIGTERM when ``signals`` (``on_unheard``, a bound method held
        weakly: called on a watcher thread when the main thread does not hear it;
        ``on_received``, likewise: called in the handler as the signal comes; see
        :class:`~elastic_kit.state.TerminationFlag`);
        with ``hook_steps``, run ``wait_staged`` before every step of ``optimizer``
        (the only place the parameters a background save reads change), and before
        a step of the optimizer ``current()`` returns when that is another one (the
        train state was given a new optimizer, or its first after the restore: that
        step comes before :meth:`follow` can move the hook, while a save taken before
        it may still read the parameters);
        call the bound method ``at_exit`` when the interpreter exits before
        :meth:`close` (held weakly: it does not keep its object alive)."""
        if signals:
            self.stop.on_unheard = None if on_unheard is None else _weakly(on_unheard)
            self.stop.on_received = None if on_received is None else _weakly(on_received)
            self.stop.install()
        if hook_steps and self._wait_staged is None:
            self._wait_staged = wait_staged
            if optimizer is not None:
                self._step_hook = optimizer.register_step_pre_hook(wait_staged)
                self._optimizer = optimizer
            if current is not None:
                self._any_step_hook = register_optimizer_step_pre_hook(
                    _before_a_new_optimizers_step(weakref.ref(self), current))
        if at_exit is not None and self._at_exit is None:
            weak, owner = _weakly(at_exit), os.getpid()

            def at_exit_here() -> None:
                # a child forked by the script (os.fork, then sys.exit) inherits the
                # handler: the checkpointer, its threads and its snapshot files are the
                # parent's (its save's threads do not exist there: the wait hung; its
                # snapshot files went, and the parent's snapshots with them)
                if os.getpid() == owner:
                    weak()

            self._at_exit = at_exit_here
            atexit.register(self._at_exit)

    def follow(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Move the pre-hook to ``optimizer`` when it is not the one hooked (the train
        state was given another optimizer after the restore: a new phase of training),
        so that a background copy is still waited for before its steps. A cheap
        identity check otherwise (called at every step)."""
        if optimizer is self._optimizer or optimizer is None or self._wait_staged is None:
            return
        with self._lock:
            if self.closed:
                return
            if self._step_hook is not None:
                self._step_hook.remove()
            self._step_hook = optimizer.register_step_pre_hook(self._wait_staged)
            self._optimizer = optimizer

    def close(self, *, keep_signals: bool = False, keep_step_hook: bool = False) -> bool:
        """Remove the hooks; False when they were already removed (nothing to do).
        Thread-safe: of two threads closing at once, one gets True.

        ``keep_signals``: leave the SIGTERM handler in place (remove it with
        ``stop.uninstall()``): a rank abandoning its checkpointer writes its last state
        first, and torchrun's SIGTERM, which may come meanwhile, must not end the
        process before it is written (the default action would; the handler only
        notes it). ``keep_step_hook``: leave the optimizer's pre-hook in place, for a
        process that ends without returning to the training thread (the hook is what
        holds that thread out of the optimizer's step meanwhile)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if not keep_step_hook:
            for hook in (self._step_hook, self._any_step_hook):
                if hook is not None:
                    hook.remove()
            self._step_hook = self._any_step_hook = None
            self._optimizer = None
        if not keep_signals:
            self.stop.uninstall()
        return True


def _before_a_new_optimizers_step(hooks: weakref.ref[Hooks],
                                  current: Callable[[], Any]) -> Callable[..., None]:
    """torch's hook before every optimizer's step (held weakly: the process-wide hook
    does not keep a checkpointer alive): the hooked ``wait_staged`` for the optimizer
    ``current()`` names when it is not the one the pre-hook is on. A cheap identity
    check for any other optimizer's step (a second model's)."""

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        h = hooks()
        if h is None or optimizer is h._optimizer or h._wait_staged is None:
            return
        if optimizer is current():
            h._wait_staged(optimizer, args, kwargs)

    return hook


def _weakly(bound: Callable[..., None]) -> Callable[..., None]:
    """Call the bound method ``bound`` while its object lives (a weak reference: the
    process-wide handlers holding it do not keep a checkpointer alive)."""
    method = weakref.WeakMethod(bound)  # type: ignore[arg-type]

    def run(*args: Any) -> None:
        fn = method()
        if fn is not None:
            fn(*args)

    return run
