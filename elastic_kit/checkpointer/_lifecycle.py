"""How a checkpointer ends: on request (SIGTERM or :meth:`request_stop`: save and
exit), by a planned leave (a preemption notice), collectively when training is over,
or on one rank alone while an exception propagates.

The last two differ in the one thing that matters on a failing group: whether a
collective may run. Kept apart from the training-time methods so that difference is
read in one place.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from elastic_kit._console import exit_now, say

import elastic_kit.health as health
from elastic_kit.checkpointer import _saving
from elastic_kit.distributed import all_reduce_max, is_dist_ready
from elastic_kit.state import plain_rng_state

if TYPE_CHECKING:
    from elastic_kit.checkpointer._cadence import Cadence
    from elastic_kit.checkpointer._departure import Departure
    from elastic_kit.checkpointer._hooks import Hooks
    from elastic_kit.checkpointer._progress import Progress
    from elastic_kit.checkpointer._step_end import StepEnd
    from elastic_kit.checkpointer._store_like import StoreLike
    from elastic_kit.distributed import DistInfo
    from elastic_kit.health import Heartbeat
    from elastic_kit.snapshot import SnapshotTier
    from elastic_kit.state import TrainState

__all__ = ["FinishedEarly", "Lifecycle"]


class FinishedEarly(SystemExit):
    """``SystemExit(0)`` after the save that a request to end training for good
    (``request_stop()``) made: a script's own loop exits with status 0, so torchrun
    ends the job; :class:`~elastic_kit.ElasticLoop` catches it and returns."""

log = logging.getLogger(__name__)

_Self = TypeVar("_Self", bound="Lifecycle")

#: Seconds a rank that abandons its checkpointer waits for the audit's sum of its last
#: snapshot (the peers that are alive joined it within milliseconds; a dead one never
#: does, and waiting longer would only delay the exit, and so the restart).
AUDIT_GRACE_S = 0.5

#: Seconds a rank that leaves a silent peer behind gives the write of its last step
#: (and of a checkpoint in flight) before it exits anyway: a write that hangs must not
#: keep the process, and so the restart, waiting.
SILENT_EXIT_WRITE_S = 20.0


class Lifecycle:
    """The closing half of :class:`~elastic_kit.Checkpointer` (a base it builds on)."""

    store: StoreLike | None
    snapshots: SnapshotTier | None
    info: DistInfo
    _owns_store: bool
    _last_saved_step: int | None
    _committed_step: int | None
    _hooks: Hooks
    _cadence: Cadence
    _heartbeat: Heartbeat | None
    _departure: Departure
    state: TrainState
    exit_code: int
    replays_epoch_end: bool
    save: Callable[..., None]  # the Checkpointer's methods
    snapshot: Callable[[], None]
    audit: str
    _progress: Progress
    _step_end: StepEnd
    _leaving: threading.Event  # set once another thread writes the last step
    _left: threading.Event  # ... and once that write is done
    _abandoning: threading.Event  # set once the training thread abandons (writes it)
    _abandoned: threading.Event  # ... and once that is done
    _leave_lock: threading.Lock

    @property
    def stop_requested(self) -> bool:
        """True once this rank received SIGTERM (or :meth:`request_stop` was called,
        either way)."""
        return self._hooks.stop.is_set() or self._hooks.finish.is_set()

    def request_stop(self, *, restart: bool = False) -> None:
        """Save and end training soon: every rank at the same step, within about 0.4 s
        of training after the call (one rank's call is enough: the ranks agree at
        their next flag exchange), or at the epoch's end.

        ``restart=False``: training ends for good (early stopping, a time budget):
        every rank saves and exits with status 0 (``SystemExit(0)`` from
        :meth:`step` or :meth:`end_epoch`), so torchrun ends the job instead of
        restarting it; :class:`~elastic_kit.ElasticLoop`'s ``run()`` returns instead.
        The in-memory snapshots are removed, as at :meth:`close`. ``restart=True``:
        as after SIGTERM (see ``handle_signals``): exit with ``exit_code``, which
        torchrun answers with a restart of the group (a SIGTERM wins over a request
        to end made at the same time)."""
        if restart:
            self._hooks.stop.set()
        else:
            self._hooks.finish.set()

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest durable checkpoint saved (a non-blocking one: handed
        to the store, committed by the next save or ``close``) or restored from the
        durable store here, or None. A restore from memory does not count, even of
        the state the store's newest manifest names: nothing verified the store's
        bytes of it, and the snapshot may be the only good copy."""
        return self._last_saved_step

    def close(self) -> None:
        """Wait for the in-flight save (re-raising its error) and uninstall the hooks.

        Collective. Closes the store when the checkpointer made it from a URL, and
        removes this run's in-memory snapshots (training is over: the durable store
        holds the result), except where the run ends at the step a restore from memory
        put it at and nothing saved it since (it was killed in its final save): that
        state is nowhere else, and its snapshots stay (with a warning). Safe to call
        twice; every other method of a closed checkpointer raises ``RuntimeError``
        (another phase of training makes a new one).
        """
        self._close(remove_snapshots=True)

    def _close(self, *, remove_snapshots: bool,
               staying: Sequence[int] | None = None) -> None:
        # the signal handlers stay until the last save is written: a SIGTERM meanwhile
        # (a scheduler's time limit, torchrun's restart) took the default action and
        # ended the process with the final checkpoint half written; it is noted, and
        # given what it had before the checkpointer once the save is in (so is one
        # noted since the last step and not acted on: end_epoch() had returned)
        stop = self._hooks.stop
        acted = stop.acknowledged  # a stop already acted on (its save, then this)
        if not self._hooks.close(keep_signals=True):
            return
        stop.acknowledge(unheard=True)  # the final save: its watcher must not end it
        previous: Any = None
        try:
            self._close_store(remove_snapshots, staying=staying)
        finally:
            got = stop.received
            if got is not None:
                previous = stop.previous_handler(got)
            stop.uninstall()
        if acted or got is None:
            return
        # the signal now gets what it had before the checkpointer: the script's own
        # handler is called, an ignored one stays ignored; the default ends the process
        # (as the stop does: with exit_code)
        if previous is signal.SIG_IGN:
            return
        if callable(previous) and previous is not signal.default_int_handler:
            previous(got, None)
            return
        if self.info.is_main:
            say(log, "%s as training ended: the last checkpoint was written first; "
                     "exiting with status %d", signal.Signals(got).name, self.exit_code)
        raise SystemExit(self.exit_code)

    def _close_store(self, remove_snapshots: bool, *,
                     staying: Sequence[int] | None = None) -> None:
        if (remove_snapshots and staying is None and self.restored_from in ("memory", "peer")
                and self.restored_step == self.state.step
                and self._last_saved_step != self.state.step):
            # the run ended where a restore from memory put it (killed in its final
            # save, restarted with nothing left to train): that state is nowhere else
            remove_snapshots = False
            if self.info.is_main:
                log.warning("step %d was restored from memory and not saved since: its "
                            "snapshots are kept (ckpt.save() before close() writes it to "
                            "the durable store)", self.state.step)
        try:
            self._stop_heartbeat()
            if is_dist_ready():
                self._cadence.resolve()
            if self.store is not None:
                _saving.close_store(self.store, self.snapshots, self.info,
                                    remove_snapshots=remove_snapshots,
                                    owns_store=self._owns_store, staying=staying,
                                    # SIGTERM: the agent stops this worker, and waits
                                    # no longer than its grace
                                    give_up=lambda: self._hooks.stop.received is not None)
        except BaseException:
            # a collective failed (a peer died as training ended) or the last save
            # did: the hooks are gone, so no abandon follows (the ``with`` block's
            # nor the one at exit); this rank's own writes still finish here, as
            # when abandoning, before the error reaches the script (the writers are
            # daemon threads: the process's exit would cut a write off)
            self._cadence.abandon(settle=False)
            _saving.abandon(self.store, self.snapshots)
            raise

    def abandon(self) -> None:
        """Close on this rank alone, while an exception propagates (possibly on this
        rank only): no collective, or it would block on its peers or match one of
        their collectives. A pending save's failure is logged, not raised. What
        ``with Checkpointer(...)`` runs when its block raises."""
        self._abandon()

    def _abandon(self, *, at_exit: bool = False) -> None:
        # SIGTERM (torchrun stopping the group, likely now: a peer failed) is only
        # noted until what this rank took, and its last step, are written; then the
        # exchange in flight is let go.
        with self._leave_lock:  # closed and abandoning at once, for a leave's write
            closed = self._hooks.close(keep_signals=True)
            if closed:
                self._abandoning.set()
        if not closed:
            if self._leaving.is_set():
                # another thread writes the last step (the heartbeat's, the SIGTERM
                # watcher's) and then ends the process: this one, on its way out
                # (an exception, the interpreter's exit), must not end it first
                self._left.wait(SILENT_EXIT_WRITE_S)
            return
        if at_exit and getattr(sys, "last_value", None) is None and self.snapshots is not None:
            # no uncaught exception: the script ended (or called sys.exit) without
            # close(), so its memory stays as a failed worker's would
            log.warning("the script exited without ckpt.close(): this rank's snapshot in "
                        "%s is kept for a restart, as after a failure; call close() (or use "
                        "'with Checkpointer(...)') when training ends, or, with no restart "
                        "to come, remove it with 'python -m elastic_kit snapshots --remove "
                        "--idle-minutes 0'",
                        self.snapshots.run_dir)
        try:
            self._stop_heartbeat()
            # the audit sum of a snapshot in flight: a dead peer never joins it
            self._progress.give_up_audit_sum(grace=AUDIT_GRACE_S)
            self._snapshot_at_exit()
            _saving.abandon(self.store, self.snapshots)
        finally:
            self._hooks.stop.uninstall()
            self._abandoned.set()
        self._cadence.abandon(settle=not at_exit)

    def _abandon_at_exit(self) -> None:
        """:meth:`abandon` at interpreter exit, for a script that never closed (it died
        of an exception): what was taken is written. The exchange in flight is not
        given its own wait: the collectives' exit handler, which runs next, settles
        it, so a worker whose peer died exits no later than before."""
        self._abandon(at_exit=True)

    def _leave_silent(self, rank: int, seconds: float) -> None:
        """The heartbeat's action on a silent peer, on the heartbeat's thread: write the
        last step, then end the process (:func:`elastic_kit.health.exit_for_silence`).
        The training thread sits in a collective the silent host never joins, and only
        ending the process ends it (see :meth:`_leave_alone`)."""
        self._leave_alone(f"leaving silent rank {rank} behind",
                          lambda: health.exit_for_silence(rank, seconds))

    def _stop_received(self, signum: int) -> None:
        """In the stop signal's handler, as it comes: the durable store's background
        sharded saves give up a peer silent for seconds from now on. torchrun sends
        it when a worker failed (a peer likely died in a save), and the training
        thread may sit in the next ``save()`` or in ``close()``, waiting for the
        save in flight: it would wait the healthy group's 300 s, past torchrun's
        grace, where now the save fails and the script hears of it. A live peer in
        the save keeps it going."""
        _saving.give_up_on_silent_peers(self.store)

    def _leave_unheard(self, signum: int) -> None:
        """The SIGTERM watcher's action when the training thread did not hear the
        signal (it sits in a collective whose peer is gone, which never fails: NCCL's,
        or gloo's with a frozen peer), or heard it but did not act on it in
        :data:`~elastic_kit.state.UNACTED_AFTER_S` seconds (the script is in
        end-of-epoch work, a validation, and reaches neither :meth:`step` nor
        :meth:`end_epoch` before torchrun's SIGKILL): write the last step, then exit
        with ``exit_code`` (see :meth:`_leave_alone`). A heard signal with no
        snapshot to write leaves the script alone: it may still reach its save in
        time, and exiting now would gain nothing."""
        heard = self._hooks.stop.heard
        if heard and not (self.snapshots is not None and self.snapshots.writes
                          and self.snapshots.enabled):
            log.warning("rank %d: signal %d not acted on yet and no in-memory snapshot to "
                        "write: the stop's save waits for the next step() or end_epoch()",
                        self.info.rank, signum)
            return
        why = (f"signal {signum} heard but not acted on (away from the training steps)"
               if heard else f"signal {signum} unheard by the training thread")
        # a stop heard during end-of-epoch work keeps the epoch's last step, as the
        # stop's own save there does (the work was cut short either way)
        self._leave_alone(why, lambda: exit_now(self.exit_code), stopping=heard)

    def _leave_alone(self, why: str, leave: Callable[[], None], *,
                     stopping: bool = False) -> None:
        """Write the last step from this thread, then ``leave()`` (which ends the
        process): what :meth:`abandon` does on the training thread, for a training
        thread that will not return. The audit sum in flight is given up and the state
        of the last step every rank finished is written to this node's memory (the
        writes are waited for, at most :data:`SILENT_EXIT_WRITE_S` seconds). The
        optimizer's pre-hook stays: should the training thread reach the optimizer's
        step meanwhile, it is held there, so the state is never copied while it
        changes. A second caller (the heartbeat and the SIGTERM watcher both) waits
        for the first's write, then leaves; so does a caller that finds the training
        thread abandoning the checkpointer (:meth:`abandon`, which writes the same
        last step), and the training thread abandoning it after this began waits for
        this write (both at most :data:`SILENT_EXIT_WRITE_S` seconds)."""
        with self._leave_lock:
            first = not self._leaving.is_set()
            self._leaving.set()
        if not first:
            self._left.wait(SILENT_EXIT_WRITE_S)
            leave()
            return

        def write() -> None:
            try:
                with self._leave_lock:  # abandon closes the hooks and says so at once
                    mine = self._hooks.close(keep_signals=True, keep_step_hook=True)
                if mine:
                    self._progress.give_up_audit_sum(grace=AUDIT_GRACE_S)
                    self._snapshot_at_exit(stopping=stopping)
                    if self.snapshots is not None:
                        self.snapshots.close(remove=False, flush=False)
                    _saving.abandon(self.store, None)
                elif self._abandoning.is_set():  # the training thread writes it
                    self._abandoned.wait(SILENT_EXIT_WRITE_S)
            except BaseException as e:  # exiting anyway: say why nothing was written
                log.warning("rank %d %s: writing the last step failed: %r",
                            self.info.rank, why, e)
            finally:
                self._left.set()

        threading.Thread(target=write, name="elastic-kit-last-step", daemon=True).start()
        if not self._left.wait(SILENT_EXIT_WRITE_S):
            log.warning("rank %d %s: the last step's write did not finish in %.0f s; "
                        "exiting without it", self.info.rank, why, SILENT_EXIT_WRITE_S)
        leave()

    def _hold_if_leaving(self) -> None:
        """Called by the optimizer's pre-hook after it marked the step as changing the
        state: while the heartbeat's thread writes the last step and ends the
        process, the training thread waits here for that end."""
        if self._leaving.is_set():
            threading.Event().wait()

    def _snapshot_at_exit(self, *, stopping: bool = False) -> None:
        """Write the state of the last step to this node's memory as this rank exits
        alone (a peer died in the step in progress; see
        :mod:`elastic_kit.checkpointer._step_end`): when this rank writes snapshots, the
        state is still that step's and no snapshot of it was written nor a save of it
        made. Not after an epoch's last step before :meth:`end_epoch` unless
        ``stopping`` (a stop signal heard there, whose own save keeps that step) or
        :attr:`replays_epoch_end`. Never raises."""
        tier, step_end = self.snapshots, self._step_end
        mark = step_end.intact() if tier is not None and tier.writes and step_end.enabled \
            else None
        # A snapshot of the step taken but not written yet is replaced (queued) or
        # followed (being written) by this one: its audit sum may never arrive.
        # (a non-blocking save of the step counts only once it is known committed: the
        # writer may be the peer that died with it in flight)
        if tier is None or mark is None or mark.step == self._committed_step or \
                mark.step in tier.written:
            return
        sampler = self.state.sampler
        if not (self.replays_epoch_end or stopping) and sampler is not None and \
                getattr(sampler, "remaining", None) == 0:
            # the epoch's last step, before end_epoch(): the script's end-of-epoch work
            # (its validation, where the peer died; a per-epoch scheduler step after
            # it) is not in this state, and a restore of it moves on to the next epoch
            # without that work. Periodic saves wait for end_epoch() there; so does this
            # (unless the script does that work again after such a restore).
            log.warning("rank %d exits alone after epoch %d's last step (step %d), before "
                        "end_epoch(): no snapshot of it (a restore would skip the epoch's "
                        "end); the restart resumes from the newest earlier state",
                        self.info.rank, sampler.epoch, mark.step)
            return
        try:
            audit, derived = (None, None) if self.audit == "off" else \
                self._progress.audit_at_step_end(timeout=0.0)
            with step_end.reading(mark):  # on a GPU: not behind a hung collective
                state_dict = self.state.state_dict(rng=False)
                state_dict["rng"] = plain_rng_state(mark.rng)
                if audit is not None:
                    state_dict["audit"] = audit
                model = state_dict["model"]
                for name, kept in step_end.buffers_at_mark().items():
                    if name in model:  # a persistent buffer (a forward pass may change it)
                        model[name] = kept
                meta: dict[str, Any] = {**_saving.metadata(self.state, self.info),
                                        "at_exit": True}
                if derived is not None:
                    meta["audit_derived"] = derived
                tier.save(state_dict, step=mark.step, metadata=meta, last=True)
            log.warning("rank %d exits alone: snapshot of step %d taken (a restart "
                        "redoes only the step in progress)%s", self.info.rank, mark.step,
                        "" if derived is None else
                        f"; epoch {derived[0]}'s positions {derived[1]}..{derived[2]} are "
                        "audited from the sampler's position")
        except Exception as e:  # the process is failing: say so, never hide its error
            log.warning("no snapshot of step %d at exit: %r", mark.step, e)

    def _exit_after_save(self, *, restart: bool = True) -> None:
        self._hooks.stop.acknowledge()  # the stop has begun: its watcher waits no longer
        store = self.store
        earlier = getattr(store, "take_pending_error", None)
        failed = earlier() if callable(earlier) else None
        if failed is not None:  # said here; the save below is this exit's own attempt
            log.warning("an earlier background checkpoint failed: %r; saving step %d now",
                        failed, self.state.step)
        self.save(blocking=True)
        saved = (f"checkpoint step {self.state.step} saved" if self.store is not None
                 else f"no store: step {self.state.step} not saved")
        if not restart:
            if self.info.is_main:
                say(log, "stop requested: %s; training ends (exit status 0)", saved)
            self._close(remove_snapshots=True)  # training is over, as at close()
            raise FinishedEarly(0)
        if self.info.is_main:
            got = self._hooks.stop.received  # None: a request, or another rank's signal
            # torchrun's agent passes SIGINT and SIGHUP on as it ends the whole job
            # a SIGTERM does not say which: torchrun restarting the group (a peer
            # failed, a node joins) or torchrun itself stopped (the job ends)
            then = ("the job ends" if got in (signal.SIGINT, signal.SIGHUP)
                    else "torchrun restarts the group (or, if the job is ending, a "
                    "relaunch resumes there)")
            say(log, "%s: %s; exiting with status %d so %s",
                signal.Signals(got).name if got is not None else "stop", saved,
                self.exit_code, then)
        self._close(remove_snapshots=False)  # the next group resumes from them
        raise SystemExit(self.exit_code)

    def _leave(self) -> None:
        def snapshot() -> bool:
            self.snapshot()
            # only the writing ranks learn that snapshots failed: every rank must take
            # the same branch (a durable save is collective)
            off = int(self.snapshots is None or not self.snapshots.enabled)
            return not (all_reduce_max(off) if is_dist_ready() else off)

        def close(staying: list[int]) -> None:
            # A node that leaves while others stay removes its snapshots: after the
            # close's barrier the step is in the memory of the nodes that stay (their
            # own parts and the replicas streamed to them) or in the durable store,
            # and this host may stay up (a notice cancelled, a node handed back to a
            # shared pool), holding twice a state's size or more. The nodes that
            # stay, and every node when all leave, keep theirs for the restart.
            self._close(remove_snapshots=bool(staying) and self.info.rank not in staying,
                        staying=staying)

        self._departure.leave(self.info, self.state.step, snapshot=snapshot, save=self.save,
                              close=close, exit_code=self.exit_code)

    def _stop_heartbeat(self) -> None:
        # a goodbye first: a peer that finished (or failed in Python) is not silent
        if self._heartbeat is not None:
            self._heartbeat.close()
            self._heartbeat = None
        self._departure.close()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()
