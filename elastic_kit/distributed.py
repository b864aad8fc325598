"""Process-group setup, DDP wrapping and the few collectives the library needs.

Everything here reads the environment that ``torchrun`` gives each worker, so a
script calls :func:`init_distributed` once and never parses ``RANK`` itself. A plain
``python train.py`` (no torchrun) is world size 1 and creates no process group, so
the same script runs on a laptop without a rendezvous.

The collectives (in :mod:`elastic_kit._collectives`, re-exported here) are few and
small, and degrade to identities when no process group is initialized.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import gc
import inspect
import io
import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_kit._checks import type_error
from elastic_kit._collectives import (
    EXIT_SETTLE_S, all_gather_object, all_reduce_, all_reduce_max, all_reduce_sum, all_reduce_sum_async, barrier,
    broadcast_object, broadcast_tensors, collective_device, exchange_tensors, group_id,
    hold_collective_tensor, is_dist_ready, settle_collectives, wait_for_ranks,
)

__all__ = [
    "DistInfo",
    "init_distributed",
    "get_dist_info",
    "destroy_distributed",
    "wrap_ddp",
    "unwrap_model",
    "averages_gradients",
    "is_dist_ready",
    "barrier",
    "all_reduce_max",
    "all_reduce_sum",
    "all_reduce_sum_async",
    "all_reduce_",
    "hold_collective_tensor",
    "settle_collectives",
    "all_gather_object",
    "broadcast_object",
    "group_id",
    "collective_device",
    "wait_for_ranks",
    "side_channel_host",
    "unreachable",
    "SIDE_CHANNEL_ADDR_ENV",
    "broadcast_tensors",
    "exchange_tensors",
    "DEFAULT_TIMEOUT",
]

log = logging.getLogger(__name__)

#: Collective timeout used by :func:`init_distributed`. torch's default is 30 minutes,
#: which means a worker whose peer was SIGKILLed waits half an hour before torchrun
#: notices anything. Two minutes is long enough for a slow checkpoint barrier on a
#: CPU and short enough that a dead peer turns into a restart quickly.
DEFAULT_TIMEOUT = timedelta(seconds=120)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from e


@dataclass(frozen=True)
class DistInfo:
    """Where this worker sits in the (possibly resized) job.

    Attributes:
        rank: global rank in ``[0, world_size)``.
        local_rank: rank on this node (selects the CUDA device).
        world_size: number of workers in the current worker group.
        local_world_size: workers on this node.
        node_rank: torchrun's ``GROUP_RANK``; one agent is one node.
        num_nodes: torchrun's ``GROUP_WORLD_SIZE``.
        restart_count: ``TORCHELASTIC_RESTART_COUNT``: how often the group was restarted.
        max_restarts: ``TORCHELASTIC_MAX_RESTARTS``.
        run_id: ``TORCHELASTIC_RUN_ID`` (``"local"`` without torchrun).
        backend: the process-group backend (``""`` when none is initialized).
        device: the device this worker computes on.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "local"
    backend: str = ""
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank that prints and writes shared files."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0: one per node, the writer of node-local files."""
        return self.local_rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when a process group is initialized (even of size 1)."""
        return bool(self.backend)

    @property
    def under_torchrun(self) -> bool:
        """True when torch.distributed.elastic launched this process."""
        return "TORCHELASTIC_RUN_ID" in os.environ


def _device_for(local_rank: int, backend: str) -> torch.device:
    """The device a worker computes on: its own GPU under NCCL; without a process group
    the GPU :func:`_choose_backend` would give it; the CPU otherwise."""
    if backend == "":
        backend = _choose_backend(
            None, local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
            device_count=_cuda_device_count(),
        )[0]
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def _cuda_device_count() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _choose_backend(
    requested: str | None, *, local_world_size: int, device_count: int
) -> tuple[str, str]:
    """``(backend, why)``: the process-group backend for a worker, and the reason.

    NCCL needs a GPU of its own for every rank: two ranks on one device fail at their
    first collective with NCCL's "invalid usage". So without a requested backend, NCCL
    is chosen only when every local rank of this node (``LOCAL_WORLD_SIZE``) gets its
    own device, and gloo on the CPU otherwise: a GPU workstation still runs a job, or a
    test, with more ranks than GPUs.

    Args:
        requested: ``"nccl"``, ``"gloo"``, another backend name, or None to choose.
        local_world_size: workers on this node.
        device_count: CUDA devices visible to this worker (0 without CUDA).

    Raises:
        ValueError: ``requested="nccl"`` with fewer devices than local ranks.
    """
    if requested == "nccl" and local_world_size > device_count:
        ranks = f"local ranks 0-{local_world_size - 1}" if local_world_size > 1 else "local rank 0"
        raise ValueError(
            f"backend='nccl' needs one CUDA device per local rank, but {ranks} "
            f"(LOCAL_WORLD_SIZE={local_world_size}) would share {device_count} visible "
            f"CUDA device(s); use backend='gloo' or None, or run at most {device_count} "
            f"rank(s) per node")
    if requested is not None:
        return requested, f"backend={requested!r} was requested"
    if device_count == 0:
        return "gloo", "CUDA is not available"
    if local_world_size > device_count:
        return "gloo", (
            f"LOCAL_WORLD_SIZE={local_world_size} ranks on this node but only "
            f"{device_count} CUDA device(s): NCCL needs one device per rank, so the ranks "
            f"use gloo on the CPU")
    return "nccl", (f"{device_count} CUDA device(s) for LOCAL_WORLD_SIZE={local_world_size} "
                    f"ranks: one device per rank")


def get_dist_info() -> DistInfo:
    """Describe this worker from the environment and the current process group.

    Does not create a process group; usable before or after :func:`init_distributed`.
    """
    backend = dist.get_backend() if is_dist_ready() else ""
    if is_dist_ready():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    return DistInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        node_rank=_env_int("GROUP_RANK", 0),
        num_nodes=_env_int("GROUP_WORLD_SIZE", 1),
        restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_env_int("TORCHELASTIC_MAX_RESTARTS", 0),
        run_id=os.environ.get("TORCHELASTIC_RUN_ID", "local"),
        backend=str(backend) if backend else "",
        device=_device_for(local_rank, str(backend) if backend else ""),
    )


def init_distributed(
    *, backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT
) -> DistInfo:
    """Join the worker group that torchrun set up, or run alone.

    Args:
        backend: ``"nccl"``, ``"gloo"`` or ``None`` to choose: nccl when every local
            rank (``LOCAL_WORLD_SIZE``) can have a CUDA device of its own, gloo on the
            CPU otherwise, with a log line saying why (see :func:`_choose_backend`).
        timeout: collective timeout. Keep it short: it is how long survivors wait on
            a dead peer before failing and letting torchrun restart the group.

    Returns:
        The :class:`DistInfo` of this worker. With ``WORLD_SIZE`` unset or 1 and no
        ``MASTER_ADDR`` no process group is created and world size is 1.
        A process group it creates is destroyed at exit (an ``atexit`` handler), before
        interpreter shutdown, when the script has not done so itself; the handler then
        waits, at most :data:`EXIT_SETTLE_S`, for the backend's threads to go idle.

    Raises:
        TypeError: ``timeout`` is not a :class:`datetime.timedelta` (a number of
            seconds would otherwise reach torch only once a process group is made).
        ValueError: ``timeout`` is not positive, an unknown backend, or
            ``backend="nccl"`` without a CUDA device for every local rank (rather
            than NCCL's "invalid usage" at the first collective).

    .. warning:: ``LOCAL_WORLD_SIZE`` counts the ranks of one torchrun agent. Several
        agents on one host (a test cluster) must each see their own devices
        (``CUDA_VISIBLE_DEVICES``), or none.

    Example::

        info = init_distributed()
        model = wrap_ddp(MyModel())
        if info.is_main:
            print("training on", info.world_size, "workers")
    """
    # checked before anything else: a run alone (no process group) never hands the
    # timeout to torch, so a wrong one would pass until the job runs on two nodes
    if not isinstance(timeout, timedelta):
        raise type_error("timeout", timeout, "a datetime.timedelta, e.g. "
                                             "timedelta(minutes=5)")
    if timeout <= timedelta(0):
        raise ValueError(f"timeout={timeout.total_seconds():g} s: expected a positive "
                         f"datetime.timedelta")
    if backend is not None and not isinstance(backend, str):
        raise type_error("backend", backend, "None or one of 'nccl', 'gloo', 'mpi', 'ucc'")
    if backend is not None and backend not in ("nccl", "gloo", "mpi", "ucc"):
        raise ValueError(f"backend={backend!r} is not one of 'nccl', 'gloo', 'mpi', 'ucc'")
    if is_dist_ready():
        return get_dist_info()
    world = _env_int("WORLD_SIZE", 1)
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world} must be >= 1")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False")
    requested = backend
    backend, why = _choose_backend(
        requested, local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        device_count=_cuda_device_count(),
    )
    if requested is None and backend == "gloo" and torch.cuda.is_available():
        # a GPU job that silently trains through gloo on the CPU is slow by 10x or more:
        # said once per node, where a person looks (every local rank decides alike)
        log.log(logging.WARNING if _env_int("LOCAL_RANK", 0) == 0 else logging.DEBUG,
                "process-group backend gloo, not nccl: %s", why)
    else:
        log.debug("process-group backend %s: %s", backend, why)
    local_rank = _env_int("LOCAL_RANK", 0)
    if backend == "nccl":
        torch.cuda.set_device(_device_for(local_rank, backend))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        info = get_dist_info()
        log.debug("world size 1 without a rendezvous: no process group")
        return DistInfo(**{**info.__dict__, "device": _device_for(local_rank, backend)})
    if _env_int("RANK", 0) != 0:
        _wait_for_master_store(min(timeout.total_seconds(), MASTER_STORE_WAIT_S))
    dist.init_process_group(backend=backend, timeout=timeout)
    _register_exit_teardown()
    group_id()  # agreed now, where every rank is: later uses need no collective
    info = get_dist_info()
    log.info(
        "joined process group: rank %d/%d (node %d/%d, local rank %d), backend %s, "
        "restart %d, run %s",
        info.rank, info.world_size, info.node_rank, info.num_nodes, info.local_rank,
        info.backend, info.restart_count, info.run_id,
    )
    if info.is_main and info.restart_count == 0:
        _warn_shared_agent_store(info)
    return info


def _warn_shared_agent_store(info: DistInfo) -> None:
    """Say once (rank 0, first start) when torchrun shares its rendezvous store with
    the workers while it may restart them: a restarted gloo group
    then sometimes fails to form, or hangs, on the dead group's addresses, and a
    joining node's round hangs on torch 2.13-2.14. The agents' environment decides
    it; the workers inherit it, so they can tell."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or info.max_restarts == 0:
        return
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        # set (by the user, or by python -m elastic_kit.run), and shared all the same:
        # a static rendezvous, which always shares its store
        log.warning("torchrun shares its rendezvous store with the workers although "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: its static rendezvous "
                    "(--master-addr/--master-port, or neither, without --rdzv-backend) "
                    "always does; with --max-restarts=%d a restarted group may fail to "
                    "form or hang on the previous group's addresses; launch with a "
                    "rendezvous backend: --rdzv-backend=c10d (or --standalone on one "
                    "node)", info.max_restarts)
        return
    log.warning("torchrun shares its rendezvous store with the workers "
                "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE is not 1 in the agents' environment): "
                "with --max-restarts=%d a restarted group may fail to form or hang on the "
                "previous group's addresses, and a node joining the job may hang its round; "
                "start every agent with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (and a "
                "rendezvous backend: --rdzv-backend=c10d or --standalone; a static one, "
                "--master-addr/--master-port alone, always shares its store)",
                info.max_restarts)


#: The longest a rank other than 0 polls for rank 0's store before joining the group.
MASTER_STORE_WAIT_S = 30.0
#: The first and the longest pause between two of those polls.
_POLL_FIRST_S, _POLL_MAX_S = 0.002, 0.05


def _wait_for_master_store(budget_s: float) -> bool:
    """Wait (at most ``budget_s``) until ``MASTER_ADDR:MASTER_PORT`` accepts a TCP
    connection, polling every few milliseconds; whether it did (also True without
    ``MASTER_ADDR`` or a numeric ``MASTER_PORT``: nothing to wait for, or torch's
    own attempt says what is wrong).

    Why. The ranks of a new group start together, and rank 0 makes the group's store
    as it joins: the other ranks' first connection usually finds no listener. torch's
    store client then retries after a back-off (0.2-0.7 s measured on the 2-core test
    machine when the store came up 20-500 ms after the first try), which every
    restart paid, most of a forked worker's start. A refused connection costs a few
    microseconds, so polling at first every 2 ms (then up to every 50 ms, so a large
    group's ranks do not flood rank 0's host) lets the client's own first try succeed.
    The probe's connection is closed unused (the store drops it as a client that said
    nothing). Past the budget, torch's own attempt decides as before."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not port.isdigit():
        return True  # torch's own attempt names what is wrong
    deadline = time.monotonic() + budget_s
    pause = _POLL_FIRST_S
    while True:
        try:
            socket.create_connection((addr, int(port)), timeout=1.0).close()
            return True
        except OSError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            log.debug("rank 0's store at %s:%s did not answer within %.0f s", addr, port,
                      budget_s)
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, _POLL_MAX_S)


_exit_hook_registered = False


def _register_exit_teardown() -> None:
    """Destroy the process group before the interpreter starts shutting down (once).

    A worker often exits with its process group still alive: on an exception after a
    peer died, or with ``SystemExit`` after a SIGTERM checkpoint. The backend's own
    threads may then still hold the last reference to a collective's tensors (gloo's
    worker thread releases a finished or failed work item a moment after the caller
    saw its result). Releasing a tensor that Python created needs the GIL, and a
    thread that asks for the GIL once interpreter shutdown has begun is ended by
    CPython with ``pthread_exit``; unwinding that through the work item's (noexcept)
    destructor calls ``std::terminate``: the worker dies with SIGABRT ("terminate
    called without an active exception") instead of its real exit status. ``atexit``
    handlers run before that shutdown, while those threads can still take the GIL, so
    tearing the process group down there lets them finish first.

    Destroying the group is not always enough: a script may have destroyed it itself
    while DDP still holds the backend, whose threads then live on into shutdown, and
    on a loaded machine a backend thread may not yet have been scheduled to release
    its last work item. The handler therefore also waits (at most
    :data:`EXIT_SETTLE_S`, with the GIL released) until no other thread of the process
    is running.

    Last, it spares the interpreter's shutdown its garbage collections of the objects
    that exist then (:func:`_spare_exit_collections`): with torch (and
    ``torch._dynamo``, which DDP and the optimizers import) that is over 300,000
    objects, about 0.9 s of a worker's exit on the 2-core test machine (1.15 s ->
    0.27 s), which every restart waits for (torchrun re-forms the group once every
    worker of the old one exited).
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_teardown_at_exit, os.getpid())
        _exit_hook_registered = True


