"""``python -m elastic_kit.run``: torchrun, with slow imports done once in the agent.

Usage: ``python -m elastic_kit.run [--preload MODULE[,MODULE...]] [--rdzv-poll SECONDS]
<torchrun options> script ...``

Every torchrun option works as with ``torchrun``. Before the agent starts, this imports
``torch._dynamo`` and the ``--preload`` modules into the agent process. Why it pays
with ``--start-method=fork --run-path`` (workers forked from the agent):

- A worker's first ``optimizer.step()`` imports ``torch._dynamo`` (torch's optimizers
  check whether they are being compiled), about 1.5-3 s on a 2-core machine, after
  every restart. A forked worker inherits the agent's modules, so the import is done.
- When a forked worker dies, the agent logs the failure with its traceback, and torch's
  log formatter imports ``torch._dynamo`` to format it: 2-3 s between the failure and
  the restart, measured in the recovery benchmark, on plain ``torchrun``.
- ``--preload torchvision`` (or the script's other heavy imports) saves each forked
  worker that import too.

With torchrun's default start method (new worker processes) the agent's imports are
not inherited; the launcher then only spares the agent the failure-log import.

A restart's rendezvous ends sooner: torch's agents, waiting for each other, read the
rendezvous state once a second; this launcher's read it every 0.1 s (up to ten nodes;
``--rdzv-poll`` chooses; see :mod:`elastic_kit.health._rdzv_poll`), which takes about
a second off each restart; and a restart's round closes as soon as every node of the
last round is back (or seen dead) and no other is waiting, instead of
``last_call_timeout`` after the minimum number of nodes joined (see
:mod:`elastic_kit.health._rdzv_close`).

The agent runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless it is set: scale-up
on torch 2.13-2.14 needs it, and restarted gloo groups form reliably with it (see the
README's Launching).

The agent resumes (SIGCONT) its workers right before it sends them its death signal,
so a stopped worker exits at once instead of after torch's 30 s grace (see
:mod:`elastic_kit.health._stopped_workers`).

A node that leaves on purpose (a preemption notice) has its agent leave the
rendezvous at once, so the nodes that stay restart without waiting for its
keep-alives to lapse (see :mod:`elastic_kit.health._agent_leave`). The agent ignores
the notice signals (``$ELASTIC_KIT_PREEMPTION_SIGNALS``, default SIGUSR1): a scheduler
sends them to every process of the job step (SLURM's ``--signal=USR1``), and their
default action would kill the agent before its workers could lead the leave. Its
workers inherit that until their checkpointer's watcher catches them
(:func:`_ignore_notice_signals`).

A forked worker starts as a copy of the agent, so it is made to start as a new process
would (:func:`_worker_start`): torchrun's ``OMP_NUM_THREADS`` (set after the agent's
torch had sized its thread pool) is applied, the agent's signal handlers (torch's
SIGTERM handler, the planned leave's SIGUSR2) give way to a new process's, torch's and
numpy's global generators are reseeded (Python's ``random`` reseeds itself), and the
agent's exit handlers are dropped. The script then runs as a new process runs it
(:func:`run_script_path`): its directory first on ``sys.path``, no ``multiprocessing``
start method set yet, and the worker's own exit handlers run when the script ends
(``multiprocessing`` ends a forked child with ``os._exit``, which skips them, and a
finished worker waits there for the node's others: the process group's teardown and
the checkpointer's last snapshot of a failing script among them). Only the agent's own
children are touched: a worker's DataLoader workers, forked from it, are left alone.

Forked workers can use CUDA only if the agent never asked the CUDA runtime anything
before forking them: torchrun's launch config probes ``torch.cuda.is_available()``
(to decide on its default NUMA binding; through ``torch.accelerator`` on torch 2.14),
which calls ``cudaGetDeviceCount``; torch then marks every process forked afterwards
as a bad fork ("Cannot re-initialize CUDA in forked subprocess"), and the driver could
not be used there anyway. This launcher sets
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (unless already set): torch's documented switch
that answers availability and device counts from NVML, which leaves the process
fork-safe. The workers inherit it; where NVML cannot count the devices (no GPU, or MIG
device names), torch falls back to the CUDA runtime, and CUDA in forked workers stays
unavailable.
"""

from __future__ import annotations

import atexit
import importlib
import math
import multiprocessing.util
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from elastic_kit._agent import LAUNCHER_OPTIONS
from elastic_kit.health import (
    LEAVE_SIGNAL, RDZV_LOWEST_POLL_S as LOWEST_POLL_S, RDZV_TORCH_POLL_S as TORCH_POLL_S,
    agent_left, install_agent_leave,
    install_rendezvous_close, install_rendezvous_poll, install_resume_stopped,
    uninstall_agent_leave,
    preemption_signals, rendezvous_max_nodes as max_nodes,
    rendezvous_poll_seconds as poll_seconds,
)

__all__ = ["LauncherOptions", "main", "parse_options", "run_script_path"]

