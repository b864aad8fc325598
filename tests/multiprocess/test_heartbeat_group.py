"""The heartbeat ring forms from the process group: each worker beats to the same local
rank on the next node and watches the previous one; one node has no heartbeat."""

from __future__ import annotations

import time
from typing import Any

import elastic_kit as ek
from elastic_kit.distributed import barrier
from elastic_kit.health import start_heartbeat
from elastic_kit.testing import spawn_multi_process


def _ring() -> dict[str, Any]:
    info = ek.init_distributed()
    hb = start_heartbeat(info, timeout_s=2.0)
    if hb is None:
        return {"rank": info.rank, "heartbeat": None}
    time.sleep(0.6)
    beating = hb.last_beat > time.monotonic() - 0.5 and hb.silent is None
    barrier()
    if info.node_rank == 1:
        hb.close()  # a goodbye, then the process group's barrier
    barrier()
    time.sleep(0.3)
    out = {"rank": info.rank, "node": info.node_rank, "watch": hb.watch, "beating": beating,
           "said_bye": hb.said_bye, "silent": hb.silent}
    hb.close()
    return out


def test_each_worker_watches_its_local_rank_on_the_previous_node() -> None:
    out = spawn_multi_process(4, _ring, local_world_size=2)  # two nodes of two
    assert [(o["rank"], o["node"], o["watch"]) for o in out] == [
        (0, 0, 2), (1, 0, 3), (2, 1, 0), (3, 1, 1)]
    assert all(o["beating"] and o["silent"] is None for o in out)
    # node 1 said goodbye: node 0 stops watching it and never calls it silent
    assert [o["said_bye"] for o in out] == [True, True, False, False]


def test_one_node_has_no_heartbeat() -> None:
    out = spawn_multi_process(2, _ring, local_world_size=2)
    assert out == [{"rank": 0, "heartbeat": None}, {"rank": 1, "heartbeat": None}]


def _long_step_and_slow_collective() -> dict[str, Any]:
    """Node 1 spends 4.5 s (three timeouts) in one long compute step while node 0 waits
    for it in a collective: neither is taken for a silent host."""
    import torch

    info = ek.init_distributed()
    silent: list[int] = []
    hb = start_heartbeat(info, timeout_s=1.5, on_silent=lambda rank, s: silent.append(rank))
    assert hb is not None
    if info.node_rank == 1:
        a = torch.randn(600, 600)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4.5:  # a long step: torch ops and Python, no pause
            a = torch.tanh(a @ a / 600)
    barrier()  # node 0 waits here for the whole step: a slow collective
    hb.close()
    return {"rank": info.rank, "silent": silent}


def test_a_long_step_or_a_slow_collective_is_not_a_silent_host() -> None:
    out = spawn_multi_process(2, _long_step_and_slow_collective, local_world_size=1)
    assert out == [{"rank": 0, "silent": []}, {"rank": 1, "silent": []}]


def _joined_late() -> dict[str, Any]:
    """A node that joined later counts its restarts from 0 (torchrun raises the count
    only on failures, per agent): the ranks of one group disagree on it."""
    import os

    os.environ["TORCHELASTIC_RESTART_COUNT"] = "3" if os.environ["RANK"] == "0" else "0"
    info = ek.init_distributed()
    silent: list[int] = []
    hb = start_heartbeat(info, timeout_s=1.0, on_silent=lambda rank, s: silent.append(rank))
    assert hb is not None
    time.sleep(2.6)  # past the grace for a peer that never connects (two timeouts)
    out = {"restarts": info.restart_count, "silent": silent, "refused": hb.refused}
    barrier()
    hb.close()
    return out


def test_ranks_that_count_restarts_differently_still_beat() -> None:
    out = spawn_multi_process(2, _joined_late, local_world_size=1)
    assert out == [{"restarts": 3, "silent": [], "refused": 0},
                   {"restarts": 0, "silent": [], "refused": 0}]
