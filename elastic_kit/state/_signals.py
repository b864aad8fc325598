"""SIGTERM handling: note the request, let the loop stop at a safe point.

On a group restart torchrun sends SIGTERM to every worker and SIGKILL 30 seconds
later. The handler only sets a flag; the loop finishes the current optimizer step,
agrees with every other rank that it is time to stop (so no rank is left waiting in
a collective), saves a checkpoint synchronously and exits non-zero.

A Python handler runs on the main thread between two bytecodes, so a main thread that
sits in a call that does not return (a collective whose peer is gone and that NCCL,
or gloo with a frozen peer, never fails) never hears the signal. With ``on_unheard``
a watcher thread learns of each signal through the interpreter's wakeup fd (written
by the C-level handler at once) and, when the main thread's handler has not run
within ``unheard_after_s`` seconds, calls ``on_unheard(signum)`` there: what the
process can still do before torchrun's SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from types import FrameType
from typing import Any, Callable

__all__ = ["TerminationFlag", "UNACTED_AFTER_S", "UNHEARD_AFTER_S", "UNHEARD_MAX_S"]

log = logging.getLogger(__name__)

#: Seconds after a signal within which the main thread's handler must have run, or
#: ``on_unheard`` is called (torchrun's SIGKILL follows its SIGTERM after 30 s).
UNHEARD_AFTER_S = 5.0
#: The most a caller should set ``unheard_after_s`` to (for long steps, whose one
#: backward pass is one call): the rest of torchrun's 30 s is for writing.
UNHEARD_MAX_S = 15.0
#: The least number of seconds after a signal the main thread heard within which the
#: caller must :meth:`~TerminationFlag.acknowledge` it (begin acting on it), or
#: ``on_unheard`` is called all the same, where the flag asks for that
#: (``unacted_after_s``; a checkpointer asks for twice a step's wall time, at least
#: this): the script heard it but is away from the place that acts on it (end-of-epoch
#: work, a validation longer than torchrun's grace); the rest of the 30 s is for writing.
UNACTED_AFTER_S = 15.0


class TerminationFlag:
    """A flag set by SIGTERM (and optionally SIGINT), usable as a context manager.

    Args:
        signals: the signals to catch (default SIGTERM).

    Example::

        with TerminationFlag() as stop:
            for batch in loader:
                step(batch)
                if stop.is_set():
                    save(); raise SystemExit(143)

    Handlers are only installed in the main thread (Python allows nothing else);
    elsewhere the flag just never sets by itself. Previous handlers are restored on
    exit.

    ``on_unheard``: called on a watcher thread with the signal's number when the main
    thread has not run the handler ``unheard_after_s`` seconds after the signal came
    (see the module); once. Not watched when the process's wakeup fd is already taken
    (an event loop's). With ``unacted_after_s`` set, also when the handler ran but
    nobody called :meth:`acknowledge` within that many seconds of the signal
    (:attr:`heard` then tells the two apart).

    ``on_received``: called with the signal's number in the handler (on the main
    thread, between two bytecodes of whatever it was running), for the first signal
    only; it must be quick and must not wait for anything (a flag, a shorter
    timeout). A main thread in a wait that does not return for signals hears them
    there too (a ``Future``'s, a lock's): what this sets can end that wait.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,), *,
                 on_unheard: Callable[[int], None] | None = None,
                 unheard_after_s: float = UNHEARD_AFTER_S,
                 on_received: Callable[[int], None] | None = None) -> None:
        self.signals = tuple(signals)
        self.on_unheard = on_unheard
        self.on_received = on_received
        self.unheard_after_s = unheard_after_s
        self._event = threading.Event()
        self._heard = threading.Event()  # the handler ran (on the main thread)
        self._acted = threading.Event()  # acknowledge(): the caller acts on it
        self._quiet = threading.Event()  # acknowledge(unheard=True)
        self.unacted_after_s: float | None = None
        self._previous: dict[int, Any] = {}
        #: while uninstalled, the handlers this flag replaced: a signal that still
        #: comes to this flag goes on to them (see _pass_on; kept across a reinstall:
        #: the script's handler may still chain here)
        self._passed_on: dict[int, Any] = {}
        #: signals whose handler, set over this flag's, an uninstall kept
        self._kept: set[int] = set()
        self._pipe: tuple[int, int] | None = None
        self.received: int | None = None
        self.received_at: float | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum in self._passed_on and self not in _INSTALLED:
            self._pass_on(signum, frame)
            return
        # Nothing but bookkeeping here: the loop does the work at a safe point.
        first = self.received is None
        if first:
            self.received, self.received_at = signum, time.monotonic()
        self._heard.set()
        self._event.set()
        if first and self.on_received is not None:
            try:
                self.on_received(signum)
            except Exception as e:  # a handler must not raise into the code it interrupted
                log.warning("acting on signal %d at once failed: %r", signum, e)

    def is_set(self) -> bool:
        return self._event.is_set()

    @property
    def heard(self) -> bool:
        """Whether the main thread ran the handler of a signal that came."""
        return self._heard.is_set()

    def previous_handler(self, signum: int) -> Any:
        """The handler ``signum`` had before :meth:`install` (what ``signal.signal``
        returned: a callable, ``SIG_DFL``, ``SIG_IGN``, or None for one not set from
        Python); None while not installed."""
        return self._previous.get(signum)

    @property
    def acknowledged(self) -> bool:
        """Whether :meth:`acknowledge` was called (a stop is being acted on)."""
        return self._acted.is_set()

    def acknowledge(self, *, unheard: bool = False) -> None:
        """Say that the signal is being acted on (the stop has begun): the watcher no
        longer calls ``on_unheard`` for a heard one. With ``unheard``, not for one the
        main thread does not hear either: what runs now must not be cut short (a final
        save, in a collective its peer joins a little later)."""
        self._acted.set()
        if unheard:
            self._quiet.set()

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        """The signal, come to this flag after :meth:`uninstall`, goes where it would
        have gone without the flag. Put back as the process's handler (by the script's
        handler, which restores the one it replaced and raises the signal again; by a
        second flag installed over this one and removed after it): what this flag
        replaced is restored and given the signal (called, ignored, or the default
        action: the signal is raised again). Called by the script's handler, set since,
        which chains to the one it replaced: what that chain does without the flag (a
        handler is called; SIG_DFL and SIG_IGN are no function to call)."""
        previous = self._passed_on[signum]
        current = signal.getsignal(signum)
        if current == self._handle:
            signal.signal(signum, previous)
            if previous is signal.SIG_DFL:
                os.kill(os.getpid(), signum)
                return
        elif previous == current:
            return  # the handler that chained here: calling it would come back here
        if callable(previous):
            previous(signum, frame)

    def set(self) -> None:
        """Request a stop by hand (tests, or a user's own condition)."""
        if self.received_at is None:
            self.received_at = time.monotonic()
        self._event.set()

    def install(self) -> TerminationFlag:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: no SIGTERM handler installed (Python "
                        "runs them on the main thread only), so a SIGTERM ends the process "
                        "without a checkpoint; have the main thread's own handler call "
                        "ckpt.request_stop(restart=True)")
            return self
        if self in _INSTALLED:  # installed already: its handler would be its "previous"
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        _INSTALLED.add(self)
        if self.on_unheard is not None and self._pipe is None:
            self._watch()
        return self

    def uninstall(self) -> None:
        self._acted.set()  # nothing is left to act on it
        _INSTALLED.discard(self)
        for sig, prev in self._previous.items():
            prev = prev if prev is not None else signal.SIG_DFL
            # a signal that comes to this flag later is passed on (see _pass_on) to what
            # it replaced; but once a handler set over this flag's was kept (it may
            # chain here), to what it replaced then: installed again over that handler,
            # the flag replaced the handler that chains to it the second time
            if sig not in self._kept:
                self._passed_on[sig] = prev
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, prev)
            else:  # the script's (or another flag's), set since: kept
                self._kept.add(sig)
        self._previous.clear()
        if self._pipe is not None and threading.current_thread() is threading.main_thread():
            r, w = self._pipe
            self._pipe = None
            _WATCHING.discard(self)
            current = signal.set_wakeup_fd(-1)
            if current != w:  # taken over since (an event loop's): leave it theirs
                signal.set_wakeup_fd(current)
            os.close(w)  # the watcher's read ends; it closes its end

    def _watch(self) -> None:
        """Take the wakeup fd (unless another's) and start the watcher thread."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError) as e:
            log.debug("no wakeup fd for unheard signals: %r", e)
            os.close(r), os.close(w)
            return
        if previous != -1:  # someone else's: give it back, and watch nothing
            signal.set_wakeup_fd(previous)
            os.close(r), os.close(w)
            return
        self._pipe = (r, w)
        _WATCHING.add(self)
        threading.Thread(target=self._watch_loop, args=(r,), name="elastic-kit-unheard",
                         daemon=True).start()

    def _watch_loop(self, r: int) -> None:
        """Read the wakeup fd until :meth:`uninstall` closes it (a reader must stay:
        the interpreter writes every later signal there too); act on the first
        watched signal only."""
        acted = False
        try:
            while True:
                try:
                    data = os.read(r, 64)
                except InterruptedError:
                    continue
                except OSError:
                    return
                if not data:
                    return  # uninstalled
                got = [b for b in data if b in self.signals]
                if acted or not got:
                    continue  # later signals, or another signal with a Python handler
                acted = True
                came = time.monotonic()
                if not self._heard.wait(self.unheard_after_s):
                    if signal.getsignal(got[0]) != self._handle:
                        # the script set a handler of its own since: the signal went to
                        # it, and the main thread runs it (or what it started); not ours
                        # to act on (acting ended the process under the script's cleanup)
                        log.warning("signal %d went to a handler set after the "
                                    "checkpointer's: no checkpoint is saved for it (call "
                                    "ckpt.request_stop(restart=True) from that handler "
                                    "to save and exit as on a stop)", got[0])
                        continue
                    if self.on_unheard is not None and not self._quiet.is_set():
                        log.warning("signal %d was not heard by the main thread in %.0f s "
                                    "(it sits in a call that does not return)", got[0],
                                    self.unheard_after_s)
                        self.on_unheard(got[0])
                    continue
                after = self.unacted_after_s
                if after is None or self._acted.wait(max(0.0, came + after - time.monotonic())):
                    continue
                if self.on_unheard is not None:
                    log.warning("signal %d was heard but not acted on in %.0f s (the script "
                                "has been away from its training steps that long: "
                                "end-of-epoch work, a validation)", got[0], after)
                    self.on_unheard(got[0])
        finally:
            os.close(r)

    def __enter__(self) -> TerminationFlag:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


#: The flags whose watcher holds the wakeup fd now (at most one: there is one fd).
_WATCHING: weakref.WeakSet[TerminationFlag] = weakref.WeakSet()
#: The flags whose handlers are installed now.
_INSTALLED: weakref.WeakSet[TerminationFlag] = weakref.WeakSet()


#: What a DataLoader worker forked under a checkpointer takes only from its parent.
_LOADER_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def _serve_loader_signals(parent: int) -> None:
    """A loader worker's thread that takes its blocked stop signals: its parent's
    SIGTERM (the loader's shutdown, multiprocessing's ``terminate()`` at exit) ends
    it as torch's own handler does, quietly; anyone else's is dropped."""
    while True:
        try:
            info = signal.sigwaitinfo(_LOADER_SIGNALS)
        except (OSError, ValueError):  # pragma: no cover - nothing left to serve
            return
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent (the thread that forked
    it, its parent's main thread) ends (Linux's ``PR_SET_PDEATHSIG``); end now if the
    parent is gone already."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):  # not Linux: torch's watchdog only
        return
    if os.getppid() != parent:
        os._exit(0)


def _unblock_loader_signals() -> None:
    """Give the stop signals back to a process a loader worker starts: a blocked
    mask survives ``fork`` and ``exec``, and a helper it started (an ``ffmpeg``
    decoder, a pool of its own) could no longer be stopped by SIGTERM, not even by
    torchrun's ``killpg``, and outlived the job."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _LOADER_SIGNALS)