#: Imported into the agent whatever ``--preload`` says.
DEFAULT_PRELOAD = ("torch._dynamo",)
#: Set in the agent's environment unless it is set already: torch's agent then gives
#: each worker group a store of its own instead of sharing its rendezvous store.
OWN_GROUP_STORE = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

#: torch's switch for CUDA checks through NVML, which do not poison forks.
FORK_SAFE_CUDA_CHECK = ("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


@dataclass(frozen=True)
class LauncherOptions:
    """The launcher's own options, and torchrun's arguments after them.

    Attributes:
        preload: modules to import into the agent (``--preload``, in order).
        rdzv_poll_s: ``--rdzv-poll``'s seconds (None: chosen from ``--nnodes``).
        torchrun_argv: everything else, for torchrun.
    """

    preload: list[str] = field(default_factory=list)
    rdzv_poll_s: float | None = None
    torchrun_argv: list[str] = field(default_factory=list)


def _take_value(argv: list[str], opt: str, name: str, form: str) -> str:
    if opt == name:
        if not argv:
            raise ValueError(f"{name} needs a value: {name} {form}")
        return argv.pop(0)
    return opt.split("=", 1)[1]


def parse_options(argv: Sequence[str]) -> LauncherOptions:
    """The leading ``--preload`` and ``--rdzv-poll`` options, taken off torchrun's.

    Only options before the first torchrun option count, so a script's own options
    of these names are left alone.

    Raises:
        ValueError: an option without a value, an empty module name, or a poll that
            is not a number of seconds in [0.01, 1].
    """
    argv = list(argv)
    modules: list[str] = []
    poll: float | None = None
    while argv:
        opt = argv[0]
        name = opt.split("=", 1)[0]
        if name not in LAUNCHER_OPTIONS:
            break
        argv.pop(0)
        if name == "--preload":
            value = _take_value(argv, opt, name, "MODULE[,MODULE...]")
            names = [n.strip() for n in value.split(",")]
            if not all(names):
                raise ValueError(f"--preload {value!r}: expected MODULE[,MODULE...] "
                                 "(no empty names)")
            modules += names
        else:
            value = _take_value(argv, opt, name, "SECONDS")
            try:
                poll = float(value)
            except ValueError:
                poll = math.nan
            if not LOWEST_POLL_S <= poll <= TORCH_POLL_S:
                raise ValueError(f"--rdzv-poll {value!r}: expected seconds in "
                                 f"[{LOWEST_POLL_S:g}, {TORCH_POLL_S:g}]")
    return LauncherOptions(modules, poll, argv)


#: The signals whose handlers a forked worker resets to a new process's.
_RESET_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGINT")


class _WorkerStart:
    """What :func:`_worker_start` installs (a module-level object: ``multiprocessing``'s
    after-fork registry holds it weakly)."""

    agent_pid = -1


_WORKER_START = _WorkerStart()


def _worker_start() -> None:
    """Make the agent's forked workers start as new processes would (see the module):
    at the fork (``os.register_at_fork``) the thread count, signal handlers, numpy's
    generator and exit handlers; at ``multiprocessing``'s start of the child, the
    worker's own exit handlers to run when it ends. Children of other processes (a
    worker's DataLoader workers inherit both hooks) are left alone."""
    _WORKER_START.agent_pid = os.getpid()

    def at_fork() -> None:
        if os.getppid() != _WORKER_START.agent_pid:
            return
        for name in _RESET_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                signal.signal(sig, signal.default_int_handler if name == "SIGINT"
                              else signal.SIG_DFL)
        uninstall_agent_leave()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        torch = sys.modules.get("torch")
        if threads.isdigit() and int(threads) > 0 and torch is not None:
            torch.set_num_threads(int(threads))
        if torch is not None:
            # a new process seeds torch's generator from the OS: every rank, and every
            # restart, draws its own unseeded numbers (not the agent's one stream)
            torch.default_generator.seed()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        atexit._clear()  # the agent's: a spawned worker would not have them

    def at_start(_: object) -> None:
        if os.getppid() != _WORKER_START.agent_pid:
            return
        # run by multiprocessing's exit in the child, before its os._exit
        multiprocessing.util.Finalize(None, atexit._run_exitfuncs, exitpriority=0)

    os.register_at_fork(after_in_child=at_fork)
    multiprocessing.util.register_after_fork(_WORKER_START, at_start)


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """torchrun's ``run_script_path`` (the worker's entry point with ``--run-path``), run
    as a new process runs a script: the script's directory first on ``sys.path`` (a
    module next to it imports; the launch directory stays after it), no start method set in ``multiprocessing`` yet (the
    script may set one; a forked child has its parent's forced on it), and the
    worker's exit handlers run when the script ends, returns or raises (after its
    other threads ended, as in a new process), not when every
    worker of the node has ended (a forked worker that finished waits for the agent to
    collect the others' results, and a peer's failure ends it there with SIGTERM,
    which would skip them); an uncaught exception is noted as the interpreter notes it
    (``sys.last_value``) before they run. Module level: the spawn start method pickles
    the entry point."""
    import multiprocessing.context
    import runpy

    sys.argv = [training_script, *training_script_args]
    here = os.path.dirname(os.path.realpath(training_script))
    if here not in sys.path[:1]:
        # first, as a new process has it; the launch directory (``python -m``'s
        # sys.path[0]) stays after it, as under torchrun's own --run-path
        sys.path.insert(0, here)
    multiprocessing.context._default_context._actual_context = None  # type: ignore[attr-defined]
    try:
        runpy.run_path(training_script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        raise
    finally:
        # as a new process ends: threading's exit hooks (executors' shutdown), then its
        # other threads joined, then the exit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        atexit._clear()


def _ignore_notice_signals() -> dict[int, Any]:
    """Ignore the notice signals (:func:`elastic_kit.health.preemption_signals`) in the
    agent, before its workers start; the dispositions it replaced, by signal.

    A scheduler's notice (SLURM ``--signal=USR1``) reaches every process of the job
    step; the agent's part in a planned leave starts when its worker tells it, and the
    signal's default action would kill it first. An ignored disposition is inherited
    across ``fork`` and ``exec``: a worker ignores the signal until its checkpointer's
    watcher catches it, and again after the watcher's close (which restores what it
    found: the worker is finishing its leave or its exit then, and a late notice must
    not cut its last write short). Main thread only, as :func:`signal.signal`.

    Raises:
        ValueError: a bad ``$ELASTIC_KIT_PREEMPTION_SIGNALS``.
    """
    return {sig: signal.signal(sig, signal.SIG_IGN) for sig in preemption_signals()}


#: What ``--help`` prints before torchrun's own help.
USAGE = """\
usage: python -m elastic_kit.run [--preload MODULE[,MODULE...]] [--rdzv-poll SECONDS]
                                 <torchrun options> training_script ...

torchrun, with the agent's slow imports done once and a restart's rendezvous ended
sooner. The launcher's own options come first, before any of torchrun's:

  --preload MODULE[,MODULE...]
                 also import these modules into the agent before it starts (forked
                 workers, --start-method=fork, inherit them); torch._dynamo always is
  --rdzv-poll SECONDS
                 how often the agent reads the rendezvous state while it waits for the
                 other nodes, in [0.01, 1] (default: 0.1 up to ten nodes, then 0.01 per
                 node of --nnodes's maximum; torchrun reads it every second)

torchrun's options follow.
"""


def _print_help() -> NoReturn:
    """The launcher's usage, then torchrun's help (which exits 0)."""
    print(USAGE, flush=True)
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "python -m elastic_kit.run"
    parser.print_help()
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> None:
    """Import the preloads, shorten the rendezvous poll, then run torchrun's ``main``
    with the remaining arguments."""
    os.environ.setdefault(*FORK_SAFE_CUDA_CHECK)
    # each worker group gets a store of its own: on torch 2.13-2.14 a shared one hangs
    # scale-up and sometimes fails a restarted gloo group (see the README's Launching)
    os.environ.setdefault(*OWN_GROUP_STORE)
    try:
        opts = parse_options(sys.argv[1:] if argv is None else argv)
        if opts.torchrun_argv[:1] in (["-h"], ["--help"]):
            _print_help()
        poll = opts.rdzv_poll_s or poll_seconds(max_nodes(opts.torchrun_argv))
    except ValueError as e:
        print(f"python -m elastic_kit.run: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for name in (*DEFAULT_PRELOAD, *opts.preload):
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"python -m elastic_kit.run: --preload: cannot import {name!r}: {e}",
                  file=sys.stderr)
            raise SystemExit(2) from None
    import torch.distributed.run as torchrun_module
    from torch.distributed.run import main as torchrun_main

    torchrun_module.run_script_path = run_script_path  # --run-path workers' entry point

    try:
        _ignore_notice_signals()  # the notice is the workers' to act on; inherited by them
    except ValueError as e:  # the workers say so too, and train on without notices
        print(f"python -m elastic_kit.run: warning: {e}", file=sys.stderr)
    _worker_start()  # forked workers start as new processes would
    install_agent_leave()  # a planned leave takes this node out of the rendezvous at once
    install_rendezvous_poll(poll)  # a restart's rendezvous ends within a poll of its state
    install_rendezvous_close()  # ... once every node of the last round is back
    install_resume_stopped()  # a stopped worker takes its death signal at once
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        torchrun_main(opts.torchrun_argv)
    except SignalException:
        if not agent_left():
            raise
        # the SIGTERM a planned leave ends the agent with: this node's orderly end (a
        # non-zero status reads as a failed task: SLURM's --kill-on-bad-exit would
        # then end the nodes that stay)
        print("python -m elastic_kit.run: this node left the job on a notice",
              file=sys.stderr)
        raise SystemExit(0) from None


if __name__ == "__main__":
    main()
