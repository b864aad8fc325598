"""``load()``'s handshake: every rank is in the same ``load()`` call before any
collective runs, agreed through the process group's key-value store.

Why no collective: a ``load()`` called on some ranks only (``if rank == 0:
load_checkpoint(...)``, the habit ``torch.load`` teaches) would pair its collective
with one the other ranks make elsewhere (their gradient all-reduce), which hangs or
mixes data until the process group's timeout. The handshake fails within
``load_timeout`` instead, and the group stays usable.

Why nonces: torchrun's shared store outlives a failed worker group, and the keys
that group left for the same call stay there. Keys cannot be named after the group
without first agreeing on a name (a collective again), so every answer is made
provably this call's by a nonce its asker drew just now:

- rank 0 publishes a fresh nonce ``N`` under the call's key; every other rank
  publishes its own nonce under each value of that key it reads (an earlier group's
  value is answered too, harmlessly: nobody waits on it) and counts itself in there;
- once every other rank counted itself in under ``N``, rank 0 answers each one under
  that rank's own nonce (``N`` again), which only this call's rank 0 can have written,
  then commits ``ok`` under ``N``;
- the commit is decided once, by whoever writes it first (``compare_set`` on an
  absent key): rank 0's ``ok`` or its abort at its ``load_timeout``; the abort of a
  rank whose ``load_timeout`` ran out before it was answered (written under every
  ``N`` it read); the abort of a rank that was answered and then waited
  ``load_timeout`` for a commit (rank 0 stalled or died). Every rank reads the one
  commit, so no rank enters the load's collectives unless every rank does.

The keys cost rank 0 a few reads and writes per rank, once per ``load()`` (a start or
a restart); the others poll their answer's key, then the commit's, with a backoff of
at most 50 ms. A failure of the key-value store itself is a :class:`CheckpointError`
naming the call.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from torch.distributed import DistError

from elastic_kit.errors import CheckpointError

__all__ = ["handshake"]

_PAUSE_MAX_S = 0.05
#: How often a rank that joined a value of rank 0's key reads the key again (the value
#: it read may be an earlier group's, written before this call's rank 0 got there).
_REREAD_S = 0.25
_OK = "ok"


class _Poll:
    """Sleeps with a backoff, and the deadline."""

    def __init__(self, timeout: float) -> None:
        self.deadline = time.monotonic() + timeout
        self.pause = 0.002

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def sleep(self) -> None:
        time.sleep(self.pause)
        self.pause = min(self.pause * 2, _PAUSE_MAX_S)


def _get_all(kv: Any, keys: list[str]) -> list[bytes]:
    multi_get = getattr(kv, "multi_get", None)
    return list(multi_get(keys)) if multi_get is not None else [kv.get(k) for k in keys]


def _set_all(kv: Any, keys: list[str], values: list[str]) -> None:
    multi_set = getattr(kv, "multi_set", None)
    if multi_set is not None:
        multi_set(keys, values)
    else:
        for k, v in zip(keys, values):
            kv.set(k, v)


def handshake(kv: Any, prefix: str, rank: int, world_size: int, timeout: float,
              what: str, call: str = "load()") -> None:
    """Return once every rank of ``world_size`` is in the call named by ``prefix``
    (the same on every rank: the process's count of its ``load()`` calls), else raise
    on every rank that is (see the module docstring). No collective.

    Args:
        kv: the process group's key-value store.
        prefix: the call's keys.
        timeout: seconds to wait for the other ranks (``load_timeout``).
        what: the call, for messages (``"load() call #2 on s3://b/run"``).
        call: what every rank must call, for messages (``"load()"``; a blocking
            save of sharded state is collective too).

    Raises:
        CheckpointError: a rank did not take part within ``timeout``, or gave up, or
            the store failed.
    """
    try:
        if rank == 0:
            _lead(kv, prefix, world_size, timeout, what, call)
        else:
            _follow(kv, prefix, rank, timeout, what, call)
    except DistError as e:  # the store's host died, or the store timed out
        raise CheckpointError(f"the process group's key-value store failed in {what} "
                              f"(rank {rank}): {type(e).__name__}: {e}") from e


def _lead(kv: Any, prefix: str, world_size: int, timeout: float, what: str,
          call: str) -> None:
    mine = uuid.uuid4().hex
    here = f"{prefix}/{mine}"
    kv.set(f"{prefix}/lead", mine)
    poll = _Poll(timeout)
    while (joined := int(kv.add(f"{here}/joined", 0))) < world_size - 1:
        if poll.expired():
            verdict = (f"{call} is collective: call it on every rank. Rank 0 waited "
                       f"{timeout:g} s (load_timeout) in {what}, and only {joined + 1} of "
                       f"{world_size} ranks called it")
            raise CheckpointError(_answer(kv, here, mine, world_size, verdict))
        poll.sleep()
    verdict = _answer(kv, here, mine, world_size, _OK)
    if verdict != _OK:
        raise CheckpointError(verdict)


def _answer(kv: Any, here: str, mine: str, world_size: int, verdict: str) -> str:
    """Answer every rank that joined under ``here``, then commit ``verdict`` unless a
    rank committed its abort first; the verdict committed."""
    nonce_keys = [f"{here}/nonce/{r}" for r in range(1, world_size)]
    if verdict != _OK:  # a timeout: only some ranks joined
        nonce_keys = [k for k in nonce_keys if kv.check([k])]
    nonces = [n.decode() for n in _get_all(kv, nonce_keys)] if nonce_keys else []
    if nonces:
        _set_all(kv, [f"{here}/go/{n}" for n in nonces], [mine] * len(nonces))
    # the commit is decided once: rank 0's verdict, or the abort of a rank that gave
    # up first (compare_set on an absent key: the first writer wins, every rank reads it)
    return kv.compare_set(f"{here}/commit", "", verdict).decode()


def _follow(kv: Any, prefix: str, rank: int, timeout: float, what: str,
            call: str) -> None:
    mine = uuid.uuid4().hex
    joined: list[str] = []  # the values of rank 0's key this rank answered
    poll = _Poll(timeout)
    reread_at = 0.0
    lead = None
    while lead is None:
        now = time.monotonic()
        if now >= reread_at and kv.check([f"{prefix}/lead"]):
            value = kv.get(f"{prefix}/lead").decode()
            if value not in joined:
                joined.append(value)
                kv.set(f"{prefix}/{value}/nonce/{rank}", mine)
                kv.add(f"{prefix}/{value}/joined", 1)
            reread_at = now + _REREAD_S
        lead = _answered(kv, prefix, joined, mine)
        if lead is None and poll.expired():
            abort = (f"{call} is collective: call it on every rank. Rank {rank} gave up "
                     f"waiting (load_timeout) in {what} before every rank called it")
            for value in joined:  # under every value read: one of them may be this call's
                kv.compare_set(f"{prefix}/{value}/commit", "", abort)
            lead = _answered(kv, prefix, joined, mine)  # rank 0 may have answered since
            if lead is None:
                raise CheckpointError(
                    f"{call} is collective: call it on every rank. Rank {rank} waited "
                    f"{timeout:g} s (load_timeout) in {what}, and rank 0 did not answer "
                    f"(did every rank call it?)")
        elif lead is None:
            poll.sleep()
    commit = f"{prefix}/{lead}/commit"
    poll = _Poll(timeout)  # rank 0 commits right after answering: only its death delays it
    while not kv.check([commit]):
        if poll.expired():  # decide it, unless rank 0 did meanwhile: every rank reads one
            verdict = kv.compare_set(commit, "", f"rank 0 answered in {what} but did not "
                                     f"commit it within {timeout:g} s (load_timeout)").decode()
            break
        poll.sleep()
    else:
        verdict = kv.get(commit).decode()
    if verdict != _OK:
        raise CheckpointError(verdict)


def _answered(kv: Any, prefix: str, joined: list[str], mine: str) -> str | None:
    """Rank 0's nonce, if this call's rank 0 answered this rank (under one of the
    values it joined: the answer's key holds this rank's own fresh nonce)."""
    for value in reversed(joined):
        key = f"{prefix}/{value}/go/{mine}"
        if kv.check([key]):
            return kv.get(key).decode()
    return None
