"""The sharded save's protocol without processes: threads stand in for ranks over one
real ``torch.distributed.HashStore`` (the key-value exchange of background saves), or
one rank plays the whole group. Checks that a slow but working rank is waited for, that
a failure of one rank fails the save on every rank at its first exchange, that entries
of another save are refused, that a commit whose answer was lost is read back before
anything is removed, and that a failed part write leaves no partial file."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import fsspec
import pytest
import torch
import torch.distributed as dist

from elastic_kit.errors import CheckpointError
from elastic_kit.store import CheckpointStore
from elastic_kit.store._backend_local import LocalBackend
from elastic_kit.store._exchange import KvExchange
from elastic_kit.store._sharded import save_sharded
from elastic_kit.store._shard_index import Chunk, ShardedTensor, ShardIndex
from elastic_kit.store._tensorfile import TensorEntry
from elastic_kit.testing import FaultFileSystem


def _ranks(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` on ``n`` threads; each one's result or exception."""
    out: list[Any] = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as e:  # reported to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


# ---------------------------------------------------------------------- waiting
def test_a_rank_0_still_working_past_the_timeout_is_waited_for() -> None:
    kv = dist.HashStore()

    def save(rank: int) -> Any:
        ex = KvExchange(kv, "save/slow", rank, 2, timeout=0.3)
        try:
            ex.broadcast({"staging": "/x"} if rank == 0 else None)
            ex.gather(rank)
            if rank == 0:
                time.sleep(1.2)  # its payload and manifest: four timeouts long
            return ex.broadcast({"ok": True} if rank == 0 else None)
        finally:
            ex.close()

    assert _ranks(2, save) == [{"ok": True}, {"ok": True}]
    assert not kv.check(["save/slow/alive/0"]) and not kv.check(["save/slow/alive/1"])


def test_a_rank_0_that_stops_answering_fails_the_wait_within_the_timeout() -> None:
    kv = dist.HashStore()
    gone = KvExchange(kv, "save/gone", 0, 2, timeout=0.3)
    gone.broadcast({"staging": "/x"})
    gone.close()  # left the save without a verdict: no more progress from it
    waiting = KvExchange(kv, "save/gone", 1, 2, timeout=0.3)
    assert waiting.broadcast(None) == {"staging": "/x"}
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"rank 1 waited 0.3 s for rank 0 with no sign"):
        waiting.broadcast(None)
    assert time.monotonic() - t0 < 2.0
    waiting.close()


def test_a_rank_that_never_arrives_fails_the_gather_though_the_others_are_alive() -> None:
    kv = dist.HashStore()

    def save(rank: int) -> Any:  # rank 2 never comes; rank 1 waits, alive, for a verdict
        ex = KvExchange(kv, "save/dead", rank, 3, timeout=0.3)
        try:
            ex.gather(rank)
            return ex.broadcast(None)
        finally:
            ex.close()

    t0 = time.monotonic()
    got = _ranks(2, save)
    assert isinstance(got[0], CheckpointError)
    assert "rank 0 waited 0.3 s for every rank's entries with no sign" in str(got[0])
    assert time.monotonic() - t0 < 3.0  # rank 1's progress does not count for rank 2


