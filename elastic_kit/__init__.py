"""elastic_kit: make a plain PyTorch DDP training script elastic under torchrun.

The pieces, each usable alone:

- :class:`ElasticDistributedSampler`: one world-size-independent permutation per
  epoch and a global position in it, so an epoch resumes exactly at any world size.
- :class:`CheckpointStore` / :func:`save_checkpoint` / :func:`load_checkpoint`:
  crash-safe checkpoints on any fsspec URL, with a broadcast from the holder of the
  newest checkpoint when storage is node-local.
- :func:`init_distributed` / :func:`wrap_ddp`: the torchrun environment and DDP.
- :class:`TrainState` and the elastic run loop: resume from the newest state after
  any restart, with a trajectory that does not depend on the world size.
"""

from __future__ import annotations

__version__ = "0.1.0"

from elastic_kit.distributed import (
    DistInfo,
    destroy_distributed,
    get_dist_info,
    init_distributed,
    unwrap_model,
    wrap_ddp,
)
from elastic_kit.checkpoint import (
    CheckpointInfo,
    CheckpointStore,
    LoadedCheckpoint,
    load_checkpoint,
    save_checkpoint,
)
from elastic_kit.loop import (
    BatchPolicy,
    ElasticLoop,
    EpochAudit,
    EpochSummary,
    FixedGlobalBatch,
    LinearLRScaling,
    LoopConfig,
    SeededDataset,
    StepInfo,
    TrainState,
)
from elastic_kit.sampler import ElasticDistributedSampler
from elastic_kit.errors import (
    BatchPolicyError,
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
    "save_checkpoint",
    "load_checkpoint",
    "TrainState",
    "ElasticLoop",
    "LoopConfig",
    "StepInfo",
    "EpochSummary",
    "BatchPolicy",
    "FixedGlobalBatch",
    "LinearLRScaling",
    "EpochAudit",
    "SeededDataset",
    "DistInfo",
    "init_distributed",
    "get_dist_info",
    "destroy_distributed",
    "wrap_ddp",
    "unwrap_model",
    "ElasticKitError",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "UnsafeCheckpointError",
    "SampleAuditError",
    "BatchPolicyError",
]