def _children_unblocked() -> None:
    """In a loader worker that blocks the stop signals: unblock them in every process
    it starts, through ``subprocess`` (``preexec_fn``, chained before the caller's
    own) and ``os.fork`` (an at-fork hook). ``os.system`` and ``os.posix_spawn`` are
    not reached."""
    import inspect
    import subprocess

    os.register_at_fork(after_in_child=_unblock_loader_signals)
    popen_init = subprocess.Popen.__init__
    params = inspect.signature(popen_init)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = params.bind(self, *args, **kwargs)
        own = bound.arguments.get("preexec_fn")

        def preexec_fn() -> None:
            _unblock_loader_signals()
            if own is not None:
                own()

        bound.arguments["preexec_fn"] = preexec_fn
        popen_init(*bound.args, **bound.kwargs)

    subprocess.Popen.__init__ = __init__  # type: ignore[method-assign]


def _quiet_loader_worker() -> None:
    """In a forked child: should it be a DataLoader worker, make it take SIGTERM,
    SIGINT and SIGHUP from its parent only, once torch set its handlers up.

    torchrun stops a worker with ``killpg``, and a scheduler may signal every process
    of the job (SLURM's ``--signal`` without ``B:``): the signal reached the
    DataLoader workers too. A worker's C-level SIGTERM handler ends it when the signal
    does not come from its parent (SIGHUP's default action and SIGINT's
    KeyboardInterrupt end it as well), and the training process's SIGCHLD handler then
    raised "DataLoader worker ... is killed by signal" wherever the training thread
    was, usually before the step where the checkpointer saves and exits: the stop's
    checkpoint was lost. So the worker blocks them and a thread of its own takes them
    (:func:`_serve_loader_signals`): its parent's SIGTERM ends it as before, and it
    still ends when its parent dies (torch's watchdog). Ignoring them outright would
    also ignore that SIGTERM, and a process exiting with live persistent workers
    would wait for them forever. Workers of a ``spawn`` or ``forkserver`` context
    start from a new interpreter and are not reached."""
    try:
        from torch.utils.data._utils import signal_handling
    except ImportError:  # not a torch this knows
        return
    original = signal_handling._set_worker_signal_handlers

    def set_handlers(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        parent = os.getppid()
        try:  # blocked before the thread starts: every thread of the worker inherits it
            _children_unblocked()
            signal.pthread_sigmask(signal.SIG_BLOCK, _LOADER_SIGNALS)
            threading.Thread(target=_serve_loader_signals, args=(parent,),
                             name="elastic-kit-loader-signals", daemon=True).start()
        except (OSError, RuntimeError, ValueError) as e:
            log.debug("a loader worker keeps torch's signal handling: %r", e)
            return out
        # It no longer dies of torchrun's signal with its parent, and it holds copies
        # of its parent's sockets (the process group's): a killed training process's
        # connections stayed open, and its peers waited in their collective, until
        # torch's watchdog noticed the parent gone (up to 5 s). Die with the parent:
        # the kernel ties that to the thread that forked, so only where that is the
        # main thread (an iterator made on a thread that then ends would lose its
        # workers; there torch's watchdog stays the only one).
        if _forked_by_main_thread:
            _die_with_parent(parent)
        return out

    signal_handling._set_worker_signal_handlers = set_handlers


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) inherits the wakeup fd, and a signal it
    gets would be written to the parent's watcher as if the parent got it: in the
    child the fd's number is pointed at /dev/null (whatever thread forked, and with no
    number left dangling) and its copy of the read end is closed."""
    for flag in list(_WATCHING):
        if flag._pipe is None:
            continue
        r, w = flag._pipe
        flag._pipe = None
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, w, inheritable=False)
            finally:
                os.close(null)
            os.close(r)
        except OSError:
            pass
    _WATCHING.clear()


#: In a forked child: whether the thread that forked it was its parent's main thread.
_forked_by_main_thread = False


def _before_fork() -> None:
    global _forked_by_main_thread
    _forked_by_main_thread = threading.current_thread() is threading.main_thread()


def _after_fork_quiet_loader_workers() -> None:
    installed = bool(_INSTALLED)
    _INSTALLED.clear()
    if installed:
        _quiet_loader_worker()


os.register_at_fork(after_in_child=_after_fork_in_child)
os.register_at_fork(before=_before_fork, after_in_child=_after_fork_quiet_loader_workers)
