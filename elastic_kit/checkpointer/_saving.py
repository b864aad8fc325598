"""Writing the state: to the durable store and to the in-memory snapshot tier.

Saves run on every rank's call but only the writer rank writes, so a failure on the
writer must reach every rank, or the others would train on believing they are
covered: :func:`agree` makes the ranks raise together.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from elastic_kit._checks import shown, type_error
from elastic_kit.checkpointer._config import DEFAULT_KEEP_LAST
from elastic_kit.distributed import (
    DistInfo, all_reduce_max, broadcast_object, group_id, is_dist_ready, wait_for_ranks,
)
from elastic_kit.errors import CheckpointError
from elastic_kit.store import CheckpointStore

if TYPE_CHECKING:
    from elastic_kit.checkpointer._store_like import StoreLike
    from elastic_kit.snapshot import SnapshotTier
    from elastic_kit.state import AuditSum
    from elastic_kit.state import TrainState

__all__ = ["NotGiven", "open_store", "metadata", "save_durable", "save_snapshot", "close_store",
           "wait_staged", "abandon", "agree"]

log = logging.getLogger(__name__)


class NotGiven:
    """The default of a store option, told apart from the same value given: only a
    store made here from a URL takes the options."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def open_store(store: StoreLike | str | os.PathLike[str] | None, info: DistInfo | None,
               **options: Any) -> tuple[StoreLike | None, bool]:
    """The store to save into, and whether it was made here (and is closed here)
    from a path or URL with ``options``.

    ``options`` configure a new store: given (not :class:`NotGiven`, not the config's
    :data:`DEFAULT_KEEP_LAST`, ``storage_options`` not None) with a store object, they
    are refused (``TypeError``) as :func:`~elastic_kit.save_checkpoint` refuses them,
    rather than dropped in silence (the object's own ``keep_last`` wins)."""
    if isinstance(store, (str, os.PathLike)):
        chosen = {k: v.value if isinstance(v, NotGiven) else v for k, v in options.items()}
        return CheckpointStore(store, info=info, **chosen), True
    if store is not None and not all(callable(getattr(store, name, None))
                                     for name in ("save", "load", "wait", "close")):
        raise type_error("store", store, "a path or URL (str), a CheckpointStore or None")
    given = sorted(k for k, v in options.items() if not (
        isinstance(v, NotGiven) or v is DEFAULT_KEEP_LAST
        or (k == "storage_options" and v is None)))
    if store is not None and given:
        raise TypeError(f"options {given} configure a new store; they cannot be applied to "
                        f"the existing {shown_store(store)}: make that store with them, or "
                        f"pass a URL")
    return store, False


def shown_store(store: Any) -> str:
    """A store as a message names it: its repr when it is a CheckpointStore (the URL
    and retention), else its type."""
    return repr(store) if isinstance(store, CheckpointStore) else shown(store)


def metadata(state: TrainState, info: DistInfo) -> dict[str, Any]:
    """What a restore compares to pick the later state, saved with every state."""
    sampler = state.sampler
    return {"epoch": int(state.epoch), "world_size": info.world_size,
            "consumed": int(sampler.consumed) if sampler is not None else None}


def save_durable(store: StoreLike, state: TrainState, info: DistInfo, *, blocking: bool,
                 overlap_staging: bool) -> None:
    """Save ``state`` at its step to ``store``; every rank raises if the writer failed."""
    kw: dict[str, Any] = {}
    if not blocking and overlap_staging and state.optimizer is not None:
        kw["copy_later"] = optimizer_tensors(state.optimizer)
    err: BaseException | None = None
    try:
        store.save(state.state_dict(), step=state.step, metadata=metadata(state, info),
                   blocking=blocking, **kw)
    except Exception as e:  # every rank must learn of it, below
        err = e
    agree(err, info, f"saving checkpoint step {state.step} to {store.url}")


def save_snapshot(tier: SnapshotTier, state_dict: dict[str, Any], state: TrainState,
                  info: DistInfo, *, overlap_staging: bool, started: float,
                  audit: AuditSum | None = None, periodic: bool = False) -> None:
    """Hand ``state_dict`` (``state``'s, taken now) to the snapshot tier (written in
    the background); ``audit``: the audit's sum in flight, which the writer thread
    waits for and writes in place of the state's audit; ``periodic``: a snapshot of
    the interval (see :meth:`SnapshotTier.save`)."""
    later = (optimizer_tensors(state.optimizer)
             if overlap_staging and state.optimizer is not None else ())
    finish = None if audit is None else functools.partial(_with_audit, audit)
    tier.save(state_dict, step=state.step, metadata=metadata(state, info),
              copy_later=later, started=started, finish=finish, periodic=periodic)


