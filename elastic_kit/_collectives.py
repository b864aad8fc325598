"""The library's collectives, and the rule that keeps them from aborting a worker at exit.

Deliberately few and small: the checkpoint store and the loop need "max of an int over
ranks", "sum of a tensor over ranks" and "broadcast these tensors / this small object
from rank ``src``". They all degrade to identities when no process group is
initialized. Every tensor handed to the backend is held until the backend lets go of
it (see the section at the end), so gloo's thread never frees a Python-made tensor
during interpreter shutdown. Re-exported by :mod:`elastic_kit.distributed`.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import pickle
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "EXIT_SETTLE_S",
    "is_dist_ready",
    "barrier",
    "all_reduce_max",
    "all_reduce_",
    "all_reduce_sum",
    "all_reduce_sum_async",
    "all_gather_object",
    "broadcast_object",
    "broadcast_tensors",
    "group_id",
    "collective_device",
    "hold_collective_tensor",
    "settle_collectives",
    "wait_for_ranks",
]

log = logging.getLogger(__name__)

#: The longest the exit handler waits for other threads to stop running, and for the
#: backend to let go of the library's collective tensors (seconds).
EXIT_SETTLE_S = 0.5


def is_dist_ready() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def collective_device() -> torch.device:
    """The device of the library's own collectives: the CPU unless the default group is
    NCCL; under NCCL this rank's GPU (see :func:`nccl_device_index`)."""
    if not (is_dist_ready() and dist.get_backend() == "nccl"):
        return torch.device("cpu")
    from torch.distributed.distributed_c10d import _get_default_group

    bound = getattr(_get_default_group(), "bound_device_id", None)
    local = os.environ.get("LOCAL_RANK", "")
    return torch.device("cuda", nccl_device_index(
        getattr(bound, "index", None), torch.cuda.current_device(),
        int(local) if local.isdigit() else None, torch.cuda.device_count()))


def nccl_device_index(bound: int | None, current: int, local_rank: int | None,
                      device_count: int) -> int:
    """The GPU of this rank's NCCL collectives: the one the group is bound to
    (``init_process_group(device_id=...)``); else the current device when the script
    chose one (``torch.cuda.set_device``: not device 0); else the one torchrun's
    ``LOCAL_RANK`` maps to, as :func:`elastic_kit.init_distributed` maps it. A script
    that put each rank on ``cuda:LOCAL_RANK`` without ``set_device`` has device 0
    current on every rank, and NCCL refuses two ranks of one group on one GPU."""
    if bound is not None:
        return bound
    if current != 0 or local_rank is None or device_count < 1:
        return current
    return local_rank % device_count


def barrier() -> None:
    """``dist.barrier()`` when a process group exists, else nothing."""
    if is_dist_ready():
        dist.barrier()


def all_reduce_max(value: int) -> int:
    """The maximum of an integer over all ranks (``value`` itself when alone)."""
    if not is_dist_ready():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=collective_device())
    all_reduce_(t, dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_(tensor: torch.Tensor, op: Any = None) -> None:
    """``dist.all_reduce(tensor, op)`` in place (default: sum), for tensors on the
    collective device; the tensor is held until the backend lets go of it (see
    :func:`hold_collective_tensor`). Every collective the library issues goes
    through a held path like this one."""
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, async_op=True)
    hold_collective_tensor(tensor)  # gloo's thread may drop its work item after we return
    work.wait()


def _broadcast_(tensor: torch.Tensor, src: int) -> None:
    work = dist.broadcast(tensor, src=src, async_op=True)
    hold_collective_tensor(tensor)
    work.wait()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all ranks, as a new tensor on the input's device."""
    return all_reduce_sum_async(tensor)()


