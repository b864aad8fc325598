"""Exception types raised by elastic_kit (each also importable as ``elastic_kit.<name>``).

Two kinds of error reach a script:

- A mistake in a call (an argument of the wrong type, a value out of range, a
  malformed URL): the builtin ``TypeError`` or ``ValueError``, as torch raises them,
  naming the argument, the value and what was expected. These are not
  :class:`ElasticKitError`: ``except ElasticKitError`` does not catch them.
- What elastic_kit finds wrong with the run, its checkpoints or its batch plan
  (storage failures, corruption, another writer, a checkpoint that does not fit, a
  sample audit, batch sizes the world size cannot serve): the types below, all
  :class:`ElasticKitError`, each also subclassing a builtin (``RuntimeError``, or
  ``ValueError`` for :class:`CheckpointMismatchError` and :class:`BatchPolicyError`)
  so that ``except RuntimeError`` / ``except ValueError`` in a script keeps working.
"""

from __future__ import annotations

__all__ = [
    "ElasticKitError",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointConflictError",
    "CheckpointMismatchError",
    "UnsafeCheckpointError",
    "SampleAuditError",
    "BatchPolicyError",
]


class ElasticKitError(Exception):
    """Base class of elastic_kit's own errors (not of the builtin ``TypeError`` /
    ``ValueError`` a wrong argument raises)."""


class CheckpointError(ElasticKitError, RuntimeError):
    """A checkpoint could not be written or read (a storage failure, an unreachable
    store). A malformed URL is a ``ValueError`` (a URL of the wrong type a
    ``TypeError``), raised when the store is made."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint exists but its manifest or checksums do not verify."""


class CheckpointConflictError(CheckpointError):
    """Another job commits checkpoints to the same URL: saving there is refused."""


class CheckpointMismatchError(ElasticKitError, ValueError):
    """A checkpoint does not fit what it is loaded into (other model, other dataset)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds objects that ``torch.load(weights_only=True)`` refuses.

    Raised instead of executing arbitrary pickled code.
    """


class SampleAuditError(ElasticKitError, RuntimeError):
    """An epoch did not see every sample exactly once."""


class BatchPolicyError(ElasticKitError, ValueError):
    """The batch sizes cannot be served: a global batch size missing, below 1 or not
    divisible by the current world size (a size of the wrong type is a ``TypeError``)."""
