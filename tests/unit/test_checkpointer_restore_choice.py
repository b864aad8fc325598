"""Which state a restore takes, and what it then knows about it: a newest durable
checkpoint that does not verify gives way to a newer snapshot (not to an older durable
step), a snapshot of the state the store's manifest names does not count as saved
(the store's bytes were not read), a checkpoint saved without a sampler keeps its
epoch, and the checkpointer's own blocking work stays out of the step time that sets
the snapshot interval."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import elastic_kit as ek

N = 80      # samples: 20 steps of 4 per epoch
BATCH = 4


def _state(*, sampler: bool = True) -> ek.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         sampler=ek.ElasticDistributedSampler(range(N), num_replicas=1,
                                                              rank=0, seed=3)
                         if sampler else None)


def _checkpointer(state: ek.TrainState, store: str, **options: object) -> ek.Checkpointer:
    return ek.Checkpointer(state, store, handle_signals=False, heartbeat_timeout=0,
                           handle_preemption=False, **options)


def _train(state: ek.TrainState, ck: ek.Checkpointer, n: int,
           weights: dict[int, torch.Tensor] | None = None) -> None:
    """``n`` optimizer steps on batches the sampler deals; ``weights[step]``: the
    model's weight after each."""
    model, opt = state.model, state.optimizer
    batches = (iter(torch.utils.data.DataLoader(range(N), batch_size=BATCH,
                                                sampler=state.sampler))
               if state.sampler is not None else None)
    for _ in range(n):
        if batches is not None:
            next(batches)
        model(torch.randn(BATCH, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        ck.step(BATCH)
        if weights is not None:
            weights[state.step] = model.weight.detach().clone()


def _corrupt_payload(step_dir: Path) -> None:
    payload = step_dir / "state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF
    payload.write_bytes(bytes(data))


def _snapshot_steps(shm: str) -> list[str]:
    return sorted(p.name for p in Path(shm).rglob("step-*"))


def test_a_corrupt_newest_durable_checkpoint_gives_way_to_a_newer_snapshot(
        shm: str, tmp_path: Path) -> None:
    """Durable steps 4 and 8, snapshots 3 and 6; step 8's payload is corrupt. The store
    falls back to step 4, but memory holds step 6: a restore from step 4 would redo
    two steps that a snapshot kept."""
    store = str(tmp_path / "store")
    state = _state()
    ck = _checkpointer(state, store, every_steps=4, blocking=True, snapshot_every=3,
                       save_at_epoch_end=False)
    ck.restore()
    weights: dict[int, torch.Tensor] = {}
    _train(state, ck, 8, weights)
    assert ck.snapshots is not None and ck.snapshots.wait(timeout=60)
    assert ck.snapshots.written == [3, 6]
    ck.abandon()                                 # killed after step 8's save
    assert [i.step for i in ek.CheckpointStore(store).list()] == [4, 8]
    _corrupt_payload(tmp_path / "store" / "step-000000000008")

    again_state = _state()
    again = _checkpointer(again_state, store, every_steps=4, blocking=True, snapshot_every=3,
                          save_at_epoch_end=False)
    assert again.restore() == 0
    assert (again.restored_from, again.restored_step) == ("memory", 6)
    assert again_state.step == 6 and again_state.sampler.consumed == 6 * BATCH
    assert torch.equal(again_state.model.weight, weights[6])
    assert again.last_saved_step is None         # step 6 is in no durable checkpoint
    again.close()


def test_a_durable_fallback_newer_than_every_snapshot_is_still_taken(
        shm: str, tmp_path: Path) -> None:
    """The later state wins whichever tier holds it: with step 5 corrupt, durable
    step 4 is later than the only snapshot (step 3)."""
    store = str(tmp_path / "store")
    state = _state()
    ck = _checkpointer(state, store, every_steps=4, blocking=True, snapshot_every=3,
                       save_at_epoch_end=False)
    ck.restore()
    weights: dict[int, torch.Tensor] = {}
    _train(state, ck, 5, weights)                # snapshot 3, durable 4
    ck.save()                                    # durable 5
    assert ck.snapshots is not None and ck.snapshots.wait(timeout=60)
    assert ck.snapshots.written == [3]
    ck.abandon()
    _corrupt_payload(tmp_path / "store" / "step-000000000005")

    again_state = _state()
    again = _checkpointer(again_state, store, every_steps=4, blocking=True, snapshot_every=3,
                          save_at_epoch_end=False)
    again.restore()
    assert (again.restored_from, again.restored_step) == ("store", 4)
    assert torch.equal(again_state.model.weight, weights[4])
    assert again.last_saved_step == 4
    again.close()


def test_a_snapshot_passed_over_for_a_corrupt_durable_checkpoint_is_taken_after_all(
        shm: str, tmp_path: Path) -> None:
    """Step 20 is in memory inside its epoch (position 80) and in the store with the
    epoch closed, which is later: the snapshot is passed over. The store's step 20
    then does not verify and it falls back to step 16: the snapshot is later than
    that."""
    store = str(tmp_path / "store")
    state = _state()
    ck = _checkpointer(state, store, every_steps=8, blocking=True, snapshot_every=100)
    ck.restore()
    weights: dict[int, torch.Tensor] = {}
    _train(state, ck, N // BATCH, weights)       # durable 8, 16
    ck.snapshot()                                # step 20, epoch 0 at position 80
    ck.end_epoch()                               # durable 20, epoch 1 at position 0
    assert ck.snapshots is not None and ck.snapshots.wait(timeout=60)
    assert ck.snapshots.written == [20]
    ck.abandon()
    assert [i.step for i in ek.CheckpointStore(store).list()] == [8, 16, 20]
    _corrupt_payload(tmp_path / "store" / "step-000000000020")

    again_state = _state()
    again = _checkpointer(again_state, store, every_steps=8, blocking=True,
                          snapshot_every=100)
    assert again.restore() == 1                  # the restored epoch had ended
    assert (again.restored_from, again.restored_step) == ("memory", 20)
    assert torch.equal(again_state.model.weight, weights[20])
    assert (again_state.sampler.epoch, again_state.sampler.consumed) == (1, 0)
    assert again.last_saved_step is None
    again.close()


def _saved_and_snapshotted_at_the_epochs_end(shm: str, store: str) -> None:
    """Train one epoch; its end saves step 20 durably and snapshots it (same step,
    epoch and position); then the run is killed."""
    state = _state()
    ck = _checkpointer(state, store, blocking=True, snapshot_every=4)
    ck.restore()
    _train(state, ck, N // BATCH)
    ck.end_epoch()                               # saves and snapshots step 20
    assert ck.snapshots is not None and ck.snapshots.wait(timeout=60)
    ck.abandon()                                 # killed right after
    assert [i.step for i in ek.CheckpointStore(store).list()] == [20]
    assert _snapshot_steps(shm) == ["step-000000000020"]


def test_a_snapshot_of_the_stores_newest_state_is_kept_when_restored_at_the_end(
        shm: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Restored from memory, the state matches the store's newest manifest; nothing
    verified the store's bytes, so the state does not count as saved: close() with
    nothing left to train keeps the snapshot, and says so."""
    store = str(tmp_path / "store")
    _saved_and_snapshotted_at_the_epochs_end(shm, store)

    again_state = _state()
    again = _checkpointer(again_state, store, blocking=True, snapshot_every=4)
    assert again.restore() == 1
    assert (again.restored_from, again.restored_step) == ("memory", 20)
    assert again.last_saved_step is None
    again.close()                                # nothing left to train
    assert _snapshot_steps(shm) == ["step-000000000020"]
    assert "restored from memory and not saved since" in caplog.text


def test_a_snapshot_matching_a_corrupt_durable_checkpoint_survives_close(
        shm: str, tmp_path: Path) -> None:
    """The store's step 20 names the snapshot's step, epoch and position but does not
    verify: the snapshot is the only good copy of that state. close() keeps it, and
    a save of the same step writes it to the store again."""
    store = str(tmp_path / "store")
    _saved_and_snapshotted_at_the_epochs_end(shm, store)
    _corrupt_payload(tmp_path / "store" / "step-000000000020")

    again_state = _state()
    again = _checkpointer(again_state, store, blocking=True, snapshot_every=4)
    assert again.restore() == 1
    weight = again_state.model.weight.detach().clone()
    assert again.last_saved_step is None
    again.close()
    assert _snapshot_steps(shm) == ["step-000000000020"]

    last = _state()
    final = _checkpointer(last, store, blocking=True, snapshot_every=4)
    assert final.restore() == 1
    assert (final.restored_from, final.restored_step) == ("memory", 20)
    assert torch.equal(last.model.weight, weight)
    final.save()                                 # what the loop does at its end
    assert final.last_saved_step == 20
    final.close()
    loaded = ek.CheckpointStore(store).load()
    assert loaded is not None and loaded.step == 20
    assert torch.equal(loaded.state["model"]["weight"], weight)
    assert _snapshot_steps(shm) == []


def test_a_checkpoint_saved_without_a_sampler_keeps_its_epoch(tmp_path: Path) -> None:
    """A sampler added since the save has no position to load: it starts the saved
    epoch, and the epoch the restore returns is the saved one, not the sampler's 0."""
    store = str(tmp_path / "store")
    state = _state(sampler=False)
    ck = _checkpointer(state, store, snapshot_every=0)
    ck.restore()
    state.epoch, state.step = 3, 120
    ck.save()
    ck.close()

    again_state = _state()
    again = _checkpointer(again_state, store, snapshot_every=0)
    assert again.restore() == 3
    assert (again_state.epoch, again_state.step) == (3, 120)
    assert (again_state.sampler.epoch, again_state.sampler.consumed) == (3, 0)
    again.close()


class _SlowStore:
    """A store whose blocking saves take ``delay`` seconds (a slow filesystem)."""

    def __init__(self, url: str, delay: float) -> None:
        self._store = ek.CheckpointStore(url)
        self.url, self.delay = self._store.url, delay

    def save(self, *args: object, blocking: bool = True, **kw: object) -> object:
        if blocking:
            time.sleep(self.delay)
        return self._store.save(*args, blocking=blocking, **kw)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


@pytest.mark.parametrize("where", ["every_steps", "end_epoch"])
def test_a_slow_blocking_save_leaves_the_step_time_estimate_alone(
        tmp_path: Path, where: str) -> None:
    """A 0.4 s blocking save between steps of a few milliseconds is the
    checkpointer's own work, not training: counted as a step, it would make the
    estimate (and with it the automatic snapshot interval's budget) 100 times off."""
    state = _state()
    store = _SlowStore(str(tmp_path / "store"), delay=0.4)
    options = ({"every_steps": 3, "save_at_epoch_end": False} if where == "every_steps"
               else {"save_at_epoch_end": True})
    ck = _checkpointer(state, store, blocking=True,  # type: ignore[arg-type]
                       snapshot_every=0, **options)
    ck.restore()
    if where == "every_steps":
        _train(state, ck, 6)                     # saves after steps 3 and 6
    else:
        _train(state, ck, N // BATCH)
        ck.end_epoch()                           # saves step 20
    _train(state, ck, 2)                         # the first steps after the save
    assert [i.step for i in store.list()] == ([3, 6] if where == "every_steps" else [20])
    assert ck._cadence.step_s is not None and ck._cadence.step_s < 0.1
    ck.close()


def test_a_node_given_another_node_rank_finds_its_snapshots(tmp_path: Path, shm: str) -> None:
    """``{node_rank}`` in a node-local URL is torchrun's group rank, which a
    re-rendezvous reassigns (a node lost: the survivor that was node 1 is node 0).
    Snapshots keyed by the URL with the rank put in were no longer found: the
    survivor restored an older step, and its snapshots stayed in shared memory."""
    url = str(tmp_path / "nl-{node_rank}")

    def checkpointer(node_rank: int) -> tuple[torch.nn.Module, ek.Checkpointer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        info = ek.DistInfo(run_id="job", node_rank=node_rank)
        store = ek.CheckpointStore(url, node_local=True, info=info)
        return model, ek.Checkpointer(ek.TrainState(model, opt), store, every_steps=1000,
                                      snapshot_every=1, handle_signals=False, info=info)

    # the run's identity, as the nodes agreed on it at the first launch
    identity = ek.CheckpointStore(url, node_local=True,
                                  info=ek.DistInfo(run_id="job", node_rank=0)).run_identity()
    ek.CheckpointStore(url, node_local=True, info=ek.DistInfo(run_id="job", node_rank=1)
                       ).run_identity(adopt=identity)
    model, first = checkpointer(1)
    first.restore()
    for _ in range(5):
        model(torch.ones(3, 4)).sum().backward()
        first.state.optimizer.step()
        first.state.optimizer.zero_grad()
        first.step(3)
    weights = model.weight.detach().clone()
    first.abandon()  # killed: its snapshot of step 5 stays
    model, second = checkpointer(0)  # the same node after a re-rendezvous
    second.restore()
    assert (second.restored_from, second.restored_step) == ("memory", 5)
    assert torch.equal(model.weight, weights)
    second.close()
