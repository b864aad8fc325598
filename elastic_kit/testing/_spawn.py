"""Helpers for unit tests of distributed code, for this library and its users.

:func:`spawn_multi_process` runs a function on N gloo ranks on the CPU, each in its
own process, and returns what each rank returned. Tests
then assert on those values in the parent, where pytest's reporting works. The ranks
do not see the machine's GPUs unless asked (``cuda=True``), so a test written for the
CPU runs the same on a GPU workstation.

Example::

    def _shares(rank_arg):
        info = init_distributed()
        sampler = ElasticDistributedSampler(list(range(10)))
        return list(sampler)

    results = spawn_multi_process(3, _shares, None)
    assert sorted(sum(results, [])) == list(range(10)) + [...]
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import threading
import time
import traceback
from multiprocessing import forkserver
from typing import Any, Callable, TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "spawn_multi_process", "torchrun_env", "MultiProcessError"]

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago.

    Anything may take it afterwards: for a server that another process starts later,
    hold the port with :func:`reserve_port` instead.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, world_size: int, port: int, *, local_world_size: int | None = None,
                 run_id: str = "test", restart_count: int = 0,
                 agent_store: bool = False) -> dict[str, str]:
    """The environment variables torchrun gives a worker, for ``rank`` of ``world_size``.

    With ``local_world_size`` the ranks are grouped into nodes of that many workers,
    so node-local behaviour (one writer per node) can be tested in one machine.
    With ``agent_store`` a store already listens at ``127.0.0.1:port`` (as torchrun's
    agent hosts one) and every rank connects to it; otherwise rank 0 starts it there.
    """
    lws = local_world_size or world_size
    if world_size % lws:
        raise ValueError(f"world_size={world_size} is not a multiple of local_world_size={lws}")
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % lws),
        "LOCAL_WORLD_SIZE": str(lws),
        "GROUP_RANK": str(rank // lws),
        "GROUP_WORLD_SIZE": str(world_size // lws),
        "ROLE_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
    }


def _worker(rank: int, world_size: int, port: int, local_world_size: int | None, cuda: bool,
            fn: Callable[..., Any], args: tuple[Any, ...], queue: Any) -> None:
    os.environ.update(torchrun_env(rank, world_size, port, local_world_size=local_world_size,
                                   agent_store=True))
    if not cuda:
        # The forkserver these ranks come from started without GPUs (see _context);
        # this also hides them from the processes the rank starts.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    ok = False
    try:
        result = fn(*args)
        queue.put((rank, True, result))
        ok = True
    except BaseException:  # report every failure to the parent, then exit non-zero
        queue.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            if ok:
                _wait_for_every_rank(world_size)
            dist.destroy_process_group()


def _wait_for_every_rank(world_size: int, timeout_s: float = 30.0) -> None:
    """Stay until every rank's ``fn`` returned (through the store, no collective).

    A rank whose ``fn`` returns at once after ``init_distributed`` would otherwise
    exit while a peer's gloo backend is still connecting to it, and that peer fails
    with "Connection closed by peer". Bounded: a failed peer never arrives.
    """
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    try:
        kv = _get_default_store()
        if kv.add("elastic_kit/spawn/returned", 1) >= world_size:
            kv.set("elastic_kit/spawn/all", "1")
        kv.wait(["elastic_kit/spawn/all"], timedelta(seconds=timeout_s))
    except Exception:  # a peer failed or the store's host exited: nothing to wait for
        pass


def _read_reports(source: Any, sink: queue_module.Queue[tuple[int, bool, Any]],
                  world_size: int, stop: threading.Event) -> None:
    """Move the ranks' reports from the processes' queue to a thread-safe one, until
    every rank reported or ``stop`` is set. It reads only when data is there (a poll
    takes no lock), so it ends when told to; only the half report of a rank killed
    while sending it can hold it, and nothing waits for it then."""
    for _ in range(world_size):
        while source.empty():
            if stop.wait(0.01):
                return
        try:
            report = source.get()
        except Exception:  # noqa: BLE001 - a report cut short
            return
        sink.put(report)


class MultiProcessError(RuntimeError):
    """Ranks of :func:`spawn_multi_process` failed.

    The message leads with the rank that failed *first* (the others usually fail
    only because a peer went away) and its traceback; the rest follow.

    Attributes:
        failures: rank -> formatted traceback, in the order the failures arrived.
        first_rank: the rank whose failure arrived first.
    """

    def __init__(self, world_size: int, failures: dict[int, str]) -> None:
        self.failures = dict(failures)
        self.first_rank = next(iter(failures))
        parts = [f"rank {self.first_rank} of {world_size} failed:\n{failures[self.first_rank]}"]
        for rank, tb in failures.items():
            if rank != self.first_rank:
                parts.append(f"then rank {rank} failed:\n{tb}")
        super().__init__("\n".join(parts))


_CTX: Any = None
#: What the CPU ranks' forkserver imports before forking them (see :func:`_context`).
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "elastic_kit")


def _context(cuda: bool) -> Any:
    """The start method for ranks that see the GPUs (``cuda``) or do not.

    Ranks that see no GPU come from a forkserver that has imported torch and
    elastic_kit once: the ``spawn`` start method re-imports torch in every rank
    (seconds each on a small machine); a forkserver that preloaded them forks ready
    ranks in milliseconds, while still starting each rank from a clean,
    single-threaded process (unlike a plain ``fork`` of the test process, which may
    hold threads). It also preloads ``torch._dynamo`` (its import starts no thread):
    DDP's constructor and an optimizer's first ``step()`` import it, 1.5 s of CPU in
    each rank on a 2-core machine otherwise, most of a small test rank's own work (as
    ``python -m elastic_kit.run`` does for forked torchrun workers). The forkserver
    itself is started with ``CUDA_VISIBLE_DEVICES=""``: whatever its imports ask CUDA
    (a device count is cached for the process's life, and its forks inherit it), the
    answer is no GPU.

    Ranks that see the GPUs are spawned: a fresh interpreter, whose CUDA state
    nothing before it has touched.
    """
    if cuda:
        return mp.get_context("spawn")
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        _CTX = ctx
    return _CTX


def spawn_multi_process(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    local_world_size: int | None = None,
    timeout: float = 120.0,
    cuda: bool = False,
) -> list[T]:
    """Run ``fn(*args)`` on ``world_size`` CPU processes that form a gloo group.

    Each process gets the torchrun environment for its rank (see
    :func:`torchrun_env`) but no process group: ``fn`` calls
    :func:`elastic_kit.init_distributed` itself, as a real script does. ``fn`` must
    be picklable (a module-level function) and return something picklable.

    By default the ranks see no CUDA device (``CUDA_VISIBLE_DEVICES=""``): the group is
    gloo on the CPU on any machine, and tests give the same results on a GPU
    workstation as on a laptop. With ``cuda=True`` the ranks see the machine's GPUs and
    :func:`elastic_kit.init_distributed` picks NCCL when every rank of a node
    (``local_world_size``) has a GPU of its own, gloo on the CPU otherwise.

    Returns:
        The list of return values, indexed by rank.

    Raises:
        MultiProcessError: (a ``RuntimeError``) when ranks fail; it names the rank
            that failed first and carries every failed rank's traceback.
        RuntimeError: when the group does not finish within ``timeout`` seconds or a
            rank exits without reporting (killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = _context(cuda)
    queue = ctx.SimpleQueue()
    # The group's store listens before any rank starts, on a port the kernel gave it,
    # as torchrun's agent hosts it: a port chosen free and bound later by rank 0 can
    # be taken in between (another test's group, in a parallel worker), and a rank
    # would then join whatever listens there.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = int(store.port)
    procs = [
        ctx.Process(target=_worker,
                    args=(r, world_size, port, local_world_size, cuda, fn, args, queue),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    # The ranks' reports are read on a daemon thread: a rank killed half way through
    # sending its report leaves half a message in the pipe, on which a read blocks for
    # good (and it dies holding the queue's write lock, which every later put() waits
    # for); the thread may then hang, this function does not.
    reports: queue_module.Queue[tuple[int, bool, Any]] = queue_module.Queue()
    stop_reading = threading.Event()
    threading.Thread(target=_read_reports, args=(queue, reports, world_size, stop_reading),
                     daemon=True, name="elastic_kit-spawn-reports").start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}

    def take(wait_s: float) -> bool:
        try:
            rank, ok, value = reports.get(timeout=wait_s)
        except queue_module.Empty:
            return False
        (results if ok else failures)[rank] = value
        return True

    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    try:
        while len(results) + len(failures) < world_size:
            if take(0.02):
                if failures and failed_at is None:
                    failed_at = time.monotonic()
                continue
            now = time.monotonic()
            # After one rank fails the others may block in a collective: give them
            # a moment to report, then stop waiting.
            if failed_at is not None and now - failed_at > 3.0:
                break
            unreported = [r for r, p in enumerate(procs)
                          if p.exitcode not in (None, 0) and r not in results and r not in failures]
            if unreported and failed_at is None:
                failed_at = now
            if now > deadline:
                raise RuntimeError(
                    f"spawn_multi_process: only ranks {sorted(results)} of {world_size} "
                    f"finished within {timeout}s"
                )
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store
        # A rank that reported while the others were being joined (a survivor slower
        # than the grace above, on a loaded machine): every rank has exited, so what it
        # sent is in the pipe whole and the reader hands it over at once.
        while len(results) + len(failures) < world_size and take(0.5):
            pass
        # (no put() to wake the reader: a rank killed while sending its report died
        # holding the queue's write lock)
        stop_reading.set()
    if failures:
        raise MultiProcessError(world_size, failures)
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        codes = {r: procs[r].exitcode for r in missing}
        raise RuntimeError(f"ranks {missing} exited without a result (exit codes {codes})")
    return [results[r] for r in range(world_size)]
