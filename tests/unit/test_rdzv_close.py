"""The launcher's restart rounds: closed once every node of the last round is back,
otherwise as torch closes them (its last call), driven through torch's own join
operation on rendezvous states of each case."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

from elastic_kit.health import _rdzv_close, install_rendezvous_close

A, B, C = (dr._NodeDesc(f"host-{n}", 100 + i, 0) for i, n in enumerate("abc"))


@pytest.fixture
def join(monkeypatch: pytest.MonkeyPatch) -> Any:
    """torch's join operation, wrapped as the launcher wraps it (undone after the test),
    with no round completed yet in this process."""
    monkeypatch.setattr(dr._RendezvousJoinOp, "__call__", dr._RendezvousJoinOp.__call__)
    holder = dr._BackendRendezvousStateHolder
    monkeypatch.setattr(holder, "_sanitize", holder._sanitize)
    for name in ("_completed", "_seen", "_dropped", "_vanished", "_last_read"):
        monkeypatch.setattr(_rdzv_close, name, {})
    assert install_rendezvous_close()
    return dr._RendezvousJoinOp()


def _settings(min_nodes: int = 1, max_nodes: int = 3) -> Any:
    return dr.RendezvousSettings(
        run_id="job", min_nodes=min_nodes, max_nodes=max_nodes,
        timeout=dr.RendezvousTimeout(last_call=timedelta(seconds=30)),
        keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=3)


def _state(round_: int, participants: list[Any], *, complete: bool = False,
           waiting: list[Any] = (), alive: list[Any] | None = None,
           silent_s: dict[Any, float] | None = None) -> Any:
    """A state as torch's operations leave it: a round's participants, the wait list,
    and keep-alives of the nodes ``alive`` (default: participants and waiting nodes),
    now or ``silent_s[node]`` seconds ago; an open round past its minimum has a last
    call 30 s away."""
    state = dr._RendezvousState()
    state.round, state.complete = round_, complete
    state.participants = {n: i for i, n in enumerate(sorted(participants))}
    state.wait_list = set(waiting)
    now = datetime.now(timezone.utc)
    state.last_heartbeats = {n: now for n in (alive if alive is not None
                                              else [*participants, *waiting])}
    for n, ago in (silent_s or {}).items():
        state.last_heartbeats[n] = now - timedelta(seconds=ago)
    if not complete and participants:
        state.deadline = now + timedelta(seconds=30)
    return state


def _act(join: Any, node: Any, state: Any, settings: Any = None) -> Any:
    # the join operation's own deadline (on the monotonic clock): far away
    return join(dr._RendezvousContext(node, state, settings or _settings()),
                time.monotonic() + 3600)


def _completed_round_0(join: Any, node: Any, nodes: tuple[Any, ...] = (A, B)) -> None:
    """This process's agent, ``node``, saw round 0 complete with ``nodes`` (an agent is
    one node: what it completed is the process's)."""
    assert _act(join, node, _state(0, list(nodes), complete=True)) == dr._Action.FINISH


def test_a_restart_round_closes_once_every_node_of_the_last_round_is_back(join: Any) -> None:
    _completed_round_0(join, A)
    # A worker died: A's agent is in, B's rejoins (from the wait list): not yet
    assert _act(join, A, _state(1, [A], waiting=[B])) == dr._Action.SYNC
    # B between leaving round 0 and joining round 1 holds no keep-alive: still coming
    assert _act(join, A, _state(1, [A], alive=[A])) == dr._Action.SYNC
    # both back, nobody waiting: closed now, not after the 30 s last call
    assert _act(join, A, _state(1, [A, B])) == dr._Action.MARK_RENDEZVOUS_COMPLETE


def test_torchs_last_call_stays_for_an_agent_that_completed_no_round(join: Any) -> None:
    # the job's first round (nobody knows how many nodes are starting), or a node new
    # to the job (C, started during round 0's run): its agent has completed no round
    assert _act(join, A, _state(0, [A, B])) == dr._Action.SYNC
    assert _act(join, C, _state(1, [A, B, C])) == dr._Action.SYNC
    _completed_round_0(join, A)
    assert _act(join, A, _state(1, [A, B, C])) == dr._Action.MARK_RENDEZVOUS_COMPLETE


