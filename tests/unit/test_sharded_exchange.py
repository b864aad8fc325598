"""The key-value exchange of background sharded saves, with threads standing in for ranks
over one real ``torch.distributed.HashStore``."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from elastic_kit.errors import CheckpointError
from elastic_kit.store._exchange import KvExchange


def _ranks(n: int, fn, kv) -> list:
    out: list = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = fn(KvExchange(kv, "save/1", r, n, timeout=5.0))
        except Exception as e:  # reported to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def _answered_while_beating(prefix: str, *, hurry_first: bool,
                            presumed_silent: frozenset[int] | set[int] = frozenset()) -> list:
    """Rank 1 waits, hurried (0.6 s), for rank 0's broadcast; rank 0 beats (every
    0.2 s at this timeout) and answers after 1.5 s: what rank 1 received.
    ``hurry_first``: hurried before its wait begins, else while it waits."""
    kv = dist.HashStore()
    sender, receiver = (KvExchange(kv, prefix, r, 2, timeout=1.0,
                                   presumed_silent=presumed_silent) for r in (0, 1))
    sender.start_beating()
    got: list = []
    t = threading.Thread(target=lambda: got.append(receiver.broadcast(None)))
    if hurry_first:
        receiver.hurry(0.6)
    t.start()
    if not hurry_first:
        receiver.hurry(0.6)
    threading.Event().wait(1.5)
    sender.broadcast({"ok": True})
    t.join(30)
    sender.close()
    receiver.close()
    return got


def test_rank_0_gathers_every_entry_and_broadcasts_its_verdict() -> None:
    kv = dist.HashStore()

    def save(ex: KvExchange) -> tuple:
        header = ex.broadcast({"staging": "/tmp/x"} if ex.rank == 0 else None)
        everyone = ex.gather({"rank": ex.rank, "file": f"shards-{ex.rank}"})
        verdict = ex.broadcast({"ok": len(everyone) == 3} if ex.rank == 0 else None)
        ex.close()
        return header, [e["rank"] for e in everyone], verdict

    got = _ranks(3, save, kv)
    assert got[0] == ({"staging": "/tmp/x"}, [0, 1, 2], {"ok": True})
    assert got[1] == ({"staging": "/tmp/x"}, [1], {"ok": True})  # only rank 0 reads them all
    assert got[2][2] == {"ok": True}
    # the last rank to finish removed the keys: nothing of the save is left behind
    assert not kv.check(["save/1/1/b"]) and not kv.check(["save/1/3/b"])
    assert not kv.check(["save/1/2/g/1"])


def test_a_rank_that_never_answers_fails_the_save_naming_the_wait() -> None:
    kv = dist.HashStore()
    ex = KvExchange(kv, "save/2", 1, 2, timeout=0.2)
    with pytest.raises(CheckpointError, match=r"rank 1 waited 0.2 s for rank 0"):
        ex.broadcast(None)


def test_a_hurried_wait_gives_up_a_silent_peer_and_keeps_waiting_for_a_beating_one() -> None:
    """A rank leaving on an error path (its collective failed: a peer likely died)
    hurries the background save's wait: a silent peer fails it within the hurried
    time, not the healthy group's timeout (300 s: the exit, and the restart, waited
    that long); a peer still beating in the save is waited for."""
    kv = dist.HashStore()
    waiting = KvExchange(kv, "save/3", 1, 2, timeout=300.0)
    out: list = []

    def wait() -> None:
        try:
            waiting.broadcast(None)
        except CheckpointError as e:
            out.append(e)

    t = threading.Thread(target=wait)
    t.start()
    waiting.hurry(0.3)
    t.join(60)
    assert not t.is_alive()
    (err,) = out
    assert "rank 1 waited 0.3 s for rank 0 with no sign of progress" in str(err)

    # rank 0 alive and in the save: it beats (every 0.2 s at this timeout) and
    # answers after 1.5 s, five times the hurried wait
    assert _answered_while_beating("save/4", hurry_first=False) == [{"ok": True}]


def test_a_rank_given_up_once_gets_one_beat_in_a_later_hurried_wait() -> None:
    """A rank whose save in flight failed for a dead peer still takes part in one more
    (the next save's refusal): hurried, a wait for a rank an earlier save gave up
    fails once that rank shows no sign for one beat, not after the whole hurried
    time again (the two waits outlasted torchrun's 30 s grace); the ranks it gave up
    are named on the exchange. A rank presumed silent that beats is waited for."""
    kv = dist.HashStore()
    # timeout 1.0: beats every 0.2 s; hurried time 20 s, far beyond the one beat
    waiting = KvExchange(kv, "save/5", 1, 2, timeout=1.0, presumed_silent={0})
    waiting.hurry(20.0)
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[0\], silent in an earlier save"):
        waiting.broadcast(None)
    assert waiting.silent == {0}
    waiting.close()

    # an earlier wait's failure names the ranks it gave up
    kv = dist.HashStore()
    first = KvExchange(kv, "save/6", 0, 3, timeout=0.3)
    kv.set("save/6/1/g/1", b"x")  # rank 1 answered, rank 2 never does
    with pytest.raises(CheckpointError, match="no sign of progress"):
        first.gather("mine")
    assert first.silent == {2}
    first.close()

    # presumed silent, but alive in this save: it beats, and its answer is awaited
    assert _answered_while_beating("save/7", hurry_first=True, presumed_silent={0}) == [
        {"ok": True}]


def test_a_store_told_to_give_up_hurries_later_saves_until_it_is_closed(tmp_path) -> None:
    """After give_up_on_silent_peers (a stop signal, an error path) every background
    sharded save of the store is hurried, the one in flight and later ones, and waits
    for ranks given up once take one beat; close() ends that: a store used again by a
    healthy group waits the usual time."""
    from elastic_kit.store import CheckpointStore

    store = CheckpointStore(str(tmp_path / "ck"))
    kv = dist.HashStore()
    in_flight = KvExchange(kv, "save/8", 0, 2, timeout=300.0)
    store._in_flight(in_flight)
    store.give_up_on_silent_peers(4.0)
    assert in_flight._hurried is not None and in_flight._hurried[1] == 4.0
    later = KvExchange(kv, "save/9", 0, 2, timeout=300.0, presumed_silent=store._silent_ranks)
    store._in_flight(later)
    assert later._hurried is not None and later._hurried[1] == 4.0
    later.silent = frozenset({1})
    store._exchange_done(later)
    assert store._silent_ranks == {1}
    store.close()
    again = KvExchange(kv, "save/10", 0, 2, timeout=300.0, presumed_silent=store._silent_ranks)
    store._in_flight(again)
    assert again._hurried is None and set(again.presumed_silent) == set()


def test_a_rank_that_gives_up_says_so_and_its_peer_stops_waiting_at_once() -> None:
    """A rank that gave up a save (hurried: it took a live peer in slow storage calls
    for a dead one) left its peer waiting for its entries the whole hurried time
    again (15 s), which pushed the stop's own save past torchrun's grace: it says
    so now, and the peer stops at its next look."""
    kv = dist.HashStore()
    root = KvExchange(kv, "save/11", 0, 2, timeout=300.0)
    root.hurry(60.0)  # looks every 2.5 s; would wait 60 s for a silent peer
    quick = KvExchange(kv, "save/11", 1, 2, timeout=0.3)
    out: list = []

    def gather() -> None:
        try:
            root.gather("entries of rank 0")
        except CheckpointError as e:
            out.append(e)

    t = threading.Thread(target=gather)
    t.start()
    with pytest.raises(CheckpointError, match="no sign of progress"):
        quick.broadcast(None)  # rank 0 gathers first: no verdict comes
    t.join(30)
    assert not t.is_alive(), "rank 0 kept waiting for the rank that gave up"
    (err,) = out
    assert "rank 0 stopped waiting for every rank's entries: rank 1 gave up this save" \
        in str(err)
    quick.close()
    root.close()
    assert not kv.check(["save/11/left"])  # the last rank out removed it


def test_a_save_shows_progress_from_its_start_not_its_first_exchange(tmp_path) -> None:
    """Rank 0's storage calls before the save's first exchange (a slow listing, a
    retried request) showed no progress: a hurried peer took it for dead and the job
    lost the save in flight and the stop's own. The store starts the beat as it hands
    the save over."""
    from elastic_kit.store import CheckpointStore

    store = CheckpointStore(str(tmp_path / "ck"))
    kv = dist.HashStore()
    ex = KvExchange(kv, "save/12", 0, 2, timeout=300.0)
    store._in_flight(ex)
    try:
        assert int(kv.add("save/12/alive/0", 0)) >= 1
    finally:
        store._exchange_done(ex)
