"""The launcher's rendezvous poll: torch's one-second wait between two reads of the
rendezvous state, shortened in the agent (and only that wait)."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from elastic_kit.health import (
    RDZV_TORCH_POLL_S, install_rendezvous_poll, rendezvous_max_nodes, rendezvous_poll_seconds,
)


@pytest.mark.parametrize("argv,nodes", [
    (["--standalone", "--nproc-per-node=2", "t.py"], 1),
    (["--nnodes=1:3", "t.py"], 3),
    (["--nnodes", "2:40", "--nproc-per-node", "8", "t.py"], 40),
    (["--nnodes=4", "t.py", "--nnodes=900"], 4),
    (["t.py", "--nnodes=900"], 1),  # the script's own option
    (["--nproc-per-node", "8", "--nnodes", "1:200", "t.py"], 200),
    (["--max-restarts", "3", "--nnodes=2:4", "--rdzv-conf", "a=1", "t.py", "-b", "64"], 4),
])
def test_the_largest_node_count_is_read_from_torchruns_options(argv: list[str],
                                                               nodes: int) -> None:
    assert rendezvous_max_nodes(argv) == nodes


@pytest.mark.parametrize("argv", [["--nnodes"], ["--nnodes=1:x", "t.py"], ["--nnodes=0", "t.py"]])
def test_a_bad_node_count_is_named(argv: list[str]) -> None:
    with pytest.raises(ValueError, match="--nnodes"):
        rendezvous_max_nodes(argv)


def test_the_poll_grows_with_the_node_count_to_torchs_second() -> None:
    assert [rendezvous_poll_seconds(n) for n in (1, 4, 10, 30, 100, 5000)] == [
        0.1, 0.1, 0.1, 0.3, 1.0, 1.0]


@pytest.fixture
def delays(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """torch's ``_delay`` replaced by one that records what it was asked to sleep (and
    the state holder's constructor restored after the test)."""
    seen: list[Any] = []
    monkeypatch.setattr(dynamic_rendezvous, "_delay", lambda seconds: seen.append(seconds))
    holder = dynamic_rendezvous._BackendRendezvousStateHolder
    monkeypatch.setattr(holder, "__init__", holder.__init__)
    return seen


def _cache_s() -> float:
    settings = dynamic_rendezvous.RendezvousSettings(
        run_id="r", min_nodes=1, max_nodes=2, timeout=dynamic_rendezvous.RendezvousTimeout(),
        keep_alive_interval=dynamic_rendezvous.timedelta(seconds=1), keep_alive_max_attempt=3)
    return dynamic_rendezvous._BackendRendezvousStateHolder(None, settings)._cache_duration


def test_only_the_polls_second_is_shortened(delays: list[Any]) -> None:
    assert install_rendezvous_poll(0.1)
    dynamic_rendezvous._delay(seconds=1)          # the poll, as torch's executor calls it
    dynamic_rendezvous._delay(seconds=(0, 0.3))   # the random delay before a first round
    dynamic_rendezvous._delay(0.5)
    assert delays == [0.1, (0, 0.3), 0.5]


def test_the_state_is_cached_for_a_poll_not_a_second(delays: list[Any]) -> None:
    assert _cache_s() == 1
    assert install_rendezvous_poll(0.1)
    assert _cache_s() == 0.1


def test_installing_again_replaces_the_poll_instead_of_wrapping_it(delays: list[Any]) -> None:
    assert install_rendezvous_poll(0.2) and install_rendezvous_poll(0.05)
    dynamic_rendezvous._delay(seconds=RDZV_TORCH_POLL_S)
    assert delays == [0.05]
    assert _cache_s() == 0.05


@pytest.mark.parametrize("seconds", [0, -1, 1.5])
def test_a_poll_outside_torchs_second_is_refused(seconds: float, delays: list[Any]) -> None:
    with pytest.raises(ValueError, match=r"expected a number of seconds in \(0, 1.0\]"):
        install_rendezvous_poll(seconds)


def test_without_torchs_delay_the_rendezvous_polls_as_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    init = dynamic_rendezvous._BackendRendezvousStateHolder.__init__
    monkeypatch.delattr(dynamic_rendezvous, "_delay")
    assert not install_rendezvous_poll(0.1)
    assert not hasattr(dynamic_rendezvous, "_delay")
    assert dynamic_rendezvous._BackendRendezvousStateHolder.__init__ is init
