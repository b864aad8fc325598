"""Exception types raised by elastic_kit.

Every user-facing error subclasses a builtin, so that ``except ValueError`` in a
user's script keeps working, while ``except ElasticKitError`` catches all of ours.
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
    """Base class of every error raised by elastic_kit."""


class CheckpointError(ElasticKitError, RuntimeError):
    """A checkpoint could not be written or read (storage failure, bad URL)."""


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
    """The global batch size cannot be served by the current world size."""