def all_reduce_sum_async(tensor: torch.Tensor) -> Callable[..., torch.Tensor]:
    """Start summing ``tensor`` over all ranks; call the returned function for the sum.

    The all-reduce runs while the caller does other work (the loop issues its
    per-step flags before ``optimizer.step`` and reads them after), so a small
    collective costs no time on the critical path. The returned function (any
    thread; ``timeout``: seconds, None waits as long as the process group does, past
    it :class:`TimeoutError`, after which it may be called again) returns a new tensor
    on the input's device.

    With NCCL a CPU input travels through pinned memory both ways with
    ``non_blocking`` copies, and the result is read when an event recorded after the
    copy back has passed: starting does not block the host, and reading waits only
    for the device work queued before the sum started, not for what was queued after
    it (a plain ``.to()`` at the read would wait for all of it: up to a step of
    training that the host had queued meanwhile).
    """
    if not is_dist_ready():
        done = tensor.detach().clone()
        return lambda timeout=None: done
    device = collective_device()
    if device.type == "cuda" and tensor.device.type == "cpu":
        return _all_reduce_sum_cuda(tensor.detach(), device)
    t = tensor.detach().to(device).clone()
    work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)
    hold_collective_tensor(t)  # never freed on gloo's thread, waited for or not

    def result(timeout: float | None = None) -> torch.Tensor:
        if timeout is not None:  # polled, so a timed-out wait can be waited for again
            deadline = time.monotonic() + timeout
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"all-reduce not done within {timeout} s")
                time.sleep(0.001)
        work.wait()  # raises the collective's error, if any
        return t.to(tensor.device)

    return result