#: Seconds a snapshot's writer waits for the audit's sum over the ranks (issued with
#: the snapshot, normally done within milliseconds; past it, a peer is gone and the
#: snapshot is not written).
AUDIT_WAIT_S = 10.0


def _with_audit(audit: AuditSum, state_dict: dict[str, Any]) -> None:
    """Put the audit as of the snapshot's step into its state (writer thread)."""
    state_dict["audit"] = audit.state_dict(timeout=AUDIT_WAIT_S)


def close_store(store: StoreLike, tier: SnapshotTier | None, info: DistInfo, *,
                remove_snapshots: bool, owns_store: bool,
                staying: Sequence[int] | None = None,
                give_up: Callable[[], bool] = lambda: False) -> None:
    """Wait for the last background save and agree on it (collective), then close.

    ``staying``: a planned leave's close, and the ranks that stay. What they restore
    is the snapshots, so only these are waited for before the barrier; a durable
    save in flight is waited for after it, by the ranks writing it (its failure is
    logged there: the restart restores from memory). A leaving rank then goes (its
    notice may be shorter than a staying writer's upload); the staying ranks wait
    for one another (:func:`wait_for_ranks`, until ``give_up()``): one's exit makes
    its torchrun agent stop the node's other workers, and a writer among them would
    have its upload cut off.
    """
    err: BaseException | None = None
    if staying is None:
        try:
            store.wait()
        except Exception as e:
            err = e
    else:
        # every rank, on the training thread: the staying ranks' key names this group
        key = f"elastic_kit/leave/{group_id()}/close"
    if tier is not None:
        tier.close(remove=False)
    # also the barrier after which no rank writes a snapshot any more
    agree(err, info, f"the last background save to {store.url}")
    if staying is not None:
        try:
            store.wait()
        except Exception as e:
            log.error("the durable save in flight at the leave failed: %r", e)
        if info.rank in staying and len(staying) > 1:
            wait_for_ranks(key, staying, give_up=give_up)
    if tier is not None and remove_snapshots:
        # a leave's (on a leaving node): the nodes that stay keep theirs, on this host
        # too where several agents share one
        tier.close(remove=True, node_only=staying is not None)
    if owns_store:
        store.close()


def wait_staged(store: StoreLike | None, tier: SnapshotTier | None) -> None:
    """The optimizer-step pre-hook: the in-flight saves no longer read the parameters."""
    for writer in (store, tier):
        if writer is not None:
            writer.wait_staged()


def abandon(store: StoreLike | None, tier: SnapshotTier | None) -> None:
    """Let this rank's own writes finish without any collective (no flush to peers).
    A background sharded save that waits for a peer gives up once the peer is silent
    (a dead peer would hold the exit for the healthy group's 300 s)."""
    if store is not None:
        give_up_on_silent_peers(store)
        store.wait_local()
    if tier is not None:
        tier.close(remove=False, flush=False)


def give_up_on_silent_peers(store: StoreLike | None) -> None:
    """Let ``store``'s background sharded saves (the one in flight and later ones)
    give up a peer silent for seconds: a peer likely died (see
    :meth:`~elastic_kit.store.CheckpointStore.give_up_on_silent_peers`; a store of
    another kind has no such wait)."""
    give_up = getattr(store, "give_up_on_silent_peers", None)
    if give_up is not None:
        give_up()


def agree(err: BaseException | None, info: DistInfo, what: str) -> None:
    """Raise on every rank if ``what`` failed on any (collective when distributed).

    The other ranks raise a ``CheckpointError`` with the failed rank's error as it
    reads there: the failure may be an earlier background save's, which the writer
    raised only now, and its message names the step and the file.
    """
    if not (is_dist_ready() and info.world_size > 1):
        if err is not None:
            raise err
        return
    failed = all_reduce_max(info.rank + 1 if err is not None else 0) - 1
    if failed < 0:
        return
    said = broadcast_object(None if err is None else f"{type(err).__name__}: {err}",
                            src=failed)
    if err is not None:
        raise err
    raise CheckpointError(f"{what} failed on rank {failed}: {said}")


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors that change only in ``optimizer.step()``: parameters and optimizer state."""
    out: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
    for st in optimizer.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out
