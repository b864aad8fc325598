"""A snapshot never stops training beyond its staging copy: one taken while the
previous one is still being written is queued (a newer one replaces it) instead of
waiting, and the snapshot written next is the newest one taken, restorable at its
step. The automatic interval is a budget of the training thread's time, not of the
write's."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from torch import nn

import elastic_kit as ek
from elastic_kit.snapshot import SnapshotTier, interval_for
from elastic_kit.testing import FaultFileSystem


class _Gate:
    """Holds the first snapshot's commit (its manifest write) until opened; counts
    how many commits it held."""

    def __init__(self) -> None:
        self.fs = FaultFileSystem(fsspec.filesystem("file"))
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.fs.add("pipe", match="manifest.json", before=self._hold, times=1)

    def _hold(self, path: str) -> None:
        self.entered.set()
        self.opened.wait(60)


def test_snapshots_taken_during_a_write_return_at_once_and_the_newest_is_written_next(
        shm: str) -> None:
    gate = _Gate()
    tier = SnapshotTier("run", info=ek.DistInfo(run_id="t"), every=1, root=shm,
                        filesystem=gate.fs)
    live = torch.zeros(1000)
    tier.save({"w": live}, step=1, metadata={"epoch": 0})
    assert gate.entered.wait(60)                # step 1's commit is held
    for step in range(2, 6):                     # each returns although step 1 is held
        live.fill_(float(step))
        tier.save({"w": live}, step=step, metadata={"epoch": 0})
    assert tier.written == []                    # nothing committed while the gate held
    assert tier.replaced == [2, 3, 4]            # 5 replaced each queued one in turn
    live.fill_(-1.0)                             # training goes on: the copies are kept
    gate.opened.set()
    assert tier.wait(timeout=60)
    assert tier.written == [1, 5]
    loaded = tier.load()
    assert loaded is not None and loaded.step == 5
    assert torch.equal(loaded.state["w"], torch.full((1000,), 5.0))
    tier.close(remove=True)


def test_a_checkpointer_steps_on_while_a_snapshot_is_written_and_restores_the_newest(
        shm: str, tmp_path: Path) -> None:
    """Every step is a snapshot step; the first snapshot's commit is held while the
    loop runs five more steps (none waits: the loop finishes with the gate closed).
    The snapshot written next is the newest step's, and a restart resumes from it
    with the parameters of that step."""
    url = str(tmp_path / "durable")
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = ek.TrainState(model, opt)
    ckpt = ek.Checkpointer(state, url, handle_signals=False, snapshot_every=1,
                           info=ek.DistInfo())
    ckpt.restore()
    assert ckpt.snapshots is not None
    gate = _Gate()
    tier = SnapshotTier(url, info=ckpt.info, every=1, identity=ckpt.snapshots.identity,
                        filesystem=gate.fs)
    ckpt.snapshots.close(remove=False)
    ckpt.snapshots = tier                        # the same directory, writes gated
    x = torch.randn(16, 8)
    for i in range(6):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()                               # the staging pre-hook runs first
        ckpt.step(16)
        if i == 0:
            assert gate.entered.wait(60)
    assert state.step == 6 and tier.written == []  # six steps with step 1's commit held
    expected = [p.detach().clone() for p in model.parameters()]
    gate.opened.set()
    assert tier.wait(timeout=60)
    assert tier.written[0] == 1 and tier.written[-1] == 6
    tier.close(remove=False)                     # a kill after the snapshot landed
    ckpt.store.close()                           # type: ignore[union-attr]

    torch.manual_seed(1)
    model2 = nn.Linear(8, 4)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    again = ek.Checkpointer(ek.TrainState(model2, opt2), url, handle_signals=False,
                            snapshot_every=1, info=ek.DistInfo())
    again.restore()
    assert (again.restored_step, again.restored_from) == (6, "memory")
    for got, want in zip(model2.parameters(), expected):
        assert torch.equal(got.detach(), want)
    again.close()


def test_a_failed_write_turns_snapshots_off_at_the_next_one_without_failing_training(
        shm: str, caplog: pytest.LogCaptureFixture) -> None:
    fs = FaultFileSystem(fsspec.filesystem("file"))
    fs.add("pipe", match="manifest.json", error=OSError(28, "No space left on device"))
    tier = SnapshotTier("run", info=ek.DistInfo(run_id="t"), every=1, root=shm,
                        filesystem=fs)
    tier.save({"w": torch.ones(10)}, step=1, metadata={})
    assert tier.wait(timeout=60)
    with caplog.at_level("WARNING"):
        tier.save({"w": torch.ones(10)}, step=2, metadata={})
    assert not tier.enabled
    assert "step-000000000001/manifest.json: no space left on device" in caplog.text
    assert tier.written == []
    tier.close(remove=True)


@pytest.mark.parametrize("cost_s, step_s, budget, k", [
    (0.088, 0.0693, 0.01, 127),    # a pinned copy of 4.83 GB behind 69 ms steps
    (0.001, 0.05, 0.01, 2),
    (0.0004, 0.05, 0.01, 1),       # under the budget of one step: every step
    (0.5, 0.001, 0.01, 10_000),    # capped
    (0.0, 0.01, 0.01, 1),
])
def test_the_interval_spreads_the_training_threads_cost_over_the_budget(
        cost_s: float, step_s: float, budget: float, k: int) -> None:
    assert interval_for(cost_s, step_s, budget) == k


def test_interval_for_names_a_bad_value() -> None:
    with pytest.raises(ValueError, match="step_s=0"):
        interval_for(0.1, 0, 0.01)


def test_the_proposal_counts_the_training_threads_time_not_the_writes(shm: str) -> None:
    """The first snapshot's write is held while the next snapshot is taken and the
    interval proposed: the proposal is the training thread's cost of the snapshot
    just taken spread over the budget, and it stays so after the long write ends."""
    gate = _Gate()
    tier = SnapshotTier("run", info=ek.DistInfo(run_id="t"), every=None, budget=0.01,
                        root=shm, filesystem=gate.fs)
    assert tier.cost_s is None and tier.proposal(0.05) == 1
    tier.save({"w": torch.ones(100_000)}, step=1, metadata={})
    first: Any = tier.cost_s
    assert gate.entered.wait(60)
    tier.save({"w": torch.ones(100_000)}, step=2, metadata={})
    cost: Any = tier.cost_s
    assert cost is not None and first is not None
    k = tier.proposal(0.05)  # the median of the two snapshots' costs
    assert k == max(1, math.ceil((first + cost) / 2 / (0.01 * 0.05)))
    gate.opened.set()
    assert tier.wait(timeout=60) and tier.written == [1, 2]
    assert tier.cost_s == cost and tier.proposal(0.05) == k  # the write added nothing
    tier.close(remove=True)


def test_a_cpu_states_write_counts_its_cpu_seconds_in_the_cost_not_its_wall_time(
        shm: str) -> None:
    """CPU training keeps the cores busy, so the CPU a snapshot's write takes is taken
    from training: it is added to that snapshot's cost (known at the next snapshot);
    the write's wall time, here mostly held waiting, is not."""
    gate = _Gate()
    tier = SnapshotTier("run", info=ek.DistInfo(run_id="t"), every=None, budget=0.01,
                        root=shm, filesystem=gate.fs)
    tier.save({"w": torch.ones(100_000)}, step=1, metadata={})
    taken: Any = tier.cost_s
    assert gate.entered.wait(60)
    held = threading.Event()
    held.wait(0.5)                                  # the write waits: no CPU
    gate.opened.set()
    assert tier.wait(timeout=60) and tier.written == [1]
    assert not tier.write_cpu_costs                 # known at the next snapshot
    tier.save({"w": torch.ones(100_000)}, step=2, metadata={})
    (cpu,) = tier.write_cpu_costs
    assert 0.0 < cpu < 0.5
    first, second = tier._costs
    assert first == pytest.approx(taken + cpu) and second == tier.cost_s
    assert tier.proposal(0.05) == math.ceil((first + second) / 2 / (0.01 * 0.05))
    assert tier.wait(timeout=60)
    tier.close(remove=True)


