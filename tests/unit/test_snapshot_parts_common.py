"""A sharded state's parts: each rank's writer commits at its own pace, so a rank may
lack a step the others hold (its queued snapshot was replaced, its write failed).
The newest step every rank holds, learnt at the flag exchanges, stays on every rank
until a newer one is known, so a failure always finds a complete snapshot."""

from __future__ import annotations

from typing import Any

import torch

import elastic_kit as ek
from elastic_kit.checkpointer._cadence import Cadence, Flags
from elastic_kit.snapshot import SnapshotTier
from elastic_kit.state._signals import TerminationFlag


def _part_tier(shm: str) -> SnapshotTier:
    info = ek.DistInfo(rank=0, local_rank=0, world_size=2, run_id="job")
    return SnapshotTier("/durable", info=info, every=1, root=shm, replicate=False,
                        sharded=True)


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "step": step}


def _save(tier: SnapshotTier, step: int) -> None:
    tier.save(_state(step), step=step, metadata={})
    assert tier.wait(timeout=60)


def _held_steps(tier: SnapshotTier) -> list[int]:
    assert tier._flat_layout is not None
    return sorted(d.step for d, _ in tier._flat_layout.committed())


def test_the_newest_step_every_rank_holds_stays_while_newer_ones_come(shm: str) -> None:
    tier = _part_tier(shm)
    try:
        _save(tier, 10)
        _save(tier, 20)
        # the other rank holds step 10 but lacks 20 (its snapshot of 20 was replaced)
        assert tier.part_report() == (1.0, 1.0)
        tier.parts_agreed((2.0, 1.0), world_size=2)
        assert tier.common_step == 10
        for step in (30, 40, 50):
            _save(tier, step)
        assert _held_steps(tier) == [10, 40, 50]   # 10: what the other rank holds too
        assert tier.part_report() == (1.0, 1.0)    # steps 40 and 50
        tier.parts_agreed((2.0, 2.0), world_size=2)
        assert tier.common_step == 50
        _save(tier, 60)
        assert _held_steps(tier) == [50, 60]
    finally:
        tier.close(remove=True)


def test_steps_reported_held_stay_until_the_exchange_is_read(shm: str) -> None:
    """Between the report and the exchange's sum a rank commits more snapshots: the
    steps it reported held must still be there when the sum says every rank holds
    one of them."""
    tier = _part_tier(shm)
    try:
        _save(tier, 10)
        _save(tier, 20)
        assert tier.part_report() == (1.0, 1.0)
        for step in (30, 40, 50):                  # the exchange is still in flight
            _save(tier, step)
        assert _held_steps(tier) == [10, 20, 40, 50]
        tier.parts_agreed((1.0, 2.0), world_size=2)
        assert tier.common_step == 20
        _save(tier, 60)
        assert _held_steps(tier) == [20, 50, 60]
    finally:
        tier.close(remove=True)


def test_a_step_this_rank_skipped_is_reported_not_held(shm: str) -> None:
    tier = _part_tier(shm)
    try:
        _save(tier, 10)
        tier.save({"w": torch.full((256,), 1.0), "step": 20}, step=20, metadata={},
                  finish=lambda state: (_ for _ in ()).throw(OSError("disk gone")))
        tier.wait(timeout=60)
        assert tier.part_report() == (1.0, 0.0)
    finally:
        tier.close(remove=True)


def test_the_flag_exchange_carries_each_ranks_report(shm: str) -> None:
    """World size 1: the flags a rank sends are the agreed ones, read at once."""
    info = ek.DistInfo(run_id="job")
    tier = SnapshotTier("/durable", info=info, every=1, root=shm, replicate=False,
                        sharded=True)
    model = torch.nn.Linear(2, 2)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cadence = Cadence(state, info, TerminationFlag(), None, tier=lambda: tier)
    try:
        _save(tier, 10)
        _save(tier, 20)
        flags = cadence.poll()
        assert (flags.held_older, flags.held_newer) == (1.0, 1.0)
        assert tier.common_step == 20
        assert Flags()._fields[-2:] == ("held_older", "held_newer")
    finally:
        tier.close(remove=True)


def test_a_nodes_part_replicas_keep_the_step_every_rank_holds(tmp_path) -> None:
    """The replicas of a node's parts keep, besides the newest two, the steps the
    group keeps: a lost node's part of the newest complete step lives on there."""
    import os

    from elastic_kit.snapshot._replica import ReplicaReceiver
    from elastic_kit.store import step_dir_name

    kept = {20}
    r = ReplicaReceiver(str(tmp_path / "node1"), run="run-1", token="t" * 32,
                        host="127.0.0.1", keep_parts=lambda: set(kept))
    try:
        for src in ("nodeA.p0", "nodeA.p1"):
            for step in (10, 20, 30, 40):
                os.makedirs(os.path.join(r.dir, src, step_dir_name(step)), mode=0o700)
        os.chmod(r.dir, 0o700)
        for src in ("nodeA.p0", "nodeA.p1"):
            os.chmod(os.path.join(r.dir, src), 0o700)
        r._drop_older("nodeA.p0", 40)
        held = {src: sorted(os.listdir(os.path.join(r.dir, src)))
                for src in ("nodeA.p0", "nodeA.p1")}
        assert held == {src: [step_dir_name(s) for s in (20, 30, 40)] for src in held}
    finally:
        r.close()
