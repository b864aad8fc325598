"""What must survive a restart, and what every layer above needs about it.

:class:`TrainState` (model, optimizer, scheduler, scaler, sampler position, epoch,
step, RNG states, extras), the per-epoch sample audit (:class:`SampleAudit`,
:class:`EpochAudit`) and SIGTERM handling (:class:`TerminationFlag`). This package sits
below the checkpointer and the loop and imports neither.
"""

from __future__ import annotations

from elastic_kit.state._audit import (
    AuditSpan, AuditSum, EpochAudit, SampleAudit, expected_digest, normalize, sample_digest,
)
from elastic_kit.state._signals import (
    UNACTED_AFTER_S, UNHEARD_AFTER_S, UNHEARD_MAX_S, TerminationFlag,
)
from elastic_kit.state._train_state import (
    TrainState, plain_rng_state, raw_rng_state, rescale_lr,
)

__all__ = [
    "TrainState",
    "rescale_lr",
    "raw_rng_state",
    "plain_rng_state",
    "EpochAudit",
    "AuditSpan",
    "AuditSum",
    "SampleAudit",
    "sample_digest",
    "expected_digest",
    "normalize",
    "TerminationFlag",
    "UNHEARD_AFTER_S",
    "UNHEARD_MAX_S",
    "UNACTED_AFTER_S",
]
