"""The elastic run loop: resume, step, checkpoint, audit, stop on SIGTERM.

:class:`ElasticLoop` drives an ordinary DDP model through epochs of an
:class:`~elastic_kit.ElasticDistributedSampler`, built on the same public pieces a
script with its own loop uses (:class:`~elastic_kit.Checkpointer` for restore, saves,
SIGTERM and the audit). On start it restores the newest
checkpoint of a :class:`~elastic_kit.CheckpointStore` into a :class:`TrainState`
(model, optimizer, LR scheduler, grad scaler, sampler position, epoch, step, RNG
states, user extras), so a worker group that torchrun restarted at any world size
continues where the last committed checkpoint left off. It checkpoints every N steps
and/or T seconds (in the background), at the end of every epoch and, synchronously,
when torchrun sends SIGTERM; then it exits with status 143 so torchrun restarts the
group instead of reporting success.

Under the default ``fixed_global`` batch policy a step is always the same global
batch of the epoch's permutation, split over however many workers there are, with
gradient accumulation and per-sample loss weights, so the trajectory does not depend
on the world size. The id of every sample dealt to a completed optimizer step goes
into a per-epoch, order-independent digest that is checked against the dataset at
the end of the epoch (:class:`EpochAudit`).

Before (plain DDP)::

    dist.init_process_group("nccl")
    model = DDP(Net().cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = criterion(model(x.cuda()), y.cuda())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

After (elastic: run it under ``torchrun --nnodes=1:4 --max-restarts=3 ...``,
or as ``python train.py``)::

    import elastic_kit as ek

    ek.init_distributed()
    model = ek.wrap_ddp(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss(reduction="none")      # per-sample losses
    state = ek.TrainState(model, optimizer)
    loop = ek.ElasticLoop(
        state, dataset,
        loss_fn=lambda model, batch: criterion(model(batch[0]), batch[1]),
        store=ek.CheckpointStore("s3://bucket/run-1"),
        config=ek.LoopConfig(epochs=epochs, global_batch_size=256, micro_batch_size=64,
                             checkpoint=ek.CheckpointerConfig(every_steps=200)),
    )
    loop.run()

``loss_fn(model, batch)`` receives the model and a collated micro-batch already on
the worker's device and returns one loss per sample; the loop weights, accumulates
and steps. ``on_epoch_end=`` (validation, ``state.extras["best_acc1"]``),
``max_steps``, ``state.history`` and ``state.audit`` cover what a reference script
reports.
"""

from __future__ import annotations

from elastic_kit.state import (
    EpochAudit, SampleAudit, TerminationFlag, TrainState, expected_digest, sample_digest,
)
from elastic_kit.loop._policy import BatchPlan, BatchPolicy, FixedGlobalBatch, LinearLRScaling
from elastic_kit.loop._seeded import SeededDataset, seeded_rng
from elastic_kit.loop._config import EpochSummary, LoopConfig, StepInfo
from elastic_kit.loop._trainer import ElasticLoop

__all__ = [
    "TrainState",
    "ElasticLoop",
    "LoopConfig",
    "EpochSummary",
    "StepInfo",
    "BatchPolicy",
    "BatchPlan",
    "FixedGlobalBatch",
    "LinearLRScaling",
    "EpochAudit",
    "SampleAudit",
    "sample_digest",
    "expected_digest",
    "SeededDataset",
    "seeded_rng",
    "TerminationFlag",
]