def test_the_training_thread_copies_what_the_writer_has_not_reached_instead_of_waiting(
        ) -> None:
    """On a busy machine the writer thread may get no CPU before the optimizer step:
    the step's wait for the deferred copy then does the copy itself (bounded by one
    copy), here with no writer thread at all."""
    from elastic_kit.snapshot._staging import StagingBuffers, storage_keys

    live = {"w": torch.arange(1000.0), "b": torch.ones(10), "n": 3}
    staged = StagingBuffers().stage(live, later=storage_keys([live["w"], live["b"]]))
    assert not staged.staged.is_set()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (staged.wait_staged(), done.set()))
    waiter.start()
    waiter.join(timeout=60)
    assert done.is_set(), "wait_staged waited for a writer thread that never ran"
    live["w"].fill_(-1.0)                       # the optimizer step, after staging
    assert torch.equal(staged.state["w"], torch.arange(1000.0))
    assert torch.equal(staged.state["b"], torch.ones(10)) and staged.state["n"] == 3
    staged.copy_deferred()                      # the writer, late: nothing left to copy
    assert torch.equal(staged.state["w"], torch.arange(1000.0))


def test_a_tensor_that_requires_grad_is_staged_as_plain_values(shm: str) -> None:
    """Tensors a state dict gives detached are staged as they are; one that requires
    grad (a parameter kept in the user's extras) is detached first, so its staged copy
    and the snapshot hold values, not a node of the autograd graph."""
    from elastic_kit.snapshot._staging import StagingBuffers, storage_keys

    p = nn.Parameter(torch.arange(6.0))
    live = {"p": p, "m": torch.ones(4)}
    for later in (frozenset(), storage_keys([p])):
        staged = StagingBuffers().stage(live, later=later)
        staged.copy_deferred()
        assert not staged.state["p"].requires_grad and staged.state["p"].grad_fn is None
        assert torch.equal(staged.state["p"], torch.arange(6.0))
    assert p.requires_grad and p.grad_fn is None   # the live one is unchanged

    tier = SnapshotTier("/durable", info=ek.DistInfo(run_id="job"), every=1, root=shm)
    tier.save({"model": {"p": p}}, step=1, metadata={})
    assert tier.wait(timeout=60)
    loaded = tier.load()
    assert loaded is not None and not loaded.state["model"]["p"].requires_grad
    assert torch.equal(loaded.state["model"]["p"], torch.arange(6.0))
    tier.close(remove=True)
