"""The replica ring is not set up when a node advertises an address the other nodes
cannot reach (its host name resolving to 127.0.1.1 beside other nodes' network
addresses): a warning names why, instead of every stream to it failing unexplained.
The process group's exchange is stood in for (rank 0 of two nodes)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import elastic_kit as ek
import elastic_kit.snapshot._tier as tier_module
from elastic_kit.snapshot import SnapshotTier


def _connected(shm: str, monkeypatch: pytest.MonkeyPatch, peer_host: str) -> SnapshotTier:
    info = ek.DistInfo(rank=0, world_size=2, local_world_size=1, num_nodes=2, run_id="job")
    tier = SnapshotTier("/durable", info=info, every=1, root=shm)
    monkeypatch.setattr(tier_module, "is_dist_ready", lambda: True)
    monkeypatch.setattr(tier_module, "advertised_host", lambda: "127.0.0.1")

    def gather(mine: Any) -> list[Any]:  # this node's entry and the other node's
        return [mine, (1, "node1", (peer_host, 9), None, "node1-receiver")]

    monkeypatch.setattr(tier_module, "all_gather_object", gather)
    tier.connect()
    return tier


def test_a_loopback_address_beside_a_network_one_sets_up_no_replicas(
        shm: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        tier = _connected(shm, monkeypatch, "10.0.0.2")
    try:
        assert tier._sender is None
        assert "not replicated" in caplog.text and "127.0.0.1" in caplog.text
    finally:
        tier.close(remove=True)


def test_nodes_on_one_host_all_on_loopback_replicate(
        shm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _connected(shm, monkeypatch, "127.0.0.1")
    try:
        assert tier._sender is not None and tier._sender.to == "node1-receiver"
    finally:
        tier.close(remove=True, flush=False)
