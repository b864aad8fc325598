"""elastic_kit: make a plain PyTorch DDP training script elastic under torchrun.

``import elastic_kit as ek`` gives everything a training script calls; each piece works
alone in a script that keeps its own loop:

- :class:`ElasticDistributedSampler`: a drop-in for ``DistributedSampler`` whose epoch
  order does not depend on the world size and which keeps a global position in it, so
  an epoch resumes exactly at any world size.
- :class:`CheckpointStore` / :func:`save_checkpoint` / :func:`load_checkpoint`:
  crash-safe checkpoints on any fsspec URL; ``if rank == 0: save_checkpoint(...)``
  works, loading is collective and broadcasts from the holder of the newest one.
- :class:`Checkpointer` and :class:`TrainState`: make a script's own loop resumable
  mid-epoch with a handful of lines (restore, ``step(n)``, ``end_epoch()``).
- :class:`ElasticLoop`: the loop built from the same pieces, for scripts that hand it
  over, with a global batch kept fixed across world sizes.
- :func:`init_distributed` / :func:`wrap_ddp`: the torchrun environment and DDP.

Test helpers (a local torchrun cluster, etcd, N gloo ranks) are in
:mod:`elastic_kit.testing`; the exception types are here and in
:mod:`elastic_kit.errors`. An argument of the wrong type raises the builtin
``TypeError`` and a wrong value ``ValueError``, as in torch.
"""

from __future__ import annotations

from elastic_kit._version import __version__

from elastic_kit import errors
from elastic_kit.distributed import (
    DistInfo,
    destroy_distributed,
    get_dist_info,
    init_distributed,
    unwrap_model,
    wrap_ddp,
)
from elastic_kit.store import (
    CheckpointInfo,
    CheckpointStore,
    LoadedCheckpoint,
    SaveHandle,
    load_checkpoint,
    save_checkpoint,
)
from elastic_kit.sampler import ElasticDistributedSampler
from elastic_kit.loop import (
    ElasticLoop,
    EpochSummary,
    LoopConfig,
    SeededDataset,
    StepInfo,
    TrainState,
)
from elastic_kit.checkpointer import Checkpointer, CheckpointerConfig
from elastic_kit.errors import (
    BatchPolicyError,
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ElasticKitError,
    SampleAuditError,
    UnsafeCheckpointError,
)

__all__ = [
    "__version__",
    "ElasticDistributedSampler",
    "CheckpointStore",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "SaveHandle",
    "save_checkpoint",
    "load_checkpoint",
    "Checkpointer",
    "CheckpointerConfig",
    "TrainState",
    "ElasticLoop",
    "LoopConfig",
    "StepInfo",
    "EpochSummary",
    "SeededDataset",
    "DistInfo",
    "init_distributed",
    "get_dist_info",
    "destroy_distributed",
    "wrap_ddp",
    "unwrap_model",
    "errors",
    "ElasticKitError",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointConflictError",
    "UnsafeCheckpointError",
    "SampleAuditError",
    "BatchPolicyError",
]