def _teardown_at_exit(owner: int) -> None:
    """Let the library's collectives finish, destroy the process group (if the script
    has not), let threads settle, then spare the shutdown's collections the objects
    that exist (see :func:`_register_exit_teardown`). Nothing in a child the script
    forked (``os.fork``, then ``sys.exit``): the group is the parent's."""
    if os.getpid() != owner:
        return
    settle_collectives(EXIT_SETTLE_S)
    try:
        destroy_distributed()
    except Exception as e:  # the process is exiting anyway: keep its own exit status
        log.debug("destroying the process group at exit failed: %r", e)
    _let_threads_settle(EXIT_SETTLE_S)
    _spare_exit_collections()


_OPEN_FILE_TYPES = (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


def _spare_exit_collections() -> None:
    """Flush every open file, then move every object into the collector's permanent
    generation (``gc.freeze()``), which the shutdown's collections do not walk.

    What that gives up: a reference cycle that exists then is no longer collected at
    exit, so its objects' ``__del__`` methods do not run (Python never promised they
    would). A buffered file in such a cycle would lose what it had not written, which
    is why every open file is flushed first (one walk of the objects, about a tenth of
    what the collections cost)."""
    for obj in gc.get_objects():
        if type(obj) in _OPEN_FILE_TYPES:
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # a file that cannot flush now would not have at exit either
                pass
    gc.freeze()


_SETTLE_POLL_S = 0.002


def _let_threads_settle(timeout: float) -> bool:
    """Sleep (the GIL released) until no other thread of this process is running or
    waiting to run, for at most ``timeout`` seconds; True when they settled.

    A thread that waits for the GIL gets it while this one sleeps; one that runs
    native code without it shows as running in ``/proc/self/task``. Where that is not
    readable, only the first short sleep happens.
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    while True:
        time.sleep(_SETTLE_POLL_S)
        busy = _other_threads_running()
        if busy is None:
            return False
        quiet = 0 if busy else quiet + 1
        if quiet >= 2:
            return True
        if time.monotonic() >= deadline:
            log.debug("threads still running at exit after %.1f s", timeout)
            return False


def _other_threads_running() -> bool | None:
    """Whether a thread other than the calling one is running or runnable (None: the
    kernel does not say)."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        if tid == str(me):
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it just ended
            continue
        end = stat.rfind(b")")  # the name may contain anything; the state follows it
        if stat[end + 2:end + 3] in (b"R", b"D"):
            return True
    return False


def destroy_distributed() -> None:
    """Tear down the default process group if there is one (idempotent)."""
    if is_dist_ready():
        dist.destroy_process_group()


def _check_ddp_options(options: dict[str, Any]) -> None:
    """Refuse a keyword DistributedDataParallel does not take (``find_unused_parameter``
    for ``find_unused_parameters``), whether or not a DDP is then made."""
    try:
        params = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    except (TypeError, ValueError):  # no signature to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    takes = [name for name, p in params.items() if name not in ("self", "module") and p.kind
             in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        near = {name: difflib.get_close_matches(name, takes, n=1) for name in unknown}
        hints = "".join(f"; did you mean {m[0]!r} for {name!r}?" for name, m in near.items() if m)
        raise TypeError(f"wrap_ddp() got option(s) {unknown} that DistributedDataParallel "
                        f"does not take{hints} (its options: {', '.join(takes)})")


def wrap_ddp(
    model: nn.Module,
    *,
    sync_batchnorm: bool = False,
    info: DistInfo | None = None,
    **ddp_options: Any,
) -> nn.Module:
    """Move ``model`` to this worker's device and wrap it in DistributedDataParallel.

    ``device_ids`` is set on CUDA and left out on CPU, as DDP requires. Without a
    process group the model is only moved, so ``model(x)`` and ``model.parameters()``
    behave the same, and given a ``no_sync()`` that does nothing (where it has none),
    so a gradient-accumulation loop written for DDP runs as ``python train.py`` too;
    use :func:`unwrap_model` to reach the plain module either way.

    Args:
        model: the module to train.
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm first. SyncBatchNorm
            runs on GPUs only: on a CPU worker (gloo) a model with BatchNorm layers
            is refused (:class:`ValueError`) rather than trained with per-rank
            statistics the script did not ask for; pass
            ``sync_batchnorm=info.device.type == "cuda"`` to run the same script on
            both. Without a process group (world size 1) there is nothing to
            synchronize and the layers stay as they are.
        info: the worker's :class:`DistInfo` (read from the environment when None).
        **ddp_options: passed to :class:`~torch.nn.parallel.DistributedDataParallel`.

    Raises:
        TypeError: ``model`` is no ``nn.Module``, ``info`` no :class:`DistInfo`, or a
            keyword is not one of DistributedDataParallel's (checked without a process
            group too, so a misspelt option fails on the laptop, not on the cluster).
        ValueError: ``sync_batchnorm=True`` for a model with BatchNorm layers on a
            CPU worker.
    """
    if not isinstance(model, nn.Module):
        raise type_error("model", model, "a torch.nn.Module")
    if info is not None and not isinstance(info, DistInfo):
        raise type_error("info", info, "None or an ek.DistInfo")
    if not isinstance(sync_batchnorm, bool):
        raise type_error("sync_batchnorm", sync_batchnorm, "True or False")
    _check_ddp_options(ddp_options)
    info = info or get_dist_info()
    model = model.to(info.device)
    if not is_dist_ready():
        if not hasattr(model, "no_sync"):
            model.no_sync = contextlib.nullcontext  # type: ignore[assignment]
        return model
    if sync_batchnorm:
        if info.device.type == "cpu" and any(
                isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise ValueError(
                f"wrap_ddp(sync_batchnorm=True) on device {info.device}: SyncBatchNorm "
                "runs only on GPUs, and DistributedDataParallel refuses it on the CPU; "
                "pass sync_batchnorm=False (each rank keeps its own BatchNorm "
                "statistics) or run on CUDA")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if info.device.type == "cuda":
        ddp_options.setdefault("device_ids", [info.device.index])
        ddp_options.setdefault("output_device", info.device.index)
    return nn.parallel.DistributedDataParallel(model, **ddp_options)


def averages_gradients(model: nn.Module) -> bool:
    """Whether ``model`` averages its gradients over the ranks in ``backward()``: DDP
    (and FSDP's) ``no_sync``, FSDP2's ``set_requires_gradient_sync``; not the
    ``no_sync`` that :func:`wrap_ddp` gives a module when there is no process group."""
    no_sync = getattr(model, "no_sync", None)
    return ((no_sync is not None and no_sync is not contextlib.nullcontext)
            or hasattr(model, "set_requires_gradient_sync"))


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside DDP, DataParallel and ``torch.compile`` wrappers (nested
    in any order). Any other module is the model itself, whatever its attributes are
    called: a user's own submodule named ``module`` is part of the model, and saving
    only it would drop the rest."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod
        else:
            return model


def _is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is ``torch.compile``'s wrapper (its class is looked at, so that
    asking never imports ``torch._dynamo``)."""
    cls = type(model)
    return (cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")
            and isinstance(getattr(model, "_orig_mod", None), nn.Module))


#: Environment variable naming the address this node's side channels (the snapshot
#: replicas, the heartbeats) listen on.
SIDE_CHANNEL_ADDR_ENV = "ELASTIC_KIT_SNAPSHOT_ADDR"


def side_channel_host() -> str:
    """The address this node's side channels listen on: ``$ELASTIC_KIT_SNAPSHOT_ADDR``,
    else the local address of the route to ``MASTER_ADDR`` (the interface the process
    group already uses), else the host name's address."""
    given = os.environ.get(SIDE_CHANNEL_ADDR_ENV)
    if given:
        return given
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT") or 29500)))  # no packet
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def unreachable(addresses: list[str]) -> str | None:
    """Why peers on other nodes could not reach one of ``addresses`` (the side
    channels' advertised hosts, one per rank), or None: a wildcard address, or a
    loopback address beside addresses that are not (every node on one host may use
    loopback). Host names are not judged."""
    ips = []
    for host in addresses:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            continue
        if ip.is_unspecified:
            return f"{host} is a wildcard address, which no peer can connect to"
        ips.append(ip)
    loop = [ip for ip in ips if ip.is_loopback]
    if loop and len(loop) < len(ips):
        other = next(ip for ip in ips if not ip.is_loopback)
        return (f"a node advertises the loopback address {loop[0]} while another advertises "
                f"{other} (its host name resolves to loopback, as /etc/hosts does on "
                f"Debian): set $ELASTIC_KIT_SNAPSHOT_ADDR to each node's address on the "
                f"network the nodes share")
    return None