# ---------------------------------------------------------------------- one rank fails
def test_a_failure_of_one_rank_before_the_save_fails_it_on_every_rank(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ck"))
    kv = dist.HashStore()

    def save(rank: int) -> Any:
        ex = KvExchange(kv, "save/refused", rank, 2, timeout=5.0)
        try:
            return save_sharded(store._layout, {"w": torch.ones(4), "rank": rank}, step=3,
                                checksum="xxh3_128", metadata={}, rank=rank, world_size=2,
                                gather=ex.gather, broadcast=ex.broadcast,
                                failed=RuntimeError("an earlier save failed") if rank else None)
        finally:
            ex.close()

    got = _ranks(2, save)
    assert isinstance(got[1], RuntimeError) and str(got[1]) == "an earlier save failed"
    assert isinstance(got[0], CheckpointError)
    assert "rank 1 could not take part: RuntimeError: an earlier save failed" in str(got[0])
    assert got[0].echo is False  # a failure of this save, not an earlier one's
    assert store.list() == []
    assert sorted(os.listdir(tmp_path / "ck")) in ([], ["run-identity"])  # no staging left
    store.close()


def test_an_entry_of_another_save_is_refused_and_nothing_committed(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ck"))
    calls = []

    def gather(obj: Any) -> list[Any]:
        calls.append(obj)
        if len(calls) == 2:  # the file entries: as if answered for another save
            obj = dict(obj, save="0" * 32)
        return [obj]

    with pytest.raises(CheckpointError, match="rank 0 answered for another save"):
        save_sharded(store._layout, {"w": torch.ones(4)}, step=4, checksum="xxh3_128",
                     metadata={}, rank=0, world_size=1, gather=gather,
                     broadcast=lambda header: header)
    assert calls[0]["step"] == 4 and calls[1]["step"] == 4  # every entry names its step
    assert store.list() == []
    store.close()


# ---------------------------------------------------------------------- commit answers lost
class _LostAnswer(FaultFileSystem):
    """An object store whose manifest PUT of a re-save fails: after storing it
    (``landed``: the answer was lost), or before."""

    def __init__(self, target: Any, landed: bool) -> None:
        super().__init__(target)
        self.landed, self.armed = landed, False

    def pipe_file(self, path: str, value: bytes, **kw: Any) -> None:
        if self.armed and path.endswith("manifest.json"):
            self.armed = False
            if self.landed:
                super().pipe_file(path, value, **kw)
            raise TimeoutError("read timeout on endpoint URL")
        super().pipe_file(path, value, **kw)


@pytest.mark.parametrize("landed", [True, False])
def test_a_commit_whose_answer_is_lost_is_read_back_before_anything_is_removed(
        tmp_path: Path, landed: bool) -> None:
    ffs = _LostAnswer(fsspec.filesystem("file"), landed)
    root = str(tmp_path / "ck")
    store = CheckpointStore(root, filesystem=ffs, keep_last=None)

    def save(v: float) -> Any:
        return save_sharded(store._layout, {"w": torch.full((4,), v)}, step=2,
                            checksum="xxh3_128", metadata={}, rank=0, world_size=1,
                            gather=lambda m: [m], broadcast=lambda h: h)

    save(2.0)
    ffs.armed = True
    if landed:
        manifest = save(22.0)  # the manifest is in place: committed, nothing removed
        assert manifest is not None
    else:
        with pytest.raises(TimeoutError):
            save(22.0)
    assert [problem for _, _, problem in store.verify()] == [None]
    loaded = CheckpointStore(root).load()
    assert loaded is not None and loaded.step == 2
    assert loaded.state["w"].tolist() == [22.0 if landed else 2.0] * 4
    store.close()


# ---------------------------------------------------------------------- leftovers
def test_a_failed_local_part_write_removes_its_partial_file(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path), url=str(tmp_path), writer_id="a" * 32)

    def half(f: Any) -> None:
        f.write(b"\0" * 8192)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="no space left on device") as raised:
        backend.write_part(str(tmp_path), "shards-00001.bin", half, size_hint=1 << 20)
    assert raised.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_an_index_that_does_not_cover_its_tensor_is_refused() -> None:
    entry = TensorEntry(key="0@0", dtype="float32", shape=(4,), offset=0, nbytes=16,
                        checksum="0" * 32)
    tensor = ShardedTensor(path="['w']", dtype="float32", shape=(4,), placements="S(0)",
                           mesh=(2,), digest="0" * 16)
    ShardIndex(tensors=[tensor], chunks=[Chunk(0, "a.bin", (0,), entry)]).check_coverage()
    twice = ShardIndex(tensors=[tensor], chunks=[Chunk(0, "a.bin", (0,), entry),
                                                 Chunk(0, "b.bin", (0,), entry)])
    with pytest.raises(ValueError, match=r"\['w'\]: its chunks hold 8 elements, the tensor 4"):
        twice.check_coverage()


def test_a_rank_alive_but_stuck_fails_the_wait_after_the_longest_it_lasts() -> None:
    """Its beats come from a thread of their own: a write that never returns keeps
    beating, and is waited for at most MOST_TIMEOUTS timeouts."""
    from elastic_kit.store._exchange import MOST_TIMEOUTS

    kv = dist.HashStore()
    stuck = KvExchange(kv, "save/stuck", 0, 2, timeout=0.1)
    stuck.broadcast({"staging": "/x"})          # then its write never ends: it beats on
    waiting = KvExchange(kv, "save/stuck", 1, 2, timeout=0.1)
    assert waiting.broadcast(None) == {"staging": "/x"}
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="kept showing progress"):
        waiting.broadcast(None)
    assert MOST_TIMEOUTS * 0.1 <= time.monotonic() - t0 < 10 * MOST_TIMEOUTS * 0.1
    stuck.close()
    waiting.close()