def _all_reduce_sum_cuda(tensor: torch.Tensor, device: torch.device) -> Callable[..., torch.Tensor]:
    """:func:`all_reduce_sum_async` of a CPU tensor over NCCL, without a device sync."""
    src = tensor.contiguous().pin_memory()
    t = src.to(device, non_blocking=True)
    work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)
    hold_collective_tensor(t)
    work.wait()  # NCCL: the current stream waits for the collective; the host does not
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def result(timeout: float | None = None) -> torch.Tensor:
        if timeout is None:
            done.synchronize()
        else:
            deadline = time.monotonic() + timeout
            while not done.query():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"all-reduce not done within {timeout} s")
                time.sleep(0.001)
        return host.clone()

    return result


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Broadcast a small picklable object from ``src``; every rank returns it.

    For metadata only (steps, paths, shapes): tensors go through
    :func:`broadcast_tensors` so the state is never pickled whole.
    """
    if not is_dist_ready():
        return obj
    # not dist.broadcast_object_list: its tensors are made here but not held
    dev = collective_device()
    mine = dist.get_rank() == src
    data = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    _broadcast_(size, src)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if mine
           else torch.empty(int(size.item()), dtype=torch.uint8, device=dev))
    _broadcast_(buf, src)
    return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())


# The default process group the id below was agreed in (weakly: a destroyed group is
# not kept alive for it), and the id.
_GROUP_ID: tuple[weakref.ref[Any], str] | None = None


def group_id() -> str:
    """A random id of the current default process group, the same on every rank of it
    and new for every group (``""`` without one).

    Keys a group writes into the job's key-value store are named after it: torchrun's
    shared store outlives the worker groups of a run, so a restarted group's keys
    must not meet a dead group's, and ``TORCHELASTIC_RESTART_COUNT`` cannot tell them
    apart (a restart for a joining node does not count, and a node that joined later
    counts its restarts from 0). Collective the first time in a group (rank 0's id,
    broadcast); call it where every rank does, on the training thread.
    """
    global _GROUP_ID
    if not is_dist_ready():
        return ""
    from torch.distributed.distributed_c10d import _get_default_group

    group = _get_default_group()
    if _GROUP_ID is None or _GROUP_ID[0]() is not group:
        agreed = broadcast_object(uuid.uuid4().hex if dist.get_rank() == 0 else None)
        _GROUP_ID = (weakref.ref(group), str(agreed))
    return _GROUP_ID[1]


def wait_for_ranks(key: str, ranks: Sequence[int], *,
                   give_up: Callable[[], bool] = lambda: False) -> bool:
    """Count this rank in under ``key`` in the job's key-value store, then wait until
    all of ``ranks`` have (True), or ``give_up()`` says to stop waiting (False).

    A barrier of some ranks only, which the others need not join (a process group of
    them would have to be made by every rank); through the store, so it waits on no
    collective and as long as it takes (a peer's upload). ``key`` must name this
    barrier in the whole job (see :func:`group_id`). Each rank of ``ranks`` calls it
    once. True at once without a process group.
    """
    if not is_dist_ready():
        return True
    from torch.distributed.distributed_c10d import _get_default_store

    kv = _get_default_store()
    kv.add(key, 1)
    pause = 0.002
    while int(kv.add(key, 0)) < len(ranks):
        if give_up():
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
    return True


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's small picklable ``obj``, in rank order (``[obj]`` when alone).

    For metadata only (addresses, ids). Not ``dist.all_gather_object``, whose tensors
    are made here but not held (see :func:`hold_collective_tensor`).
    """
    if not is_dist_ready():
        return [obj]
    dev = collective_device()
    data = pickle.dumps(obj)
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    _all_gather_(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=dev)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    _all_gather_(bufs, mine)
    return [pickle.loads(b[:int(n.item())].cpu().numpy().tobytes()) for b, n in zip(bufs, sizes)]


def _all_gather_(out: list[torch.Tensor], tensor: torch.Tensor) -> None:
    work = dist.all_gather(out, tensor, async_op=True)
    for t in (*out, tensor):
        hold_collective_tensor(t)
    work.wait()


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Broadcast each tensor in place from ``src``, one collective per tensor.

    Receivers must pass tensors of the same shape and dtype (allocate them from
    metadata sent with :func:`broadcast_object`). One tensor at a time keeps peak
    memory at one tensor's worth of staging, not the whole state. A broadcast copies
    bytes, so a dtype the backend cannot carry (gloo: float8, uint16, uint32, int16
    ...) travels as its bytes.
    """
    if not is_dist_ready():
        return
    dev = collective_device()
    for t in tensors:
        if t.device == dev and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            _broadcast_(_carried(t), src)
        else:
            # a conjugate or negative view (torch.save keeps the bit) is sent as its
            # values: the backend's complex path refuses an unresolved one
            staged = t.to(dev).resolve_conj().resolve_neg().contiguous()
            _broadcast_(_carried(staged), src)
            if dist.get_rank() != src:
                t.copy_(staged)


#: dtypes every backend broadcasts as they are; any other travels as its bytes (gloo
#: refuses float8, uint16 ... with "Invalid scalar type", naming no tensor)
_NATIVE_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
})


def _carried(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a dtype the backend may lack a uint8 view of its storage
    (contiguous ``t``: what the backend writes lands in ``t``)."""
    if t.dtype in _NATIVE_DTYPES:
        return t
    return t.reshape(-1).view(torch.uint8)  # reshape: a 0-d tensor has no byte view


def exchange_tensors(sends: Sequence[tuple[int, torch.Tensor]],
                     recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Point-to-point: send each ``(dst, tensor)`` and receive into each ``(src,
    tensor)``, all at once, then wait for every transfer.

    Not collective: only the ranks that send or receive call it, each pair listing
    its messages in the same order on both sides (messages between two ranks are
    matched in order). Tensors not on the collective device (CUDA for NCCL) are
    staged through it.
    """
    if not (sends or recvs):
        return
    dev = collective_device()
    ops: list[Any] = []
    staged_recvs: list[tuple[torch.Tensor, torch.Tensor]] = []
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for dst, t in sends:
        buf = t if t.device == dev and t.is_contiguous() else t.to(dev).contiguous()
        tag = sent[dst] = sent.get(dst, -1) + 1  # the n-th message to dst has tag n
        ops.append(dist.P2POp(dist.isend, buf, dst, tag=tag))
    for src, t in recvs:
        buf = t if t.device == dev and t.is_contiguous() else torch.empty(
            t.shape, dtype=t.dtype, device=dev)
        staged_recvs.append((t, buf))
        tag = received[src] = received.get(src, -1) + 1
        ops.append(dist.P2POp(dist.irecv, buf, src, tag=tag))
    works = dist.batch_isend_irecv(ops)
    for op in ops:
        hold_collective_tensor(op.tensor)
    for w in works:
        w.wait()
    for t, buf in staged_recvs:
        if buf is not t:
            t.copy_(buf)


# ------------------------------------------------ collective tensors and shutdown
# A Python-made tensor handed to a collective is also referenced by the backend's work
# item. Since torch 2.9 the C++ refcount going from 2 to 1 calls
# TensorImpl::decref_pyobject, which takes the GIL. gloo's worker thread drops its
# work item a moment after the caller saw the result (or, for a collective nobody
# waited for, whenever it ends); if that moment falls into interpreter shutdown,
# taking the GIL ends the thread inside the work item's noexcept destructor and the
# worker dies with SIGABRT ("terminate called without an active exception") after a
# successful run. So every tensor the library hands to a collective is held with a
# view of it (the view's _base is one more C++ reference: the backend's release is
# then 3 -> 2, which never needs the GIL) until its use count shows that nothing but
# the hold references it; it is then released on a Python thread.

_HOLD_POLL_S = 0.002
_held_lock = threading.Lock()
#: ``id(tensor) -> (tensor, a view of it)`` per tensor the backend may still reference.
#: One hold per tensor, however many collectives it is handed to: each hold's view is
#: one more reference, so a second hold of the same tensor would keep its use count
#: above what the release waits for, for good.
_held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
#: holds the backend kept past :func:`settle_collectives`' deadline, by ``id``: kept
#: until exit (so a pinned tensor handed to another collective needs no new hold)
_pinned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _prune_held() -> int:
    """Release the holds nothing else references any more; how many remain."""
    with _held_lock:
        # 2: the tensor's own Python object and the view's base
        for key in [k for k, (t, _) in _held.items() if t._use_count() <= 2]:
            del _held[key]
        return len(_held)


def hold_collective_tensor(tensor: torch.Tensor) -> None:
    """Keep ``tensor`` from being freed on the backend's thread: call it right after
    handing it to a collective, while the caller still holds the work item. A tensor
    already held stays held (by its first hold) until no collective references it."""
    _prune_held()
    with _held_lock:
        # the id cannot be reused while the hold keeps the tensor alive
        if id(tensor) not in _held and id(tensor) not in _pinned:
            # no_grad: a view of a parameter would otherwise reference it once more
            # through its autograd node, and never look released
            with torch.no_grad():
                _held[id(tensor)] = (tensor, tensor.view(tensor.shape))


def settle_collectives(timeout: float) -> bool:
    """Wait, at most ``timeout`` seconds, until the backend references none of the
    collective tensors the library handed it; True when it let go of all.

    Sleeps between checks, so the backend's threads can take the GIL. A collective a
    lost peer never joined is not waited for beyond ``timeout``: its tensors are
    pinned instead (referenced until the process ends, past the clearing of module
    globals at shutdown), so whenever the backend drops it, no GIL is needed.
    """
    deadline = time.monotonic() + timeout
    while _prune_held():
        if time.monotonic() >= deadline:
            with _held_lock:
                stuck = list(_held.values())
                _pinned.update(_held)
                _held.clear()
            for _, view in stuck:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(view))
            log.debug("%d collectives still referenced by the backend after %.1f s: "
                      "pinned until exit", len(stuck), timeout)
            return False
        time.sleep(_HOLD_POLL_S)
    return True


# Also for a process group the script created itself (no teardown registered): the
# last collectives settle (or are pinned) before interpreter shutdown.
atexit.register(settle_collectives, EXIT_SETTLE_S)
