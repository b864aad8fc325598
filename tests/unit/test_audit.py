"""The sample audit catches a missed, a repeated and a swapped sample."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from elastic_kit.loop import EpochAudit, SampleAudit, expected_digest, sample_digest
from elastic_kit.state._audit import AuditSum, normalize

N = 50


def _audit(ids: list[int]) -> EpochAudit:
    a = EpochAudit(0)
    a.add(sample_digest(ids))
    a.finish(N)
    return a


def test_every_sample_once_in_any_order_and_split_passes() -> None:
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    a = EpochAudit(0)
    for chunk in perm.split(7):
        a.add(sample_digest(chunk))
    assert a.finish(N) is True
    assert "all 50 samples exactly once" in a.message
    assert torch.equal(normalize(sample_digest(perm)), expected_digest(N))


def test_missing_sample_is_reported() -> None:
    a = _audit([i for i in range(N) if i != 17])
    assert a.ok is False and a.count == N - 1
    assert "missed" in a.message


def test_repeated_sample_is_reported() -> None:
    a = _audit(list(range(N)) + [3])
    assert a.ok is False and "repeated" in a.message


def test_one_missed_and_one_repeated_with_the_same_count_is_reported() -> None:
    a = _audit([i for i in range(N) if i != 10] + [11])
    assert a.count == N and a.ok is False
    assert "missed and others repeated" in a.message


def test_audit_state_round_trips() -> None:
    s = SampleAudit()
    s.record(2, torch.arange(10))
    s.sync(2)  # no process group: identity
    s2 = SampleAudit()
    s2.load_state_dict(s.state_dict())
    assert s2.epochs[2].count == 10 and s2.epochs[2].digest == s.epochs[2].digest


def test_a_span_of_steps_digests_to_what_each_step_recorded_alone() -> None:
    """Consecutive steps are digested as one span, lazily; the audit must come out as
    if each step's real samples had been recorded when it ran, padding left out."""
    from elastic_kit.state import AuditSpan

    indices = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    real = torch.arange(N) < N - 3  # the last three positions are padding
    per_step, spanned, span = SampleAudit(), SampleAudit(), AuditSpan()
    steps = [(0, 8), (8, 16), (16, 30), (35, 50)]  # a gap: (35, 50) starts a new span
    for a, b in steps:
        per_step.record(0, indices[a:b][real[a:b]])
        span.note(spanned, 0, indices, real, a, b)
    span.digest(spanned)
    span.digest(spanned)  # nothing pending: digesting twice adds nothing
    assert torch.equal(spanned._pending[0], per_step._pending[0])


def test_a_sum_started_for_a_snapshot_holds_its_step_and_is_folded_in_when_next_used() -> None:
    audit = SampleAudit()
    audit.record(0, torch.arange(0, 4))
    audit.sync(0)
    audit.record(0, torch.arange(4, 10))
    started = audit.sync_async(0)
    audit.record(0, torch.arange(10, 12))  # the next step: not the snapshot's
    view = started.state_dict()
    assert [(e["epoch"], e["count"]) for e in view] == [(0, 10)]
    assert view[0]["digest"] == int(normalize(sample_digest(torch.arange(10)))[1])
    assert audit.epochs[0].count == 4  # not folded in yet
    assert audit.epoch(0).count == 10  # folded in when used
    audit.sync(0)
    assert audit.epochs[0].count == 12 and audit.state_dict()[0]["count"] == 12


def test_a_sum_started_in_a_new_epoch_keeps_the_closed_epochs() -> None:
    audit = SampleAudit()
    audit.record(0, torch.arange(6))
    audit.sync(0)
    audit.epoch(0).finish(6)
    audit.record(1, torch.arange(3))
    view = audit.sync_async(1).state_dict()
    assert [(e["epoch"], e["count"], e["ok"]) for e in view] == [(0, 6, True), (1, 3, None)]
    assert [e["count"] for e in audit.state_dict()] == [6, 3]  # taking the state folds it


def test_giving_up_a_sum_ends_every_wait_for_it() -> None:
    """A peer that died never joins the sum: the rank exiting alone gives it up, and
    the snapshot writer waiting for it (with a long timeout) stops at once."""
    def never(timeout: float | None) -> torch.Tensor:
        time.sleep(timeout if timeout is not None else 0.01)
        raise TimeoutError("not done")

    pending = AuditSum(0, [], never)
    outcome: list[BaseException] = []

    def writer() -> None:
        try:
            pending.total(timeout=60.0)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    with pytest.raises(TimeoutError):
        pending.total(timeout=0.1)  # the exiting rank's grace
    pending.give_up()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    assert "given up" in str(outcome[0])
