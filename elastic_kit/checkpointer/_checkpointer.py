"""Checkpointer: make a training script that keeps its own loop resumable, exactly.

Most scripts keep their own loop (torchvision's classification reference, the
pytorch/elastic ImageNet example, a team's ``train.py``). :class:`Checkpointer` adds
what an elastic restart needs to such a loop with a handful of lines, and nothing
else about the loop changes::

    state = ek.TrainState(model, optimizer, scheduler=sched, scaler=scaler,
                          sampler=sampler, extras={"ema": ema_model})
    ckpt = ek.Checkpointer(state, "s3://bucket/run", every_steps=200)
    for epoch in range(ckpt.restore(), epochs):   # collective: newest state, epoch to start
        sampler.set_epoch(epoch)                  # keeps a restored mid-epoch position
        for x, y in loader:                       # yields only what the epoch has left
            ...forward, backward, optimizer.step()...
            ckpt.step(len(x))                     # saves when due; SIGTERM: save and exit
        ckpt.end_epoch()
    ckpt.close()

How the position is kept: the :class:`~elastic_kit.ElasticDistributedSampler` deals
each rank a strided share of the rest of the epoch's permutation, padded to equal
length, so every rank's ``k``-th batch of ``n`` samples is the contiguous global chunk
``rem[k*n*W:(k+1)*n*W]`` and only the epoch's very last step holds padding. A
step therefore consumed ``min(n * W, samples left in the pass)`` real samples
globally, which every rank computes alone: :meth:`Checkpointer.step` needs no
collective to advance the sampler. Saves run on every rank's call but only the
writer rank writes; the ranks then agree that the write succeeded.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol

import torch

from elastic_kit.store import CheckpointStore, LoadedCheckpoint
from elastic_kit.distributed import (
    DistInfo, all_reduce_max, all_reduce_sum_async, get_dist_info, is_dist_ready,
    settle_collectives,
)
from elastic_kit.errors import CheckpointError, SampleAuditError
from elastic_kit._console import say
from elastic_kit.state import EpochAudit, TerminationFlag
from elastic_kit.checkpointer._config import CheckpointerConfig
from elastic_kit.snapshot import DEFAULT_BUDGET, SnapshotTier, agree_run_identity

if TYPE_CHECKING:
    from elastic_kit.state import TrainState

__all__ = ["Checkpointer", "StoreLike"]

log = logging.getLogger(__name__)

class StoreLike(Protocol):
    """What a checkpointer (and :class:`~elastic_kit.ElasticLoop`) needs of a store.

    :class:`~elastic_kit.CheckpointStore` is the implementation; tests and benchmarks
    wrap it (to count or time saves) by providing these methods.
    """

    url: str

    def load(self, *, map_location: Any = None) -> LoadedCheckpoint | None: ...

    def save(self, state_dict: dict[str, Any], *, step: int,
             metadata: dict[str, Any] | None = None, blocking: bool = True,
             copy_later: Iterable[torch.Tensor] = ()) -> None: ...

    def wait(self) -> None: ...

    def wait_local(self) -> None: ...

    def wait_staged(self) -> None: ...

    def close(self) -> None: ...


#: Seconds of training between two exchanges of the ranks' flags (see
#: :meth:`Checkpointer._poll_flags`), and the most steps between two.
EXCHANGE_PERIOD_S = 0.2
MAX_EXCHANGE_EVERY = 64
_NO_FLAGS = (0.0, 0.0, 0.0, 0.0)
#: Seconds :meth:`Checkpointer.abandon` gives an exchange in flight to finish.
ABANDON_SETTLE_S = 1.0

_TIER_NAMES = {"memory": "this node's memory", "peer": "a peer node's memory",
               "store": "the checkpoint store", None: "nowhere"}


class Checkpointer:
    """Resume a script's own training loop mid-epoch, exactly, at any world size.

    Args:
        state: the :class:`~elastic_kit.TrainState` to save and restore. Its
            ``sampler`` should be the :class:`~elastic_kit.ElasticDistributedSampler`
            the loader iterates: the checkpointer advances it after every step.
            Without one, a restart resumes at the start of the saved epoch.
        store: a :class:`~elastic_kit.CheckpointStore`, a path or fsspec URL (a store
            is made, with ``keep_last``, ``node_local`` and ``storage_options``), or
            ``None`` (no checkpoints; steps, audit and SIGTERM handling still work).
        every_steps: save every this many optimizer steps.
        every_seconds: save when this long has passed since the last save (rank 0's
            clock decides, so all ranks agree).
        keep_last: checkpoints a store made from a URL keeps.
        blocking: make the periodic saves synchronous. Non-blocking saves (default)
            copy the state and write it on a background thread; SIGTERM saves are
            always synchronous.
        save_at_epoch_end: save in :meth:`end_epoch`.
        audit: ``False``/``"off"`` (default), ``True``/``"error"`` (raise
            :class:`~elastic_kit.SampleAuditError` at the end of an epoch that missed or
            repeated a sample) or ``"warn"``. The audit keeps, per epoch, a count and
            an order-independent digest of the sample ids the sampler dealt to each
            completed step, summed over ranks and saved in every checkpoint.
        overlap_staging: a non-blocking save copies the parameters and optimizer
            state on the save thread while the next forward and backward run; the
            copy is waited for in a pre-hook of ``optimizer.step()``, the only place
            they change. Turn off if the script changes parameters in place outside
            ``optimizer.step()``.
        handle_signals: catch SIGTERM (torchrun's restart notice): a :meth:`step`
            soon after (every rank at the same one, within about 0.4 s of training:
            see :meth:`_poll_flags`; at the latest :meth:`end_epoch`) saves
            synchronously and raises ``SystemExit(exit_code)``.
        exit_code: the exit status after a SIGTERM save (non-zero, so torchrun
            restarts the group instead of reporting success).
        node_local / storage_options: passed to the store made from a URL.
        snapshot_every: in-memory snapshots (see :mod:`elastic_kit.snapshot`): the full
            state in node-local shared memory every this many steps, which survives
            a torchrun group restart, so a restart redoes only the steps since the
            newest snapshot instead of everything since the last durable save.
            ``"auto"``: on under torchrun, with the interval chosen to cost at most
            ``snapshot_budget`` of the training time (the default); an int: every
            that many steps; ``0`` or ``None``: off. Needs a store. Outside torchrun
            nothing restarts the workers, so ``"auto"`` is off there.
        snapshot_budget: the share of training time automatic snapshots may cost
            (1%: Young's optimal interval for a 0.5 s snapshot and a failure every
            ~40 minutes; more buys back only seconds of redone work per failure).
        info: this worker's :class:`~elastic_kit.DistInfo`; read from the environment
            and process group by :meth:`restore` when None.

    Attributes:
        loaded: the :class:`~elastic_kit.LoadedCheckpoint` :meth:`restore` loaded, or None.
        restored_step: its step, or None.
        info: this worker's :class:`~elastic_kit.DistInfo` (set by :meth:`restore`).

    .. warning::
        :meth:`restore`, :meth:`step`, :meth:`end_epoch`, :meth:`save` and
        :meth:`close` are collective: call them on every rank at the same points
        (they are, in a loop that every rank runs). ``n`` in :meth:`step` must be the
        same on every rank, which a ``DataLoader`` over the sampler gives (the
        sampler pads every rank's share to the same length); use
        ``drop_last=False`` in the loader, or the epoch's tail is never trained.
    """

    def __init__(self, state: TrainState, store: StoreLike | str | os.PathLike[str] | None,
                 *, every_steps: int | None = None, every_seconds: float | None = None,
                 keep_last: int | None = 3, blocking: bool = False,
                 save_at_epoch_end: bool = True, audit: bool | str | None = False,
                 overlap_staging: bool = True, handle_signals: bool = True,
                 exit_code: int = 143, node_local: bool = False,
                 storage_options: dict[str, Any] | None = None,
                 snapshot_every: int | str | None = "auto",
                 snapshot_budget: float = DEFAULT_BUDGET,
                 info: DistInfo | None = None) -> None:
        if not hasattr(state, "state_dict") or not hasattr(state, "load_state_dict"):
            raise TypeError(f"state={state!r} must be an ek.TrainState (state_dict/load_state_dict)")
        #: the options, validated (:class:`CheckpointerConfig`)
        self.config = config = CheckpointerConfig(
            every_steps=every_steps, every_seconds=every_seconds, keep_last=keep_last,
            blocking=blocking, save_at_epoch_end=save_at_epoch_end, audit=audit,
            overlap_staging=overlap_staging, handle_signals=handle_signals,
            exit_code=exit_code, snapshot_every=snapshot_every,
            snapshot_budget=snapshot_budget)
        self.state = state
        self._owns_store = isinstance(store, (str, os.PathLike))
        if self._owns_store:
            store = CheckpointStore(store, keep_last=keep_last,  # type: ignore[arg-type]
                                    node_local=node_local, storage_options=storage_options,
                                    info=info)
        self.store: StoreLike | None = store  # type: ignore[assignment]
        self.every_steps = config.every_steps
        self.every_seconds = config.every_seconds
        self.blocking = bool(config.blocking)
        self.save_at_epoch_end = bool(config.save_at_epoch_end)
        self.audit = config.audit_mode("off")
        self.overlap_staging = bool(config.overlap_staging)
        self.handle_signals = bool(config.handle_signals)
        self.exit_code = int(config.exit_code)
        self.snapshot_every = config.snapshot_every
        self.snapshot_budget = config.snapshot_budget
        self.snapshots: SnapshotTier | None = None
        self.restored_from: str | None = None
        self._given_info = info
        self.info: DistInfo = info or get_dist_info()
        self.loaded: LoadedCheckpoint | None = None
        self.restored_step: int | None = None
        self._stop = TerminationFlag()
        self._flags: Any = None  # the previous exchange's async all-reduce (see _poll_flags)
        self._exchange_every = 1  # steps between exchanges, agreed by all ranks
        self._until_exchange = 1
        self._exchange_t: float | None = None  # rank 0: when the previous exchange ran
        self._exchange_step = 0
        self._step_s: float | None = None  # rank 0: the step time estimate (the only one)
        self._hooks_s = 0.0  # time in the loop's hooks since the previous exchange
        self._last_save_time = time.monotonic()
        self._last_saved_step: int | None = None
        # A save or snapshot due at an epoch's last step waits for end_epoch (or the
        # next step), so what is kept of that step describes the closed epoch.
        self._save_pending = False
        self._snapshot_pending = False
        self._pass_key: tuple[int, ...] | None = None
        self._pass_indices: torch.Tensor | None = None
        # Audited steps not yet digested: (epoch, the pass's local indices, samples the
        # pass started with, world size, first and end local position). Consecutive
        # steps extend one span, digested in one vectorised call when the audit is
        # next needed (a save, a snapshot, the epoch's end), not once per step.
        self._audit_span: tuple[int, torch.Tensor, int, int, int, int] | None = None
        self._step_hook: Any = None
        self._closed = False

    # ------------------------------------------------------------------ restore
    def restore(self, *, map_location: Any = None) -> int:
        """Load the newest checkpoint into the state; return the epoch to start.

        Collective. Without a checkpoint the state is left as it is and its epoch
        (0 for a new run) is returned. Installs the SIGTERM handler and, for
        non-blocking saves, the staging pre-hook on the optimizer.

        Args:
            map_location: as for :meth:`CheckpointStore.load` (default CPU; tensors
                are then copied into the live model and optimizer wherever they are).

        Raises:
            CheckpointMismatchError: the checkpoint does not fit the model, optimizer
                or dataset (nothing in the state was changed).
            ValueError: the sampler was built for another rank or world size.
        """
        info = self.info = self._given_info or get_dist_info()
        state, sampler = self.state, self.state.sampler
        if sampler is None:
            log.warning("TrainState has no sampler: a restart resumes at the start of the "
                        "saved epoch, not at the saved position inside it")
        elif (sampler.num_replicas, sampler.rank) != (info.world_size, info.rank):
            raise ValueError(
                f"sampler has num_replicas={sampler.num_replicas}, rank={sampler.rank}; "
                f"this worker is rank {info.rank} of {info.world_size} (build the sampler "
                "after ek.init_distributed())")
        self.snapshots = self._make_snapshots(info)
        loaded = self._load_newest(map_location)
        if loaded is not None:
            state.load_state_dict(loaded.state)
            self.loaded, self.restored_step = loaded, int(loaded.step)
            self._last_saved_step = self.restored_step
        if state.initial_world_size is None:
            state.initial_world_size = info.world_size
        state.history.append({"world_size": info.world_size, "step": state.step,
                              "restart": info.restart_count,
                              "restored_step": self.restored_step,
                              "restored_from": self.restored_from})
        if sampler is not None and loaded is not None:
            if sampler.remaining == 0 or len(sampler) == 0:
                self._close_exhausted_epoch()
            state.epoch = sampler.epoch
        if info.is_main:
            ignored = self.snapshots.ignored_note() if self.snapshots is not None else ""
            if loaded is not None:
                done = f", {sampler.consumed}/{sampler.dataset_length} samples of it done" if (
                    sampler is not None) else ""
                say(log, "restored checkpoint step %d (from %s): epoch %d%s; world size %s "
                    "-> %d (restart %d)%s", state.step, _TIER_NAMES[self.restored_from],
                    state.epoch, done, loaded.metadata.get("world_size", "?"),
                    info.world_size, info.restart_count, ignored)
            else:
                say(log, "no checkpoint to restore: starting at step %d, epoch %d, world "
                         "size %d%s", state.step, state.epoch, info.world_size, ignored)
        if self.handle_signals:
            self._stop.install()
        if self.store is not None and self.overlap_staging and self._step_hook is None \
                and state.optimizer is not None:
            self._step_hook = state.optimizer.register_step_pre_hook(self._wait_staged)
        self._last_save_time = time.monotonic()
        return int(state.epoch)

    def _close_exhausted_epoch(self) -> None:
        """A restored state whose epoch has nothing left: move to the next epoch.

        Such a state (a save at the epoch's last step before :meth:`end_epoch`, or a
        SIGTERM save there) would hand the script an empty pass, and a loop that
        calls ``next(iter(loader))`` first stops with ``StopIteration``. The epoch's
        audit is checked here instead of in :meth:`end_epoch`; the script's own
        end-of-epoch work for it is not redone. Collective (the audit).
        """
        state, sampler = self.state, self.state.sampler
        epoch = sampler.epoch
        self.finish_audit()
        sampler.set_epoch(epoch + 1)
        state.epoch = epoch + 1
        if self.info.is_main:
            say(log, "restored step %d finished epoch %d: resuming at epoch %d, position 0",
                state.step, epoch, epoch + 1)

    def _make_snapshots(self, info: DistInfo) -> SnapshotTier | None:
        every = self.snapshot_every
        if self.store is None or every in (None, 0):
            return None
        if every == "auto":
            if not info.under_torchrun:  # nothing restarts the workers: nothing to outlive
                return None
            every = None
        # a snapshot is trusted only with the identity the store holds now (collective)
        identity = agree_run_identity(self.store, info)
        if identity is None:
            return None
        tier = SnapshotTier(str(self.store.url), info=info, every=every,  # type: ignore[arg-type]
                            budget=self.snapshot_budget, identity=identity)
        # Every rank must take the same restore path (its loads are collective), so
        # snapshots are on only when every node can keep them.
        if all_reduce_max(int(not tier.enabled)):
            if tier.enabled and info.rank == 0:
                log.warning("in-memory snapshots are off: another node cannot keep them "
                            "(see its warning); restarts resume from the durable store")
            return None
        return tier

    def _load_newest(self, map_location: Any) -> LoadedCheckpoint | None:
        """The newest state in any tier: this node's memory, a peer's, or the store.

        Every rank learns the newest snapshot step any node holds and the newest
        durable step, and all take the same branch (the loads are collective).
        """
        tier, store, info = self.snapshots, self.store, self.info
        if store is None:
            return None
        if tier is None:
            loaded = _load_durable(store, map_location)
            self.restored_from = "store" if loaded is not None else None
            return loaded
        tier.connect()
        mine = tier.newest_local()
        writer = getattr(store, "is_writer", info.rank == 0)
        step, epoch, consumed = _newest_key(store) if writer else (-1, -1, -1)
        newest_snapshot = all_reduce_max(-1 if mine is None else mine)
        newest_durable = all_reduce_max(step)
        # the newest durable checkpoint's position, from a writer that holds it
        newest = step == newest_durable
        durable_key = (newest_durable, all_reduce_max(epoch if newest else -1),
                       all_reduce_max(consumed if newest else -1))
        loaded = None
        if newest_snapshot >= 0 and newest_snapshot >= newest_durable:
            loaded = tier.load(map_location=map_location)
            # The later state wins, not the tier: a durable save made after end_epoch
            # is later than a snapshot of the same step taken inside the epoch.
            if loaded is not None and _key(loaded.step, loaded.metadata) >= durable_key:
                # memory when rank 0's node held it, else a peer node's copy or a
                # replica a peer streamed here
                held = all_reduce_max(int(info.rank == 0 and tier.loaded_own))
                self.restored_from = "memory" if held else "peer"
                return loaded
        loaded = _load_durable(store, map_location)
        self.restored_from = "store" if loaded is not None else None
        return loaded

    def _wait_staged(self, *_: Any) -> None:
        """Optimizer-step pre-hook: the in-flight saves no longer read the parameters."""
        if self.store is not None:
            self.store.wait_staged()
        if self.snapshots is not None:
            self.snapshots.wait_staged()

    # ------------------------------------------------------------------ steps
    @property
    def stop_requested(self) -> bool:
        """True once this rank received SIGTERM (or :meth:`request_stop` was called)."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Save and exit soon (as after SIGTERM, see ``handle_signals``)."""
        self._stop.set()

    def _pass_position(self) -> tuple[int, int, int]:
        """``(j0, R0, W)``: this rank's local offset in the pass, samples the pass
        started with, world size."""
        s = self.state.sampler
        w = s.num_replicas
        start = s.pass_start
        return (s.consumed - start) // w, s.dataset_length - start, w

    def sample_weights(self, n: int, *, device: Any = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-sample loss weights for this rank's next batch of ``n`` samples.

        ``W / n_real`` for real samples and 0 for the padding that fills the epoch's
        last step (``n_real``: real samples of the whole step, over all ranks), so
        that ``(per_sample_loss * weights).sum()`` under DDP (which averages the
        ranks' gradients) is the mean loss over exactly the step's real samples:
        every sample counts once, and the last, partial step is not biased by
        repeated ones. Call it before :meth:`step` for the same batch.

        Example::

            criterion = nn.CrossEntropyLoss(reduction="none")
            loss = (criterion(model(x), y) * ckpt.sample_weights(len(x), device=x.device)).sum()
        """
        n = operator.index(n)
        sampler = self.state.sampler
        if sampler is None:
            return torch.full((n,), 1.0 / max(n, 1), dtype=dtype, device=device)
        j0, r0, w = self._pass_position()
        n_real = max(0, min(r0 - j0 * w, n * w))
        positions = torch.arange(j0, j0 + n, dtype=torch.int64)
        real = positions.mul_(w).add_(sampler.rank) < r0
        return real.to(device=device, dtype=dtype).mul_(w / max(n_real, 1))

    def step(self, n: int) -> None:
        """Record one optimizer step in which this rank trained ``n`` samples.

        Call it after ``optimizer.step()``, on every rank. It advances the sampler by
        the step's real samples over all ranks, records them in the audit (when on),
        saves when a save is due, and after a SIGTERM on any rank saves synchronously
        and raises ``SystemExit(exit_code)`` on every rank (at the same step, within
        about 0.4 s of training; at an epoch's last step, :meth:`end_epoch` does, so
        the checkpoint describes the closed epoch). It runs a collective only now and
        then (about every 0.2 s of training, overlapped with the next steps), never
        one per step. A save or snapshot due at an epoch's last step is taken by
        :meth:`end_epoch`, after the epoch is closed.

        It is :meth:`record_step` then :meth:`after_step`; a loop that reports the
        step in between (as :class:`~elastic_kit.ElasticLoop` does, so that a step
        ended by SIGTERM is still reported) calls the two itself.
        """
        self.record_step(n)
        self.after_step()

    def after_step(self) -> None:
        """The second half of :meth:`step`: exchange the ranks' flags now and then,
        save or snapshot when due, and after a SIGTERM save and exit."""
        self._act(self._poll_flags())

    def record_step(self, n: int) -> None:
        """The first half of :meth:`step`: count the step, advance the sampler by its
        real samples over all ranks and feed the audit. No collective, no save."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"step(n={n}): n must be >= 0 (this rank's samples in the step)")
        state, sampler = self.state, self.state.sampler
        state.step += 1
        if sampler is None:
            return
        j0, r0, w = self._pass_position()
        n_real = max(0, min(r0 - j0 * w, n * w))
        if self.audit != "off" and n_real:
            self._note_audited(sampler.epoch, self._pass_local_indices(), r0, w, j0, j0 + n)
        sampler.advance(n_real)
        state.epoch = sampler.epoch

    def _act(self, flags: list[float]) -> None:
        """Given the ranks' agreed flags (:meth:`_poll_flags`): save and exit after
        SIGTERM, save when due, take a snapshot when due."""
        state, sampler = self.state, self.state.sampler
        epoch_done = sampler is not None and sampler.remaining == 0
        if flags[0] > 0:
            if not epoch_done:
                self._exit_after_save()
            # The epoch's last step: saved now, in case the script's end-of-epoch work
            # outlasts torchrun's grace period; end_epoch saves it again with the epoch
            # closed and exits (it sees the stop through _agreed_stop).
            self.save(blocking=True)
        due = self.every_steps is not None and state.step % self.every_steps == 0
        due = due or flags[1] > 0 or self._save_pending
        # A fixed snapshot interval is known to every rank; an automatic one is rank
        # 0's proposal, agreed through the exchanges (see _poll_flags).
        snap = self.snapshots is not None and (self.snapshots.due(state.step)
                                               or self._snapshot_pending)
        if epoch_done:
            # One step, one state: what is kept of the epoch's last step is taken by
            # end_epoch, with the epoch closed, so a snapshot and a durable checkpoint
            # of that step never disagree about the epoch.
            self._save_pending = self._save_pending or due
            self._snapshot_pending = self._snapshot_pending or snap
            return
        self._save_pending = self._snapshot_pending = False
        if due:
            self.save(blocking=self.blocking)
        if snap:
            self.snapshot()

    def _note_audited(self, epoch: int, indices: torch.Tensor, r0: int, w: int,
                      a: int, b: int) -> None:
        span = self._audit_span
        if span is not None and span[0] == epoch and span[1] is indices and span[5] == a:
            self._audit_span = (*span[:5], b)
            return
        self._digest_audited()
        self._audit_span = (epoch, indices, r0, w, a, b)

    def _digest_audited(self) -> None:
        """Fold the pending span of audited steps into this rank's audit share."""
        span, self._audit_span = self._audit_span, None
        if span is None:
            return
        epoch, indices, r0, w, a, b = span
        ids = indices[a:b]
        real = torch.arange(a, a + len(ids)).mul_(w).add_(self.state.sampler.rank) < r0
        self.state.audit.record(epoch, ids[real])

    def _pass_local_indices(self) -> torch.Tensor:
        s = self.state.sampler
        key = (s.epoch, s.pass_start, s.num_replicas, s.rank, s.seed, int(s.shuffle))
        if key != self._pass_key:
            self._pass_key = key
            self._pass_indices = s.local_indices(position=s.pass_start)
        assert self._pass_indices is not None
        return self._pass_indices

    def _poll_flags(self) -> list[float]:
        """The ranks' agreed ``[stop, save time due, snapshot interval, exchange
        interval]``, or no flags (zeros) between exchanges.

        What one rank knows alone (a SIGTERM, rank 0's clock, rank 0's automatic
        snapshot interval) reaches every rank through a small async all-reduce, an
        *exchange*: issued after one step and read at the next exchange, so it never
        waits on the critical path, and every rank acts on it at the same step. Even
        an overlapped collective costs a short step something (a gloo all-reduce
        takes its thread ~1 ms on a busy CPU): exchanges run about every
        :data:`EXCHANGE_PERIOD_S` seconds of training (every step when steps are
        longer), at an interval rank 0 proposes from its step time and all ranks
        adopt at the same exchange. A SIGTERM is thus acted on within two exchange
        periods.
        """
        if self.info.world_size == 1 or not is_dist_ready():
            flags = self._local_flags()
            self._adopt(flags)
            return flags
        self._until_exchange -= 1
        if self._until_exchange > 0:
            return list(_NO_FLAGS)
        previous = self._resolve_flags()
        self._adopt(previous)
        self._until_exchange = self._exchange_every
        self._flags = all_reduce_sum_async(torch.tensor(self._local_flags(),
                                                        dtype=torch.float64))
        return previous

    def _adopt(self, flags: list[float]) -> None:
        """Take rank 0's proposals carried by an exchange (every rank at once)."""
        if flags[3] >= 1:
            self._exchange_every = int(flags[3])
        tier = self.snapshots
        if tier is not None and flags[2] >= 1:
            tier.interval = int(flags[2])

    def _local_flags(self) -> list[float]:
        """This rank's ``[stop requested, save time due, proposed snapshot interval,
        proposed exchange interval]`` as floats (summed over ranks in float64); only rank 0
        proposes (the others send zeros)."""
        main = self.info.is_main
        now = time.monotonic()
        time_due = (self.every_seconds is not None and main
                    and now - self._last_save_time >= self.every_seconds)
        snap_every = exchange_every = 0
        if main:
            tier = self.snapshots
            steps = self.state.step - self._exchange_step
            if self._exchange_t is not None and steps > 0:
                dt = max(now - self._exchange_t - self._hooks_s, 0.0) / steps
                self._step_s = dt if self._step_s is None else 0.5 * (self._step_s + dt)
            snap_every = tier.proposal(self._step_s) if tier is not None else 0
            self._exchange_t, self._exchange_step = now, self.state.step
            self._hooks_s = 0.0
            exchange_every = max(1, min(MAX_EXCHANGE_EVERY, int(
                EXCHANGE_PERIOD_S / self._step_s))) if self._step_s else 1
        return [float(self._stop.is_set()), float(time_due), float(snap_every),
                float(exchange_every)]

    def _exclude_time(self, seconds: float) -> None:
        """Keep ``seconds`` (spent in a user hook: validation, logging) out of the
        step time the exchange and snapshot intervals are budgets of, so a long hook
        does not make snapshots more frequent for a while."""
        self._hooks_s += seconds

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A block of work that is not training (validation, logging, a hook).

        Its time is kept out of the step-time estimate that sets the automatic
        snapshot interval, so a long validation does not make snapshots more frequent.
        Example::

            with ckpt.paused():
                acc = validate(model, val_loader)
        """
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._exclude_time(time.perf_counter() - t0)

    def _resolve_flags(self) -> list[float]:
        if self._flags is None:
            return list(_NO_FLAGS)
        flags, self._flags = self._flags().tolist(), None
        return flags

    def _agreed_stop(self) -> bool:
        """Every rank learns at once whether any rank received SIGTERM (collective)."""
        pending_stop = self._resolve_flags()[0] > 0 if is_dist_ready() else False
        mine = self._stop.is_set() or pending_stop
        if is_dist_ready() and self.info.world_size > 1:
            return all_reduce_max(int(mine)) > 0
        return mine

    def _exit_after_save(self) -> None:
        self.save(blocking=True)
        if self.info.is_main:
            say(log, "SIGTERM: checkpoint step %d saved; exiting with status %d so "
                        "torchrun restarts the group", self.state.step, self.exit_code)
        self._close(remove_snapshots=False)  # the next group resumes from them
        raise SystemExit(self.exit_code)

    # ------------------------------------------------------------------ epochs
    def end_epoch(self) -> None:
        """Close the epoch: check the audit, move to the next epoch, save.

        Collective. After it, ``state.epoch`` and the sampler are at the next epoch,
        position 0, and the checkpoint saved here says so.

        Raises:
            SampleAuditError: ``audit="error"`` and the epoch missed or repeated a sample.
        """
        state, sampler = self.state, self.state.sampler
        epoch = sampler.epoch if sampler is not None else state.epoch
        self.finish_audit()
        stop = self._agreed_stop()
        state.epoch = epoch + 1
        if sampler is not None:
            sampler.set_epoch(epoch + 1)
        if stop:
            self._exit_after_save()
        save, snap = self.save_at_epoch_end or self._save_pending, self._snapshot_pending
        self._save_pending = self._snapshot_pending = False
        if save:
            self.save(blocking=self.blocking)
        if snap:
            self.snapshot()

    def finish_audit(self) -> EpochAudit | None:
        """Check the current epoch's sample audit now (collective); None when off.

        :meth:`end_epoch` calls it; call it earlier to report the audit before
        end-of-epoch work (validation). Checking twice checks once.

        Raises:
            SampleAuditError: ``audit="error"`` and the epoch missed or repeated a sample.
        """
        state, sampler = self.state, self.state.sampler
        if self.audit == "off" or sampler is None:
            return None
        epoch = sampler.epoch
        self._digest_audited()
        audit = state.audit.epoch(epoch)
        if audit.ok is not None and audit.expected_count == sampler.dataset_length:
            return audit
        state.audit.sync(epoch)
        if not audit.finish(sampler.dataset_length):
            if self.info.is_main:
                log.error("SAMPLE AUDIT FAILED: %s", audit.message)
            if self.audit == "error":
                raise SampleAuditError(audit.message)
        elif self.info.is_main:
            say(log, "sample audit: %s", audit.message)
        return audit

    # ------------------------------------------------------------------ saving
    def save(self, *, blocking: bool = True) -> None:
        """Checkpoint the state now at ``state.step``. Collective.

        Every rank calls the store, the writer writes, and the ranks agree on the
        outcome: if the write failed on the writer (or an earlier non-blocking write
        did), every rank raises :class:`~elastic_kit.CheckpointError`.
        """
        state = self.state
        self._sync_audit()
        if self.store is None:
            return
        kw: dict[str, Any] = {}
        if not blocking and self.overlap_staging and state.optimizer is not None:
            kw["copy_later"] = _optimizer_tensors(state.optimizer)
        err: BaseException | None = None
        try:
            self.store.save(state.state_dict(), step=state.step, metadata=self._metadata(),
                            blocking=blocking, **kw)
        except Exception as e:  # every rank must learn of it, below
            err = e
        self._agree(err, f"saving checkpoint step {state.step} to {self.store.url}")
        self._last_saved_step = state.step
        self._last_save_time = time.monotonic()

    def snapshot(self) -> None:
        """Take an in-memory snapshot of the state now (collective when the audit is
        on; a no-op when snapshots are off). Written in the background by each node's
        local rank 0; a failure switches snapshots off with a warning."""
        if self.snapshots is None:
            return
        t0 = time.perf_counter()  # the audit's sync is part of a snapshot's cost
        self._sync_audit()
        if not self.snapshots.writes:
            return
        state = self.state
        later = (_optimizer_tensors(state.optimizer)
                 if self.overlap_staging and state.optimizer is not None else ())
        self.snapshots.save(state.state_dict, step=state.step, metadata=self._metadata(),
                            copy_later=later, started=t0)

    def _sync_audit(self) -> None:
        # Fold every rank's audit share in first, so the saved audit matches exactly
        # the samples behind the saved model state.
        if self.audit != "off":
            self._digest_audited()
            self.state.audit.sync(self.state.epoch)

    def _metadata(self) -> dict[str, Any]:
        sampler = self.state.sampler
        return {"epoch": int(self.state.epoch), "world_size": self.info.world_size,
                "consumed": int(sampler.consumed) if sampler is not None else None}

    def _agree(self, err: BaseException | None, what: str) -> None:
        failed = all_reduce_max(int(err is not None)) if (
            is_dist_ready() and self.info.world_size > 1) else int(err is not None)
        if err is not None:
            raise err
        if failed:
            raise CheckpointError(f"{what} failed on the writer rank (see its log)")

    def close(self) -> None:
        """Wait for the in-flight save (re-raising its error) and uninstall the hooks.

        Collective. Closes the store when the checkpointer made it from a URL, and
        removes this run's in-memory snapshots (training is over: the durable store
        holds the result). Safe to call twice.
        """
        self._close(remove_snapshots=True)

    def _close(self, *, remove_snapshots: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._remove_hooks()
        if is_dist_ready():
            self._resolve_flags()
        if self.store is not None:
            err: BaseException | None = None
            try:
                self.store.wait()
            except Exception as e:
                err = e
            if self.snapshots is not None:
                self.snapshots.close(remove=False)
            # also the barrier after which no rank writes a snapshot any more
            self._agree(err, f"the last background save to {self.store.url}")
            if self.snapshots is not None and remove_snapshots:
                self.snapshots.close(remove=True)
            if self._owns_store:
                self.store.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint committed or restored here, or None."""
        return self._last_saved_step

    def abandon(self) -> None:
        """Close on this rank alone, while an exception propagates (possibly on this
        rank only): no collective, or it would block on its peers or match one of
        their collectives. A pending save's failure is logged, not raised. What
        ``with Checkpointer(...)`` runs when its block raises."""
        if self._closed:
            return
        self._closed = True
        self._remove_hooks()
        # An exchange of flags may be in flight, and a failing peer may never join it:
        # not waited for here, but kept from being freed on the backend's thread.
        self._flags = None
        settle_collectives(ABANDON_SETTLE_S)
        if self.store is not None:
            self.store.wait_local()
        if self.snapshots is not None:
            self.snapshots.close(remove=False, flush=False)

    def _remove_hooks(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self._stop.uninstall()


def _int_or(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def _key(step: int, metadata: dict[str, Any]) -> tuple[int, int, int]:
    """``(step, epoch, position)`` of a saved state: which of two states is later."""
    return (int(step), _int_or(metadata.get("epoch"), -1), _int_or(metadata.get("consumed"), -1))


def _newest_key(store: StoreLike) -> tuple[int, int, int]:
    """:func:`_key` of the store's newest committed checkpoint (manifests only), or
    ``(-1, -1, -1)`` without one. A store without ``list()`` gives its step only."""
    lister = getattr(store, "list", None)
    if lister is None:
        step = store.latest_step()  # type: ignore[attr-defined]
        return (-1, -1, -1) if step is None else (int(step), -1, -1)
    infos = lister()
    return _key(infos[-1].step, infos[-1].metadata) if infos else (-1, -1, -1)


def _load_durable(store: StoreLike, map_location: Any) -> LoadedCheckpoint | None:
    """Load the store's newest checkpoint; a node-local store's node that lacked it
    then keeps the broadcast copy (a store-like wrapper without ``keep_copy`` only
    loads)."""
    loaded = store.load(map_location=map_location)
    keep_copy = getattr(store, "keep_copy", None)
    if keep_copy is not None:
        keep_copy(loaded)
    return loaded


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Tensors that change only in ``optimizer.step()``: parameters and optimizer state."""
    out: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
    for st in optimizer.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out
