"""Checkpointer: make a training script that keeps its own loop resumable, exactly.

It composes one module per concern: ``_cadence`` (when the ranks act together),
``_restore`` (where a restart resumes from), ``_progress`` (the sample position and
the audit), ``_saving`` (writing the state), ``_hooks`` (what it installs) and
``_lifecycle`` (how it ends).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import Any, Iterator

import torch

from elastic_kit._checks import check_int, type_error
from elastic_kit.checkpointer import _restore, _saving
from elastic_kit.checkpointer._cadence import RESTART, Cadence, Flags
from elastic_kit.checkpointer._config import DEFAULT_KEEP_LAST, CheckpointerConfig
from elastic_kit.checkpointer._departure import Departure
from elastic_kit.checkpointer._hooks import Hooks
from elastic_kit.checkpointer._lifecycle import Lifecycle
from elastic_kit.checkpointer._progress import _UNSTEPPED_CAUSE, Progress, check_dealt
from elastic_kit.checkpointer._step_end import StepEnd
from elastic_kit.checkpointer._store_like import StoreLike
from elastic_kit.distributed import DistInfo, get_dist_info
import elastic_kit.health as health
from elastic_kit.snapshot import DEFAULT_BUDGET, SnapshotTier
from elastic_kit.state import (
    UNACTED_AFTER_S, UNHEARD_AFTER_S, UNHEARD_MAX_S, EpochAudit, TrainState,
)
from elastic_kit.store import LoadedCheckpoint

__all__ = ["Checkpointer", "StoreLike"]

log = logging.getLogger(__name__)

#: ``node_local``'s default (False), told apart from a False given beside a store object
_NODE_LOCAL_DEFAULT: Any = _saving.NotGiven(False)


class Checkpointer(Lifecycle):
    """Resume a script's own training loop mid-epoch, exactly, at any world size.

    It adds what an elastic restart needs to a script's own loop, and nothing else
    about the loop changes::

        ckpt = ek.Checkpointer(state, "s3://bucket/run", every_steps=200)
        for epoch in range(ckpt.restore(), epochs):  # collective: newest state, epoch
            sampler.set_epoch(epoch)                 # keeps a restored mid-epoch position
            for x, y in loader:                      # yields only what the epoch has left
                ...forward, backward, optimizer.step()...
                ckpt.step(len(x))                    # saves when due; SIGTERM: save, exit
            ckpt.end_epoch()
        ckpt.close()

    Args:
        state: the :class:`~elastic_kit.TrainState` to save and restore. Its
            ``sampler`` should be the :class:`~elastic_kit.ElasticDistributedSampler`
            the loader iterates: the checkpointer advances it after every step.
            Without one, a restart resumes at the start of the saved epoch.
        store: a :class:`~elastic_kit.CheckpointStore`, a path or fsspec URL (a store
            is made, with ``keep_last``, ``node_local`` and ``storage_options``), or
            ``None`` (no checkpoints; steps, audit and SIGTERM handling still work).
        every_steps, every_seconds, keep_last, blocking, save_at_epoch_end, audit,
            overlap_staging, handle_signals, exit_code, snapshot_every, snapshot_budget,
            heartbeat_timeout, handle_preemption: the options, as documented (and
            validated) by :class:`~elastic_kit.CheckpointerConfig` (``audit`` off here).
        node_local / storage_options: passed to the store made from a URL.
            ``keep_last``, ``node_local`` and ``storage_options`` configure that
            store: given with a store object they raise ``TypeError`` (the object
            keeps its own settings; make it with them instead).
        info: this worker's :class:`~elastic_kit.DistInfo`; read from the environment
            and process group by :meth:`restore` when None.

    Attributes:
        loaded: the :class:`~elastic_kit.LoadedCheckpoint` :meth:`restore` loaded (its
            step, epoch, metadata and path), or None. Its ``state`` is empty: the
            state was loaded into the live objects, and keeping its tensors would hold
            a whole copy (for a restore from memory, the snapshot's mapped file).
        restored_step: its step, or None.
        finished_at_restore: the epoch the restored state had trained to its end
            without its end-of-epoch work (saved at the epoch's last step, before
            :meth:`end_epoch`: a ``save()`` there, or a SIGTERM save whose end-of-epoch
            work was cut short), or None.
            :meth:`restore` moved on to the next epoch; the work for this one (a
            validation) is the script's to redo if it wants it.
            :class:`~elastic_kit.ElasticLoop` runs its ``on_epoch_end`` for it.
        replays_epoch_end: False by default: a rank that exits alone (a peer failed)
            after an epoch's last step, before :meth:`end_epoch`, writes no snapshot,
            since a restore of it would skip the script's end-of-epoch work (its
            validation, a per-epoch scheduler step after it); the restart resumes
            from an earlier state and redoes the steps since. Set it True when the
            script does that work again for :attr:`finished_at_restore` (as
            :class:`~elastic_kit.ElasticLoop` does, until its ``on_epoch_end``
            begins): the snapshot is then written and only the epoch's end is redone.
            Set it back to False while that work runs when it changes the state (a
            learning rate decayed by hand): a snapshot of such a state would have the
            change applied twice.
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
                 keep_last: int | None = DEFAULT_KEEP_LAST, blocking: bool = False,
                 save_at_epoch_end: bool = True, audit: bool | str | None = False,
                 overlap_staging: bool = True, handle_signals: bool = True,
                 exit_code: int = 143, node_local: bool = _NODE_LOCAL_DEFAULT,
                 storage_options: dict[str, Any] | None = None,
                 snapshot_every: int | str | None = "auto",
                 snapshot_budget: float = DEFAULT_BUDGET,
                 heartbeat_timeout: float | None = health.DEFAULT_TIMEOUT_S,
                 handle_preemption: bool = True, info: DistInfo | None = None) -> None:
        if not isinstance(state, TrainState):  # a model has state_dict too, but no sampler
            raise type_error("state", state, "an ek.TrainState (the model, optimizer and "
                                             "sampler together)")
        if info is not None and not isinstance(info, DistInfo):
            raise type_error("info", info, "None or an ek.DistInfo")
        #: the options, validated (:class:`CheckpointerConfig`)
        given = locals()  # every option is a keyword of the same name
        self.config = config = CheckpointerConfig(
            **{name: given[name] for name in CheckpointerConfig.__dataclass_fields__})
        self.state = state
        self.store, self._owns_store = _saving.open_store(
            store, info, keep_last=config.keep_last, node_local=node_local,
            storage_options=storage_options)
        self.every_steps, self.every_seconds = config.every_steps, config.every_seconds
        self.blocking = bool(config.blocking)
        self.save_at_epoch_end = bool(config.save_at_epoch_end)
        self.audit = config.audit_mode("off")
        self.overlap_staging = bool(config.overlap_staging)
        self.handle_signals, self.exit_code = bool(config.handle_signals), int(config.exit_code)
        self.snapshot_every, self.snapshot_budget = config.snapshot_every, config.snapshot_budget
        self.snapshots: SnapshotTier | None = None  # set up by restore()
        self.restored_from: str | None = None
        self._given_info = info
        self.info: DistInfo = info or get_dist_info()
        self.loaded: LoadedCheckpoint | None = None
        self.restored_step: int | None = None
        self.finished_at_restore: int | None = None
        self.replays_epoch_end = False
        self._last_saved_step: int | None = None
        #: the step of the newest checkpoint known committed in the durable store (a
        #: blocking save, or the store's restore), for the last step written at exit
        self._committed_step: int | None = None
        self._hooks = Hooks()  # the SIGTERM flag and the optimizer's pre-hook
        # the flag exchange, the one step-time estimate, the save and snapshot intervals
        self._departure = Departure(enabled=config.handle_preemption)  # a planned leave
        self._cadence = Cadence(state, self.info, self._hooks.stop, self.every_seconds,
                                tier=lambda: self.snapshots, leaving=self._departure.noticed,
                                finish=self._hooks.finish.is_set)
        self._progress = Progress(state)  # the sample position and the audit
        # the state at the last step end, for a snapshot as this rank fails (restore())
        self._step_end = StepEnd(state, enabled=False)
        self._heartbeat: health.Heartbeat | None = None  # beats to other nodes (from restore())
        # another thread writes the last step (a silent peer, an unheard SIGTERM)
        self._leaving, self._left = threading.Event(), threading.Event()
        # ... or the training thread does, abandoning the checkpointer (abandon())
        self._abandoning, self._abandoned = threading.Event(), threading.Event()
        self._leave_lock = threading.Lock()
        self._last_step_at: float | None = None  # when record_step last ran (monotonic)
        self._pausing = False  # inside a block kept out of the step time (_not_training)
        self._restored = False  # restore() ran: the loop's calls need what it sets up
        self._warned_unstepped = False

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
        self._require_open("restore")
        info = self.info = self._cadence.info = self._given_info or get_dist_info()
        state = self.state
        _restore.check_sampler(state.sampler, info)
        sharded = bool(getattr(state, "sharded", False))
        self.snapshots = _restore.make_snapshots(self.store, info, self.snapshot_every,
                                                 self.snapshot_budget, sharded=sharded)
        loaded, self.restored_from, durable = _restore.load_newest(
            self.store, self.snapshots, info, map_location,
            into=state.state_dict if sharded else None)
        if loaded is not None:
            if self.restored_from in ("memory", "peer") and not sharded:
                _restore.own_kept_state(state, loaded.state)
            state.load_state_dict(loaded.state)
            self.restored_step = int(loaded.step)
            # read (and verified) from the durable store; a state from memory counts
            # as saved nowhere durable, even one the store's manifest names
            if durable:
                self._last_saved_step = self._committed_step = self.restored_step
        self.finished_at_restore = _restore.resume(
            state, info, loaded, self.restored_step, self.restored_from, self.snapshots,
            self.finish_audit)
        if loaded is not None:
            # what was loaded, without its state: that is in the live objects now, and
            # a snapshot's tensors would hold its mapped file for the rest of the run
            self.loaded = dataclasses.replace(loaded, state={})
        self._progress.restored()
        tier = self.snapshots
        if loaded is not None and tier is not None and tier.writes:
            # the next snapshot (the first to protect the restored steps) goes straight
            # into a file the writer makes now, not into buffers made on this thread
            tier.prepare(state.state_dict())
        self._step_end = StepEnd(state, enabled=tier is not None and tier.writes and not sharded)
        self._step_end.record()
        staging = self.store is not None and self.overlap_staging

        def before_optimizer_step(*_: Any) -> None:
            self._step_end.optimizer_started()
            self._hold_if_leaving()  # after the mark above: see _leave_silent
            if staging:
                _saving.wait_staged(self.store, self.snapshots)

        held = weakref.ref(state)  # torch's process-wide hook must not keep it alive

        def current_optimizer() -> Any:
            state = held()
            return None if state is None else state.optimizer

        self._hooks.install(signals=self.handle_signals, optimizer=state.optimizer,
                            hook_steps=staging or self._step_end.enabled,
                            wait_staged=before_optimizer_step, at_exit=self._abandon_at_exit,
                            on_unheard=self._leave_unheard,
                            on_received=self._stop_received, current=current_optimizer)
        # a signal heard while the script is away from step() and end_epoch() (a
        # validation outlasting torchrun's grace) is acted on all the same: armed from
        # the first step on, for twice a step's wall time (see record_step), so that
        # neither a long step nor a first step's warm-up (torch.compile) is cut short
        self._hooks.stop.unacted_after_s = None
        self._cadence.saved()
        self._heartbeat = health.start_heartbeat(info, timeout_s=self.config.heartbeat_timeout,
                                                 on_silent=self._leave_silent)
        self._departure.start(info)
        self._restored = True
        return int(state.epoch)

    def sample_weights(self, n: int, *, offset: int = 0, step_n: int | None = None,
                       device: Any = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-sample loss weights for this rank's next batch of ``n`` samples.

        ``W / n_real`` for real samples and 0 for the padding that fills the epoch's
        last step (``n_real``: real samples of the batch, over all ranks), so that
        ``(per_sample_loss * weights).sum()`` under DDP (which averages the ranks'
        gradients) is the mean loss over exactly the batch's real samples: every
        sample counts once, and the last, partial step is not biased by repeated
        ones. Call it before :meth:`step` for the same batch.

        With gradient accumulation (several micro-batches, then one
        :meth:`step` with their total), give each micro-batch its place in the step
        (``offset``: this rank's samples in the step's earlier micro-batches) and the
        step's size (``step_n``: this rank's samples in the whole step): every real
        sample of the step then weighs ``W / n_real`` of the whole step, so sum the
        micro-batches' losses (do not divide by their number), and the step's loss is
        the mean over exactly its real samples at any world size. Without ``step_n``
        each micro-batch averages over its own real samples (then divide by the number
        of micro-batches): the same for full steps, but at an epoch's last, partial
        step a sample's weight depends on how the real samples fell into
        micro-batches, which the world size decides. A step whose micro-batches were
        all weighed at offset 0 is refused by :meth:`step` (every one would have the
        first one's padding mask).

        Example::

            criterion = nn.CrossEntropyLoss(reduction="none")
            loss = (criterion(model(x), y) * ckpt.sample_weights(len(x), device=x.device)).sum()

            step_n, done = sum(len(x) for x, _ in micro_batches), 0  # accumulating
            for x, y in micro_batches:
                w = ckpt.sample_weights(len(x), offset=done, step_n=step_n, device=x.device)
                (criterion(model(x), y) * w).sum().backward()
                done += len(x)
            optimizer.step()
            ckpt.step(done)

        Raises:
            ValueError: ``n`` or ``offset`` is negative, or ``step_n`` is less than
                ``offset + n``.
        """
        n, offset = check_int("n", n), check_int("offset", offset)
        if n < 0 or offset < 0:
            raise ValueError(f"sample_weights(n={n}, offset={offset}): both must be >= 0 "
                             f"(this rank's samples in the batch, and before it in the step)")
        if step_n is not None:
            step_n = check_int("step_n", step_n)
            if step_n < offset + n:
                raise ValueError(f"sample_weights(n={n}, offset={offset}, step_n={step_n}): "
                                 f"step_n is this rank's samples in the whole step, at least "
                                 f"offset + n = {offset + n}")
        return self._progress.weights(n, offset=offset, step_n=step_n, device=device,
                                      dtype=dtype)

    def step(self, n: int) -> None:
        """Record one optimizer step in which this rank trained ``n`` samples.

        Call it after ``optimizer.step()``, on every rank: it advances the sampler by
        the step's real samples over all ranks, feeds the audit, saves when due, and
        after a SIGTERM on any rank saves and raises ``SystemExit(exit_code)`` on
        every rank at the same step (within about 0.4 s of training). What is due at
        an epoch's last step :meth:`end_epoch` takes, with the epoch closed. It is
        :meth:`record_step` then :meth:`after_step`; a loop that reports the step in
        between (as :class:`~elastic_kit.ElasticLoop` does) calls the two itself.

        Raises:
            RuntimeError: :meth:`restore` was not called, the checkpointer is
                closed, or nothing iterated
                ``state.sampler`` since its epoch was set (the DataLoader must be
                given it as its sampler, and its iterator made after the restore).
            TypeError: ``n`` is not an int (numpy and torch integers are; a bool
                is not).
            ValueError: ``n`` is negative, or the step starts past the end of the
                pass the sampler dealt (``step()`` called twice per step, or with the
                global batch size), or its micro-batches were all weighed at offset 0
                (see :meth:`sample_weights`).
        """
        n = check_int("n", n)  # a count of samples: step("2") or step(True) is a slip
        self._require_restored("step")
        if n > 0 and self.state.sampler is not None:
            check_dealt(self.state.sampler, n)
        self.record_step(n)
        self.after_step()

    def after_step(self) -> None:
        """The second half of :meth:`step`: exchange the ranks' flags now and then,
        save or snapshot when due, and after a SIGTERM save and exit."""
        self._require_open("after_step")
        self._act(self._cadence.poll())

    def record_step(self, n: int) -> None:
        """The first half of :meth:`step`: count the step, advance the sampler by its
        real samples over all ranks and feed the audit. No collective, no save.

        Unlike :meth:`step` it does not check that a loader iterates the sampler
        (:class:`~elastic_kit.ElasticLoop` schedules from its indices instead); a step
        that starts past the end of the pass is refused (``ValueError``) by both."""
        n = check_int("n", n)
        self._require_restored("step")
        if n < 0:
            raise ValueError(f"step(n={n}): n must be >= 0 (this rank's samples in the step)")
        self._hooks.follow(self.state.optimizer)  # a new optimizer since the restore
        self._progress.advance(n, audited=self.audit != "off")  # may refuse the step
        self.state.step += 1
        self._step_end.record()
        # an unheard SIGTERM waits two steps' time (5-15 s): one long backward pass is
        # one call, in which the training thread cannot hear a signal either
        now = time.monotonic()
        if self._last_step_at is not None:
            wall = now - self._last_step_at  # the step, with the script's work between
            self._hooks.stop.unheard_after_s = min(max(
                UNHEARD_AFTER_S, 2.0 * wall), UNHEARD_MAX_S)
            self._hooks.stop.unacted_after_s = max(UNACTED_AFTER_S, 2.0 * wall)
        self._last_step_at = now

    def _act(self, flags: Flags) -> None:
        """Given the ranks' agreed flags: save and exit after SIGTERM, save when due,
        take a snapshot when due (see :meth:`Cadence.due`)."""
        sampler = self.state.sampler
        epoch_done = sampler is not None and sampler.remaining == 0
        if flags.leave > 0:  # a node was told it will go: a planned leave, now or at the
            self._departure.pending = True  # epoch's end (one step, one state)
            if not epoch_done:
                self._leave()
        if flags.stop > 0 or flags.finish > 0:
            if not epoch_done:
                self._exit_after_save(restart=flags.stop > 0)
            # The epoch's last step: saved now, in case the script's end-of-epoch work
            # outlasts torchrun's grace period; end_epoch saves it again with the epoch
            # closed and exits (it sees the stop through the agreed stop).
            self.save(blocking=True)
        self._take(*self._cadence.due(flags, self.every_steps, epoch_done))

    def _take(self, save: bool, snap: bool) -> None:
        if save:
            self.save(blocking=self.blocking)
        if snap:
            self._snapshot(periodic=True)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """A block of work that is not training (validation, logging, a hook).

        Its time is kept out of the step-time estimate that sets the automatic
        snapshot interval, so a long validation does not make snapshots more frequent:
        ``with ckpt.paused(): acc = validate(model, val_loader)``.
        """
        return self._not_training()

    @contextlib.contextmanager
    def _not_training(self) -> Iterator[None]:
        """Keep a block's time out of the step-time estimate (:meth:`Cadence.paused`):
        a user's block (:meth:`paused`) or the checkpointer's own blocking work (a
        blocking save, the epoch's end), whose seconds would otherwise count as
        training and shrink the automatic snapshot interval after each. Once: a save
        inside a user's paused block is not taken out twice."""
        if self._pausing:
            yield
            return
        self._pausing = True
        try:
            with self._cadence.paused():
                yield
        finally:
            self._pausing = False

    def end_epoch(self) -> None:
        """Close the epoch: check the audit, move to the next epoch, save.

        Collective. After it, ``state.epoch`` and the sampler are at the next epoch,
        position 0, and the checkpoint saved here says so.

        Raises:
            SampleAuditError: ``audit="error"`` and the epoch missed or repeated a sample.
        """
        self._require_restored("end_epoch")
        with self._not_training():
            self._end_epoch()

    def _require_restored(self, what: str) -> None:
        self._require_open(what)
        if not self._restored:
            raise RuntimeError(
                f"{what}() before restore(): start the loop with `for epoch in "
                f"range(ckpt.restore(), epochs)`. restore() loads the newest checkpoint "
                f"and installs the SIGTERM handler; without it a restart trains from "
                f"scratch beside its checkpoints, and a SIGTERM loses every step")

    def _require_open(self, what: str) -> None:
        """Refuse ``what`` on a closed (or abandoned) checkpointer: its store may be
        closed, its snapshots removed, its hooks and heartbeat gone, so a save would
        go unwaited-for and a SIGTERM unheard. A training thread that reaches here
        while another thread writes the last step and ends the process waits for that
        end instead."""
        if self._hooks.closed:
            self._hold_if_leaving()
            raise RuntimeError(
                f"{what}() on a closed Checkpointer: close() (or the end of its 'with' "
                f"block) ends it; make a new Checkpointer, and call its restore(), for "
                f"another phase of training")

    def _end_epoch(self) -> None:
        unstepped = self._progress.unstepped()
        if unstepped and not self._warned_unstepped and self.info.is_main:
            self._warned_unstepped = True
            log.warning("end_epoch(): %d of epoch %d's %d samples were never stepped, and "
                        "are not trained this epoch (%s; logged once)", unstepped,
                        self.state.epoch, self.state.sampler.dataset_length,
                        _UNSTEPPED_CAUSE)
        self.finish_audit()
        stop = self._cadence.agreed_stop()
        self._progress.next_epoch()
        if stop:
            self._exit_after_save(restart=stop == RESTART)
        if self._departure.pending:
            self._leave()
        self._step_end.record()  # the next epoch's start
        self._take(*self._cadence.at_epoch_end(self.save_at_epoch_end))

    def finish_audit(self) -> EpochAudit | None:
        """Check the current epoch's sample audit now (collective); None when off.

        :meth:`end_epoch` calls it; call it earlier to report the audit before
        end-of-epoch work (validation). Checking twice checks once.

        Raises:
            SampleAuditError: ``audit="error"`` and the epoch missed or repeated a sample.
        """
        return self._progress.finish_audit(self.audit, is_main=self.info.is_main)

    def save(self, *, blocking: bool = True) -> None:
        """Checkpoint the state now at ``state.step``. Collective.

        Every rank calls the store, the writer writes, and the ranks agree on the
        outcome: if the write failed on the writer (or an earlier non-blocking write
        did), every rank raises: the writer the write's own error (an ``OSError``
        naming the file for a full disk or a failed upload, a
        :class:`~elastic_kit.CheckpointError` for an object store client's own
        error), every other rank a :class:`~elastic_kit.CheckpointError` that names
        the writer's rank and quotes its error.
        """
        self._require_open("save")
        with self._not_training() if blocking else contextlib.nullcontext():
            self._save(blocking)

    def _save(self, blocking: bool) -> None:
        self._progress.sync_audit(self.audit)
        if self.store is None:
            return
        self._hooks.follow(self.state.optimizer)  # its step must wait for the copies
        _saving.save_durable(self.store, self.state, self.info, blocking=blocking,
                             overlap_staging=self.overlap_staging)
        self._last_saved_step = self.state.step
        if blocking:  # the ranks agreed it committed (a non-blocking one: not yet)
            self._committed_step = self.state.step
        self._cadence.saved()

    def snapshot(self) -> None:
        """Take an in-memory snapshot of the state now (collective when the audit is
        on; a no-op when snapshots are off). Written in the background by each node's
        local rank 0; a failure switches snapshots off with a warning."""
        self._require_open("snapshot")
        self._snapshot(periodic=False)

    def _snapshot(self, *, periodic: bool) -> None:
        if self.snapshots is None:
            return
        t0 = time.perf_counter()
        self._hooks.follow(self.state.optimizer)  # its step must wait for the copies
        writes = self.snapshots.writes
        # The state is taken before the audit's sum is started (taking it folds the
        # previous sum in); the writer thread adds this one, which training never waits for.
        state_dict = self.state.state_dict() if writes else None
        audit = self._progress.sync_audit_async(self.audit)
        if state_dict is not None:
            _saving.save_snapshot(self.snapshots, state_dict, self.state, self.info,
                                  overlap_staging=self.overlap_staging, started=t0,
                                  audit=audit, periodic=periodic)

