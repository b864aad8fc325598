"""Gather and broadcast through the process group's key-value store, off the main thread.

A background (non-blocking) sharded save must exchange its ranks' file entries and
rank 0's verdict while the training thread runs its own collectives. A collective
issued from a second thread would pair with the training thread's gradient
all-reduce on another rank; the key-value store (``TCPStore``) has no such order: each
exchange is keys named after the save and a call counter, set by one rank and polled
(``check``, never a blocking ``wait`` that would hold the client's lock) by the
others. Payloads are pickled, as ``broadcast_object`` does: the store belongs to the
job, not to storage anyone may edit.

The keys name the save by its store, its step and how many background saves of that
step this process made (the caller's prefix), never by a count of all saves: a rank
that fails one save before its exchange cannot shift every later save of its peers
onto another step's keys.

A wait fails only once the ranks it waits for showed no sign of life for ``timeout``
seconds: every rank taking part bumps a progress counter of its own while it is in
the save (writing its shards, or rank 0 its replicated payload and the manifest), so
a slow but working peer is waited for and a dead one fails the save in bounded time.
A peer alive but stuck (a write that never returns) is waited for at most
:data:`MOST_TIMEOUTS` timeouts in all.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Collection

from elastic_kit.errors import CheckpointError

__all__ = ["KvExchange", "MOST_TIMEOUTS", "BEAT_S", "LOOK_S"]

#: The longest one wait lasts, in timeouts, however long the ranks it waits for show
#: progress (a rank whose write hangs keeps beating: its beats come from a thread).
MOST_TIMEOUTS = 12
#: The longest pause between two progress beats of a rank in a save (seconds): short
#: enough that a hurried wait (see :meth:`KvExchange.hurry`) tells a silent peer from
#: a working one within a few beats, long enough that a job of thousands of ranks
#: adds little traffic to its key-value store.
BEAT_S = 5.0
#: The longest pause between two looks at the awaited ranks' progress, unhurried (each
#: look reads one key per awaited rank).
LOOK_S = 15.0


class KvExchange:
    """``gather`` / ``broadcast`` for one background save (see the module docstring).

    Args:
        kv: the process group's key-value store (``_get_default_store()``).
        prefix: keys of this save (unique in the job: its store, step and attempt).
        rank, world_size: this rank's place in the group.
        timeout: seconds to wait without any sign of progress from the awaited ranks
            before failing the save.
        presumed_silent: ranks an earlier save's hurried wait gave up: once hurried,
            a wait for them fails when they show no sign within one beat (neither
            their entry nor progress), instead of the whole hurried time again.
    """

    def __init__(self, kv: Any, prefix: str, rank: int, world_size: int,
                 timeout: float, presumed_silent: Collection[int] = ()) -> None:
        self.kv, self.prefix = kv, prefix
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        #: ranks an earlier hurried wait gave up (see hurry()); a live view when given
        #: a set (its owner adds to it)
        self.presumed_silent = presumed_silent
        #: the ranks this exchange gave up as silent (set as it fails for them)
        self.silent: frozenset[int] = frozenset()
        self._calls = 0
        # beat well within the timeout (at least every BEAT_S, so that a peer's silence
        # shows within seconds once hurried: see hurry())
        self._beat_every = max(min(timeout / 5, BEAT_S), 0.01)
        self._hurried: tuple[float, float] | None = None
        self._stop: threading.Event | None = None
        self._beater: threading.Thread | None = None

    def _key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    # ------------------------------------------------------------------ progress
    def start_beating(self) -> None:
        """Bump this rank's progress counter until :meth:`close` (on a thread of its
        own: the save's thread may sit in one long write). Called by the first
        exchange at the latest; a save calls it as it begins, so that the work before
        its first exchange (rank 0's storage calls: a slow listing, a retried request)
        shows as progress too."""
        if self._beater is not None:
            return
        stop = threading.Event()
        key = self._key("alive", self.rank)
        # at once: a rank in the save shows it from its first exchange on (a peer
        # that presumes it silent looks one beat later)
        self.kv.add(key, 1)

        def beat() -> None:
            while not stop.wait(self._beat_every):
                try:
                    self.kv.add(key, 1)
                except Exception:  # pragma: no cover - a closed store: the save fails anyway
                    return

        self._stop = stop
        self._beater = threading.Thread(target=beat, name="ek-save-alive", daemon=True)
        self._beater.start()

    def _progress(self, ranks: list[int]) -> int:
        return sum(int(self.kv.add(self._key("alive", r), 0)) for r in ranks)

    def _poll(self, keys: dict[int, str], what: str) -> None:
        """Wait until every rank's key in ``keys`` (rank -> key) is set; only the
        progress of the ranks whose keys are still missing counts. A rank that gives
        up says so (one key): the others stop waiting at their next look, where
        they would wait for its entries until they gave up in turn."""
        try:
            self._wait_for(keys, what)
        except CheckpointError:
            try:
                self.kv.set(self._key("left"), str(self.rank).encode())
            except Exception:  # pragma: no cover - a closed store: its peers give up too
                pass
            raise

    def _wait_for(self, keys: dict[int, str], what: str) -> None:
        now = time.monotonic()
        deadline, pause = now + self.timeout, 0.002
        longest = now + MOST_TIMEOUTS * self.timeout
        waiting = dict(keys)
        seen, look_at = self._progress(list(waiting)), now + self._look_every()
        last_sign = now
        presumed_until = now + self._beat_every
        while not self.kv.check(list(waiting.values())):
            now = time.monotonic()
            if self._hurried is not None and self.presumed_silent and now > presumed_until:
                self._give_up_presumed(waiting, what)
                presumed_until = float("inf")
            if now >= look_at:
                if self.kv.check([self._key("left")]):
                    left = self.kv.get(self._key("left")).decode()
                    raise CheckpointError(
                        f"background sharded save {self.prefix}: rank {self.rank} stopped "
                        f"waiting for {what}: rank {left} gave up this save")
                waiting = {r: k for r, k in waiting.items() if not self.kv.check([k])}
                progress = self._progress(list(waiting))
                if progress > seen:  # alive and still in this save: wait on
                    deadline, last_sign = now + self.timeout, now
                seen, look_at = progress, now + self._look_every()
            elif self._hurried is not None:
                look_at = min(look_at, now + self._look_every())
            limit, hurried, until = self.timeout, self._hurried, deadline
            if hurried is not None and max(hurried[0], last_sign) + hurried[1] < until:
                limit, until = hurried[1], max(hurried[0], last_sign) + hurried[1]
            if now > until:
                self.silent = frozenset(r for r, k in waiting.items() if not self.kv.check([k]))
                raise CheckpointError(
                    f"background sharded save {self.prefix}: rank {self.rank} waited "
                    f"{limit:g} s for {what} with no sign of progress (did a rank fail "
                    f"or leave?)")
            if now > longest:
                raise CheckpointError(
                    f"background sharded save {self.prefix}: rank {self.rank} waited "
                    f"{MOST_TIMEOUTS * self.timeout:g} s for {what}, which kept showing "
                    f"progress (a write that never ends?)")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _give_up_presumed(self, waiting: dict[int, str], what: str) -> None:
        """Fail the wait if a rank presumed silent still gave no sign of being in
        this save (no entry, no progress beat) one beat after the wait began."""
        gone = sorted(r for r, k in waiting.items()
                      if r in self.presumed_silent and not self.kv.check([k])
                      and int(self.kv.add(self._key("alive", r), 0)) == 0)
        if gone:
            self.silent = frozenset(gone)
            raise CheckpointError(
                f"background sharded save {self.prefix}: rank {self.rank} gave up "
                f"waiting for {what}: rank(s) {gone}, silent in an earlier save, showed no "
                f"sign of progress in this one (did a rank fail or leave?)")

    def _look_every(self) -> float:
        """Seconds between two looks at the progress: twice per beat once hurried,
        else as rarely as the timeout allows (a look reads a key per awaited rank)."""
        half_beat = self._beat_every / 2
        if self._hurried is not None:
            return half_beat
        return max(half_beat, min(self.timeout / 20, LOOK_S))

    def hurry(self, timeout: float) -> None:
        """From now on, fail a wait once the awaited ranks showed no progress for
        ``timeout`` seconds (a rank leaving on an error path, where a dead peer is
        likely: the healthy group's long timeout would hold its exit, and so the
        restart, for minutes). Thread-safe; a wait in progress takes it at once."""
        self._hurried = (time.monotonic(), timeout)

    # ------------------------------------------------------------------ exchange
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        self.start_beating()
        self._calls += 1
        key = self._key(self._calls, "b")
        if self.rank == 0:
            self.kv.set(key, pickle.dumps(obj))
            return obj
        self._poll({0: key}, "rank 0")
        return pickle.loads(self.kv.get(key))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order on rank 0; ``[obj]`` on the others (the
        sharded save reads them on rank 0 only)."""
        self.start_beating()
        self._calls += 1
        keys = [self._key(self._calls, "g", r) for r in range(self.world_size)]
        self.kv.set(keys[self.rank], pickle.dumps(obj))
        if self.rank != 0:
            return [obj]
        self._poll({r: k for r, k in enumerate(keys) if r != 0}, "every rank's entries")
        out = [pickle.loads(self.kv.get(k)) for k in keys]
        for k in keys:
            self.kv.delete_key(k)
        return out

    def close(self) -> None:
        """Stop this rank's progress counter; the last rank to finish removes the
        broadcast and progress keys (best effort)."""
        if self._stop is not None and self._beater is not None:
            self._stop.set()
            self._beater.join()
        try:
            if self.kv.add(self._key("done"), 1) == self.world_size:
                for n in range(1, self._calls + 1):
                    self.kv.delete_key(self._key(n, "b"))
                for r in range(self.world_size):
                    self.kv.delete_key(self._key("alive", r))
                self.kv.delete_key(self._key("left"))
                self.kv.delete_key(self._key("done"))
        except Exception:  # pragma: no cover - a closed store: nothing to clean
            pass
