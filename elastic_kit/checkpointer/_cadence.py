"""When the ranks act together: the flag exchange and the one step-time estimate.

What one rank knows alone (a SIGTERM, rank 0's clock, rank 0's automatic snapshot
interval) must reach every rank so that all act at the same step; a collective per
step would cost short steps too much. :class:`Cadence` exchanges the ranks'
:class:`Flags` now and then through a small async all-reduce, and keeps the step-time
estimate both the exchange interval and the snapshot interval are budgets of.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import torch

from elastic_kit.distributed import (
    DistInfo, all_reduce_max, all_reduce_sum_async, is_dist_ready, settle_collectives,
)
from elastic_kit.state import TerminationFlag

if TYPE_CHECKING:
    from elastic_kit.snapshot import SnapshotTier
    from elastic_kit.state import TrainState

__all__ = ["Cadence", "Flags", "EXCHANGE_PERIOD_S", "MAX_EXCHANGE_EVERY"]

#: Seconds of training between two exchanges of the ranks' flags (see
#: :meth:`Cadence.poll`), and the most steps between two.
EXCHANGE_PERIOD_S = 0.2
MAX_EXCHANGE_EVERY = 64
#: Seconds an abandoning rank gives an exchange in flight to finish.
ABANDON_SETTLE_S = 1.0


class Flags(NamedTuple):
    """What the ranks agree on at an exchange, summed over ranks (in float64).

    ``stop``: a rank received SIGTERM; ``finish``: a rank asked to end training for
    good (``request_stop()``: save, exit 0, no restart); ``save_due``: rank 0's clock says a timed save
    is due; ``snapshot_every`` and ``exchange_every``: rank 0's proposed intervals
    (the other ranks send zeros, so the sum is rank 0's proposal; 0: no proposal);
    ``leave``: ranks told their node will go (a preemption notice: a planned leave);
    ``held_older`` and ``held_newer``: ranks holding their part of the second newest
    and the newest snapshot step taken (a sharded state, see
    :meth:`~elastic_kit.snapshot.SnapshotTier.part_report`).
    """

    stop: float = 0.0
    save_due: float = 0.0
    snapshot_every: float = 0.0
    exchange_every: float = 0.0
    leave: float = 0.0
    finish: float = 0.0
    held_older: float = 0.0
    held_newer: float = 0.0


#: What :meth:`Cadence.agreed_stop` answers: save and exit for a restart (SIGTERM), or
#: save and end training for good (a request to stop); the higher wins.
FINISH, RESTART = 1, 2

#: No flags: what the steps between two exchanges see.
NO_FLAGS = Flags()


class Cadence:
    """The flag exchange, the step-time estimate and the adopted intervals.

    Args:
        state: the train state (its ``step`` counts the steps between exchanges).
        info: this worker's :class:`~elastic_kit.DistInfo` (reassigned by the
            checkpointer's restore).
        stop: this rank's SIGTERM flag.
        every_seconds: the timed save interval (rank 0's clock decides), or None.
        tier: the snapshot tier whose interval the exchanges set, or None; asked at
            each use, as its owner sets it up (or replaces it) after construction.
        leaving: whether this rank was told its node will go.
    """

    def __init__(self, state: TrainState, info: DistInfo, stop: TerminationFlag,
                 every_seconds: float | None, *,
                 tier: Callable[[], SnapshotTier | None] = lambda: None,
                 leaving: Callable[[], bool] = lambda: False,
                 finish: Callable[[], bool] = lambda: False) -> None:
        self.state = state
        self.info = info
        self.every_seconds = every_seconds
        self._tier = tier
        self._stop = stop
        self._leaving = leaving
        self._finish = finish
        self._flags: Any = None  # the previous exchange's async all-reduce (see poll)
        #: an exchange read early (by :meth:`agreed_stop`), for the next :meth:`poll`
        self._early: Flags | None = None
        self.exchange_every = 1  # steps between exchanges, agreed by all ranks
        self._until_exchange = 1
        self._exchange_t: float | None = None  # rank 0: when the previous exchange ran
        self._exchange_step = 0
        self.step_s: float | None = None  # rank 0: the step time estimate (the only one)
        #: rank 0: the wall time of a step, hooks included: the exchange interval's
        #: measure (a stop must reach every rank within a fixed wall time, torchrun's
        #: grace, however long a step's hooks take)
        self.wall_step_s: float | None = None
        self._hooks_s = 0.0  # time in the loop's hooks since the previous exchange
        self.last_save_time = time.monotonic()
        #: rank 0 sent a timed save's flag that no save has answered yet: the save
        #: comes when that exchange is read, an exchange later, and the next exchange
        #: (sent before it) must not ask for a second one
        self._time_due_sent = False
        #: a save came while an exchange was in flight: a timed save that exchange
        #: asks for was answered by it (every rank saves at the same step: alike)
        self._answered_in_flight = False
        # A save or snapshot due at an epoch's last step waits for end_epoch (or the
        # next step), so what is kept of that step describes the closed epoch.
        self._save_pending = False
        self._snapshot_pending = False

    def due(self, flags: Flags, every_steps: int | None, epoch_done: bool) -> tuple[bool, bool]:
        """Whether a save and a snapshot are due after this step, given the agreed flags.

        A fixed snapshot interval is known to every rank; an automatic one is rank
        0's proposal, agreed through the exchanges (see :meth:`poll`). At an epoch's
        last step neither is taken now: one step, one state, so what is kept of that
        step is taken by the epoch's end (:meth:`at_epoch_end`), with the epoch
        closed, and a snapshot and a durable checkpoint of it never disagree.
        """
        step = self.state.step
        save = every_steps is not None and step % every_steps == 0
        save = save or flags.save_due > 0 or self._save_pending
        tier = self._tier()
        snap = tier is not None and (tier.due(step) or self._snapshot_pending)
        if epoch_done:
            self._save_pending = self._save_pending or save
            self._snapshot_pending = self._snapshot_pending or snap
            return False, False
        self._save_pending = self._snapshot_pending = False
        return save, snap

    def at_epoch_end(self, save_at_epoch_end: bool) -> tuple[bool, bool]:
        """Whether the epoch's end saves and snapshots (what its last step left due)."""
        save, snap = save_at_epoch_end or self._save_pending, self._snapshot_pending
        self._save_pending = self._snapshot_pending = False
        return save, snap

    def saved(self) -> None:
        """A save just finished: the timed save interval starts again now (and a
        timed save's flag read early, not acted on yet, is answered by it)."""
        self.last_save_time = time.monotonic()
        self._time_due_sent = False
        if self._early is not None and self._early.save_due:
            self._early = self._early._replace(save_due=0.0)
        self._answered_in_flight = self._flags is not None

    def poll(self) -> Flags:
        """The ranks' agreed :class:`Flags`, or no flags (zeros) between exchanges.

        An *exchange* is issued after one step and read at the next exchange, so it
        never waits on the critical path, and every rank acts on it at the same step.
        Even an overlapped collective costs a short step something (a gloo
        all-reduce takes its thread ~1 ms on a busy CPU): exchanges run about every
        :data:`EXCHANGE_PERIOD_S` seconds of training (every step when steps are
        longer), at an interval rank 0 proposes from its step time and all ranks
        adopt at the same exchange. A SIGTERM is thus acted on within two exchange
        periods.
        """
        if self.info.world_size == 1 or not is_dist_ready():
            flags = self.local_flags()
            self.adopt(flags)
            return flags
        self._until_exchange -= 1
        if self._until_exchange > 0:
            return NO_FLAGS
        previous = self.resolve()
        self.adopt(previous)
        self._until_exchange = self.exchange_every
        self._flags = all_reduce_sum_async(torch.tensor(self.local_flags(),
                                                        dtype=torch.float64))
        return previous

    def adopt(self, flags: Flags) -> None:
        """Take rank 0's proposals carried by an exchange (every rank at once)."""
        if flags.exchange_every >= 1:
            self.exchange_every = int(flags.exchange_every)
        tier = self._tier()
        if tier is not None and flags.snapshot_every >= 1:
            tier.interval = int(flags.snapshot_every)
        if tier is not None:
            tier.parts_agreed((flags.held_older, flags.held_newer), self.info.world_size)

    def local_flags(self) -> Flags:
        """This rank's flags; only rank 0 proposes intervals (the others send zeros).

        On rank 0 it also updates the step-time estimate from the training time
        since the previous exchange, less the time handed to :meth:`exclude_time`.
        """
        main = self.info.is_main
        now = time.monotonic()
        time_due = (self.every_seconds is not None and main and not self._time_due_sent
                    and now - self.last_save_time >= self.every_seconds)
        self._time_due_sent = self._time_due_sent or time_due
        snap_every = exchange_every = 0
        if main:
            tier = self._tier()
            steps = self.state.step - self._exchange_step
            if self._exchange_t is not None and steps > 0:
                dt = max(now - self._exchange_t - self._hooks_s, 0.0) / steps
                self.step_s = dt if self.step_s is None else 0.5 * (self.step_s + dt)
                wall = (now - self._exchange_t) / steps
                self.wall_step_s = (wall if self.wall_step_s is None
                                    else 0.5 * (self.wall_step_s + wall))
            snap_every = tier.proposal(self.step_s) if tier is not None else 0
            self._exchange_t, self._exchange_step = now, self.state.step
            self._hooks_s = 0.0
            # in wall time: the hooks' time counts here (a 0.5 s on_step_end after a
            # 2 ms step made it 64 steps, 32 s, and a SIGTERM waited past torchrun's
            # 30 s grace for the exchange that carries it)
            exchange_every = max(1, min(MAX_EXCHANGE_EVERY, int(
                EXCHANGE_PERIOD_S / self.wall_step_s))) if self.wall_step_s else 1
        tier = self._tier()
        held = tier.part_report() if tier is not None else (0.0, 0.0)
        return Flags(float(self._stop.is_set()), float(time_due), float(snap_every),
                     float(exchange_every), float(self._leaving()), float(self._finish()),
                     *held)

    def exclude_time(self, seconds: float) -> None:
        """Keep ``seconds`` (spent in a user hook: validation, logging) out of the
        step time the exchange and snapshot intervals are budgets of, so a long hook
        does not make snapshots more frequent for a while."""
        self._hooks_s += seconds

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A block whose time :meth:`exclude_time` keeps out of the step time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.exclude_time(time.perf_counter() - t0)

    def resolve(self) -> Flags:
        """Wait for the exchange in flight, if any, and return its flags (or those of
        an exchange :meth:`agreed_stop` read early, not yet returned)."""
        early, self._early = self._early, None
        if self._flags is None:
            return early or NO_FLAGS
        flags, self._flags = Flags(*self._flags().tolist()), None
        if self._answered_in_flight:
            flags, self._answered_in_flight = flags._replace(save_due=0.0), False
        if early is not None:  # two exchanges: what either carries counts
            flags = Flags(*(max(a, b) for a, b in zip(early, flags)))
        return flags

    def abandon(self, *, settle: bool = True) -> None:
        """Forget the exchange in flight, on this rank alone, while an exception
        propagates: a failing peer may never join it, so it is not waited for, but
        given :data:`ABANDON_SETTLE_S` to finish and kept from being freed on the
        backend's thread. ``settle=False`` at interpreter exit, where the library's
        own exit handler settles every collective next, more briefly."""
        self._flags = self._early = None
        self._answered_in_flight = False
        if settle:
            settle_collectives(ABANDON_SETTLE_S)

    def agreed_stop(self) -> int:
        """Every rank learns at once whether any rank received SIGTERM (collective):
        :data:`RESTART` when one did, else :data:`FINISH` when one asked to end
        training for good, else 0.

        The exchange in flight is read here; its flags are kept for the next
        :meth:`poll` (every rank alike), so an end of epoch that comes before every
        exchange (epochs shorter than the exchange interval) drops no leave, no save
        and no proposal."""
        early = self.resolve() if is_dist_ready() else NO_FLAGS
        self._early = early if early != NO_FLAGS else None
        mine = (RESTART if self._stop.is_set() or early.stop > 0
                else FINISH if self._finish() or early.finish > 0 else 0)
        if is_dist_ready() and self.info.world_size > 1:
            return int(all_reduce_max(mine))
        return mine
