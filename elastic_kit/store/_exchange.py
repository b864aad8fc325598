"""Gather and broadcast through the process group's key-value store, off the main thread.

A background (non-blocking) sharded save must exchange its ranks' file entries and
rank 0's verdict while the training thread runs its own collectives. A collective
issued from a second thread would pair with the training thread's gradient
all-reduce on another rank; the key-value store (``TCPStore``) has no such order: each
exchange is keys named after the save and a call counter, set by one rank and polled
(``check``, never a blocking ``wait`` that would hold the client's lock) by the
others. Payloads are pickled, as ``broadcast_object`` does: the store belongs to the
job, not to storage anyone may edit.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from elastic_kit.errors import CheckpointError

__all__ = ["KvExchange"]


class KvExchange:
    """``gather`` / ``broadcast`` for one background save (see the module docstring).

    Args:
        kv: the process group's key-value store (``_get_default_store()``).
        prefix: keys of this save (unique in the job: the store's save counter).
        rank, world_size: this rank's place in the group.
        timeout: seconds to wait for another rank before failing the save.
    """

    def __init__(self, kv: Any, prefix: str, rank: int, world_size: int,
                 timeout: float) -> None:
        self.kv, self.prefix = kv, prefix
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._calls = 0

    def _key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _poll(self, keys: list[str], what: str) -> None:
        deadline, pause = time.monotonic() + self.timeout, 0.002
        while not self.kv.check(keys):
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"background sharded save {self.prefix}: rank {self.rank} waited "
                    f"{self.timeout:g} s for {what} (did a rank fail or leave?)")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        self._calls += 1
        key = self._key(self._calls, "b")
        if self.rank == 0:
            self.kv.set(key, pickle.dumps(obj))
            return obj
        self._poll([key], "rank 0")
        return pickle.loads(self.kv.get(key))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order on rank 0; ``[obj]`` on the others (the
        sharded save reads them on rank 0 only)."""
        self._calls += 1
        keys = [self._key(self._calls, "g", r) for r in range(self.world_size)]
        self.kv.set(keys[self.rank], pickle.dumps(obj))
        if self.rank != 0:
            return [obj]
        self._poll(keys, "every rank's shards")
        out = [pickle.loads(self.kv.get(k)) for k in keys]
        for k in keys:
            self.kv.delete_key(k)
        return out

    def close(self) -> None:
        """The last rank to finish removes the broadcast keys (best effort)."""
        try:
            if self.kv.add(self._key("done"), 1) == self.world_size:
                for n in range(1, self._calls + 1):
                    self.kv.delete_key(self._key(n, "b"))
                self.kv.delete_key(self._key("done"))
        except Exception:  # pragma: no cover - a closed store: nothing to clean
            pass
