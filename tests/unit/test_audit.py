"""The sample audit catches a missed, a repeated and a swapped sample."""

from __future__ import annotations

import torch

from elastic_kit.loop import EpochAudit, SampleAudit, expected_digest, sample_digest
from elastic_kit.state._audit import normalize

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