@pytest.mark.parametrize("case", ["a node of the last round is missing", "a node waits",
                                  "a node with a keep-alive is not in",
                                  "fewer than the minimum"])
def test_otherwise_the_round_closes_as_torch_closes_it(join: Any, case: str) -> None:
    _completed_round_0(join, A)
    settings = _settings()
    state = _state(1, [A, B])
    if case == "a node of the last round is missing":  # died, or left on a notice
        state = _state(1, [A])
    elif case == "a node waits":
        state = _state(1, [A, B], waiting=[C])
    elif case == "a node with a keep-alive is not in":
        state = _state(1, [A, B], alive=[A, B, C])
    else:
        settings = _settings(min_nodes=3)
    assert _act(join, A, state, settings) == dr._Action.SYNC


def _later(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """This module's clock, ``seconds`` ahead from now on."""
    later = datetime.now(timezone.utc) + timedelta(seconds=seconds)

    class _Later(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return later

    monkeypatch.setattr(_rdzv_close, "datetime", _Later)


def test_a_node_another_agent_dropped_as_dead_is_not_waited_for(
        join: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of the last round died: this agent saw its keep-alive during this
    rendezvous, and the keep-alive left the state (another agent's sync dropped it)
    when the one this agent last saw was older than torch's expiry (1 s x 3 here): the
    round closes without waiting out the last call for it."""
    _completed_round_0(join, A, (A, B, C))
    # C's last keep-alive, 2 s old: it may be alive (torch keeps it in the state)
    assert _act(join, A, _state(1, [A, B], silent_s={C: 2.0})) == dr._Action.SYNC
    _later(monkeypatch, 0.6)
    assert _act(join, A, _state(1, [A, B], silent_s={C: 2.0})) == dr._Action.SYNC
    _later(monkeypatch, 1.2)   # past the expiry, and another agent dropped C
    assert _act(join, A, _state(1, [A, B], alive=[A, B])) == (
        dr._Action.MARK_RENDEZVOUS_COMPLETE)


def test_a_keep_alive_gone_after_a_long_gap_between_reads_is_no_sign_of_death(
        join: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two reads more than an interval apart, C's keep-alive left the state:
    dropped as dead, or removed by C leaving the round with a keep-alive two intervals
    old (its rejoin slowed by many nodes writing the state). Nobody can tell: C may
    come, and the round waits for torch's last call."""
    _completed_round_0(join, A, (A, B, C))
    assert _act(join, A, _state(1, [A, B], silent_s={C: 1.9})) == dr._Action.SYNC
    _later(monkeypatch, 1.2)
    assert _act(join, A, _state(1, [A, B], alive=[A, B])) == dr._Action.SYNC
    _later(monkeypatch, 1.4)
    assert _act(join, A, _state(1, [A, B], alive=[A, B])) == dr._Action.SYNC


def test_a_node_that_left_the_round_itself_is_not_taken_for_dead(
        join: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node removes its own keep-alive as it leaves a round (its rejoin may be slow:
    many nodes writing the state; or it left on a notice): its last keep-alive was
    fresh then, so it stays a node that may come, however old that keep-alive gets,
    and the round waits for torch's last call."""
    _completed_round_0(join, A, (A, B, C))
    assert _act(join, A, _state(1, [A, B], silent_s={C: 1.9})) == dr._Action.SYNC
    assert _act(join, A, _state(1, [A, B], alive=[A, B])) == dr._Action.SYNC  # C left
    _later(monkeypatch, 1.5)
    assert _act(join, A, _state(1, [A, B], alive=[A, B])) == dr._Action.SYNC
    # back in the round: closed with it
    assert _act(join, A, _state(1, [A, B, C])) == dr._Action.MARK_RENDEZVOUS_COMPLETE


def test_a_drop_is_forgotten_once_a_newer_keep_alive_is_seen(join: Any) -> None:
    """This process's sync found C's keep-alive past the expiry once (a late one), but
    C's next keep-alive reached the state before any agent wrote the drop: C is alive,
    and a round without it waits for it."""
    _completed_round_0(join, A, (A, B, C))
    holder = dr._BackendRendezvousStateHolder(None, _settings())
    holder._state = _state(0, [A, B, C], complete=True, silent_s={C: 3.05})
    holder._sanitize()
    assert C not in holder._state.participants  # torch's drop, in this process only
    holder._state = _state(0, [A, B, C], complete=True)  # read again: C's new keep-alive
    holder._sanitize()
    assert _act(join, A, _state(1, [A, B], alive=[A, B])) == dr._Action.SYNC
    # the same when the newer keep-alive is seen by the join instead
    holder._state = _state(0, [A, B, C], complete=True, silent_s={C: 3.05})
    holder._sanitize()
    assert _act(join, A, _state(1, [A, B], waiting=[C])) == dr._Action.SYNC
    assert _act(join, A, _state(1, [A, B], alive=[A, B])) == dr._Action.SYNC


def test_the_last_round_is_the_newest_complete_one_seen_also_while_waiting(
        join: Any) -> None:
    """A's agent completed round 0 with B, came late to round 1 (which completed as B
    and C) and waited through it: round 2 needs C back, not only round 0's nodes."""
    _completed_round_0(join, A, (A, B))
    assert _act(join, A, _state(1, [B, C], complete=True)) == dr._Action.ADD_TO_WAIT_LIST
    assert _act(join, A, _state(2, [A, B], alive=[A, B])) == dr._Action.SYNC
    assert _act(join, A, _state(2, [A, B, C])) == dr._Action.MARK_RENDEZVOUS_COMPLETE


def test_a_node_torchs_sync_in_this_process_dropped_as_dead_is_not_waited_for(
        join: Any) -> None:
    """A frozen node: its keep-alives lapse while the agent monitors its workers (and
    syncs the state), long before the restart; torch's sanitizer drops it there."""
    _completed_round_0(join, A, (A, B, C))
    holder = dr._BackendRendezvousStateHolder(None, _settings())
    holder._state = _state(0, [A, B, C], complete=True, silent_s={C: 3.5})
    holder._sanitize()
    assert C not in holder._state.participants  # torch's own drop
    assert _act(join, A, _state(1, [A, B])) == dr._Action.MARK_RENDEZVOUS_COMPLETE
    # C came back and took part in round 1: a drop before that round no longer counts
    assert _act(join, A, _state(1, [A, B, C], complete=True)) == dr._Action.FINISH
    assert _act(join, A, _state(2, [A, B], alive=[A, B])) == dr._Action.SYNC


def test_a_node_not_seen_in_this_rendezvous_is_waited_for(join: Any) -> None:
    # C's keep-alive was last seen before round 0 completed: that is no sign of death
    assert _act(join, A, _state(0, [A, B, C], silent_s={C: 30.0})) == dr._Action.SYNC
    _completed_round_0(join, A, (A, B, C))
    assert _act(join, A, _state(1, [A, B], alive=[A, B])) == dr._Action.SYNC


def test_dead_nodes_are_those_silent_past_the_expiry() -> None:
    now = datetime.now(timezone.utc)
    seen = {A: now, B: now - timedelta(seconds=2.9), C: now - timedelta(seconds=3.1)}
    assert _rdzv_close.dead_nodes(seen, timedelta(seconds=3), now) == {C}


def test_only_a_participant_closes_a_round() -> None:
    # (torch's join asks a node outside an open round to join it, never to wait)
    done = (0, frozenset([A, B]))
    assert _rdzv_close.may_close(_state(1, [A, B]), A, 1, done)
    assert not _rdzv_close.may_close(_state(1, [A, B]), C, 1, done)


def test_a_complete_or_closed_round_and_other_actions_are_torchs(join: Any) -> None:
    _completed_round_0(join, A)
    assert _act(join, A, _state(1, [A, B], complete=True)) == dr._Action.FINISH
    closed = _state(1, [A, B])
    closed.closed = True
    assert _act(join, A, closed) == dr._Action.ERROR_CLOSED
    # a node not yet in an open round joins it, as torch has it
    assert _act(join, B, _state(1, [A])) == dr._Action.ADD_TO_PARTICIPANTS


def test_installing_again_keeps_one_wrapper(join: Any) -> None:
    wrapped = dr._RendezvousJoinOp.__call__
    assert install_rendezvous_close()
    again = dr._RendezvousJoinOp.__call__
    assert again is not wrapped
    assert again._elastic_kit_original is wrapped._elastic_kit_original


def test_without_torchs_join_operation_rounds_close_as_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(dr, "_RendezvousJoinOp")
    assert not install_rendezvous_close()
