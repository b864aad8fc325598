"""ElasticLoop: the run loop that makes a DDP script elastic.

One :meth:`ElasticLoop.run` call is one life of a worker group: restore the newest
checkpoint, train until the last epoch, ``max_steps`` or SIGTERM, checkpoint on the
way. torchrun calls the script again after a restart and the next ``run`` continues.

How a step is built (see :mod:`elastic_kit.loop.policy`): at the start of an epoch
(or of a resumed part of one) the sampler deals the rest of the epoch's permutation
to the ranks; step ``k`` of that part is local positions ``[k*P, (k+1)*P)`` of every
rank (``P = G / W``), which is the contiguous global chunk ``rem[k*G:(k+1)*G]``
whatever ``W`` is. The loop feeds it in micro-batches, weights each real sample's
loss by ``W / n_real`` and padded ones by 0, steps the optimizer, then advances the
sampler by ``n_real`` and records the ids in the audit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from elastic_kit.distributed import (
    DistInfo, all_reduce_sum, all_reduce_sum_async, init_distributed,
)
from elastic_kit.errors import SampleAuditError
from elastic_kit.loop.config import EpochSummary, LoopConfig, StepInfo
from elastic_kit.loop.data import CollateWithIds, KeyedDataset, ScheduleBatchSampler, to_device
from elastic_kit.loop.policy import BatchPlan
from elastic_kit.loop.progress import ProgressReporter
from elastic_kit.loop.signals import TerminationFlag
from elastic_kit.loop.state import TrainState
from elastic_kit.sampler import ElasticDistributedSampler

__all__ = ["LoopConfig", "ElasticLoop", "EpochSummary", "StepInfo"]

log = logging.getLogger("elastic_kit.loop")

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class _Step:
    n_real: int
    micro: list[tuple[int, int]] = field(default_factory=list)  # (start, end) local


class _Stop(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ElasticLoop:
    """Train ``state`` on ``dataset`` elastically; see the package docstring.

    Args:
        state: the :class:`TrainState` (model, optimizer, ...). Its ``sampler`` is
            created when ``None``.
        dataset: a map-style dataset; wrap it in :class:`~elastic_kit.loop.SeededDataset`
            for per-sample seeded augmentation.
        loss_fn: ``loss_fn(model, batch) -> Tensor[B]``: one loss per sample of the
            collated micro-batch ``batch`` (already on the model's device); e.g.
            ``criterion(model(x), y)`` with ``reduction="none"``.
        store: a :class:`~elastic_kit.CheckpointStore` (or anything with its
            ``load``/``save``/``wait``); ``None`` trains without checkpoints.
        config: a :class:`LoopConfig`.
        on_epoch_end: ``fn(state, summary)`` after every epoch, on every rank, before
            the epoch's checkpoint (validation; update ``state.extras`` here).
        on_step_end: ``fn(state, step_info)`` after every optimizer step, every rank.

    Mixed precision: wrap the forward pass in ``torch.autocast`` inside ``loss_fn``
    and pass a ``GradScaler`` as ``TrainState(scaler=...)``; the loop scales, unscales
    (for ``clip_grad_norm``), steps and updates it.

    .. warning::
        ``on_epoch_end`` runs on every rank and may use collectives (a distributed
        validation), but must not call :meth:`run` or save the store itself.

    Attributes:
        info: this worker's :class:`~elastic_kit.DistInfo` (set by :meth:`run`).
        plan: the :class:`~elastic_kit.loop.BatchPlan` at the current world size.
        restored_step: the checkpoint step :meth:`run` restored, or ``None``.
        summaries: the :class:`EpochSummary` of every epoch this run finished.
        samples_per_second: the latest throughput estimate (all ranks together).

    Raises (from :meth:`run`):
        BatchPolicyError: the global batch does not divide by the world size.
        SampleAuditError: an epoch missed or repeated a sample (``audit="error"``).
        SystemExit: with ``sigterm_exit_code`` after a SIGTERM checkpoint.
    """

    def __init__(self, state: TrainState, dataset: Any, *, loss_fn: LossFn,
                 store: Any = None, config: LoopConfig | None = None,
                 on_epoch_end: Callable[[TrainState, EpochSummary], None] | None = None,
                 on_step_end: Callable[[TrainState, StepInfo], None] | None = None) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn={loss_fn!r} must be callable: (model, batch) -> losses")
        if state.optimizer is None:
            raise ValueError("TrainState.optimizer is None: the loop needs an optimizer")
        self.state = state
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.store = store
        self.config = config or LoopConfig()
        self.on_epoch_end = on_epoch_end
        self.on_step_end = on_step_end
        self.policy = self.config.policy()
        self.info: DistInfo | None = None
        self.plan: BatchPlan | None = None
        self.restored_step: int | None = None
        self.summaries: list[EpochSummary] = []
        self.samples_per_second = 0.0
        self._stop = TerminationFlag()
        self._last_saved_step: int | None = None
        self._last_save_time = time.monotonic()
        self._loader: DataLoader | None = None
        self._batches = ScheduleBatchSampler()
        self._progress: ProgressReporter | None = None

    # ------------------------------------------------------------------ setup
    @property
    def sampler(self) -> Any:
        """The :class:`~elastic_kit.ElasticDistributedSampler` in use."""
        return self.state.sampler

    def request_stop(self) -> None:
        """Stop at the end of the current step as if SIGTERM had arrived."""
        self._stop.set()

    def _setup(self) -> None:
        info = self.info = init_distributed()
        state, cfg = self.state, self.config
        if state.sampler is None:
            state.sampler = ElasticDistributedSampler(
                self.dataset, num_replicas=info.world_size, rank=info.rank,
                shuffle=cfg.shuffle, seed=cfg.seed)
        elif (state.sampler.num_replicas, state.sampler.rank) != (info.world_size, info.rank):
            raise ValueError(
                f"sampler has num_replicas={state.sampler.num_replicas}, "
                f"rank={state.sampler.rank}; this worker is rank {info.rank} of "
                f"{info.world_size}")
        if getattr(state.sampler, "drop_last", False):
            raise ValueError(
                "the sampler has drop_last=True; the loop needs drop_last=False (it pads "
                "the tail of an epoch and gives the padding zero weight, so every sample "
                "counts once)")
        if info.world_size > 1 and not hasattr(state.model, "no_sync"):
            log.warning("world size %d but the model is not DistributedDataParallel: "
                        "gradients are not averaged over ranks (use wrap_ddp)",
                        info.world_size)
        # Fail on an impossible batch plan before touching the store.
        self.policy.plan(info.world_size, state.initial_world_size or info.world_size)
        restored = self.store.load(map_location="cpu") if self.store is not None else None
        old_world = None
        if restored is not None:
            saved = restored.state
            hist = saved.get("history") if isinstance(saved, dict) else None
            old_world = hist[-1]["world_size"] if hist else (restored.metadata or {}).get(
                "world_size")
            state.load_state_dict(saved)
            self.restored_step = int(restored.step)
            self._last_saved_step = self.restored_step
        if state.initial_world_size is None:
            state.initial_world_size = info.world_size
        self.plan = self.policy.plan(info.world_size, state.initial_world_size)
        state.apply_lr_scale(self.plan.lr_scale)
        state.history.append({"world_size": info.world_size, "step": state.step,
                              "restart": info.restart_count,
                              "restored_step": self.restored_step})
        if info.is_main:
            if restored is not None:
                log.info(
                    "restored checkpoint step %d: epoch %d, %d/%d samples of the epoch done; "
                    "world size %s -> %d (restart %d)", state.step, state.epoch,
                    state.sampler.consumed, state.sampler.dataset_length, old_world,
                    info.world_size, info.restart_count)
            else:
                log.info("no checkpoint to restore: starting at step 0 with world size %d",
                         info.world_size)
            log.info("batch plan: global batch %d = %d ranks x %d (micro-batch %d, %d "
                     "accumulation steps), lr scale %.4g", self.plan.global_batch,
                     self.plan.world_size, self.plan.per_rank, self.plan.micro_batch,
                     self.plan.accumulation_steps, self.plan.lr_scale)

    def _make_loader(self) -> DataLoader:
        cfg = self.config
        kwargs: dict[str, Any] = {}
        if cfg.num_workers > 0:
            kwargs["persistent_workers"] = cfg.persistent_workers
            if cfg.prefetch_factor is not None:
                kwargs["prefetch_factor"] = cfg.prefetch_factor
        return DataLoader(KeyedDataset(self.dataset), batch_sampler=self._batches,
                          num_workers=cfg.num_workers, pin_memory=cfg.pin_memory,
                          collate_fn=CollateWithIds(cfg.collate_fn), **kwargs)

    def _remaining_samples(self) -> int:
        s, n = self.state.sampler, self.state.sampler.dataset_length
        return s.remaining + max(self.config.epochs - self.state.epoch - 1, 0) * n

    # --------------------------------------------------------------- the run
    def run(self) -> TrainState:
        """Restore, train, checkpoint; returns the state when training is done.

        Collective: every rank calls it.
        """
        self._setup()
        cfg, state = self.config, self.state
        assert self.info is not None and self.plan is not None
        total_steps = None
        if cfg.max_steps is not None:
            total_steps = max(cfg.max_steps - state.step, 0)
        self._progress = ProgressReporter(
            enabled=self.info.is_main, log_every=cfg.log_every,
            total_samples=self._remaining_samples(), total_steps=total_steps,
            progress_bar=cfg.progress_bar)
        self._loader = self._make_loader()
        if cfg.handle_signals:
            self._stop.install()
        try:
            while state.epoch < cfg.epochs:
                if self._max_steps_reached():
                    raise _Stop("max_steps")
                epoch = state.epoch
                state.sampler.set_epoch(epoch)
                summary = self._train_epoch(epoch)
                self._end_epoch(epoch, summary)
            if cfg.max_steps is None or not self._max_steps_reached():
                if self.info.is_main:
                    log.info("training finished: %d epochs, step %d", cfg.epochs, state.step)
            self._wait_for_saves()
        except _Stop as stop:
            if stop.reason == "sigterm":
                if self._last_saved_step != state.step:  # _end_epoch may have saved it
                    self._save(blocking=True)
                self._wait_for_saves()
                if self.info.is_main:
                    log.warning("stop requested (SIGTERM): saved step %d, exiting with %d",
                                state.step, cfg.sigterm_exit_code)
                raise SystemExit(cfg.sigterm_exit_code) from None
            if cfg.checkpoint_at_exit and self._last_saved_step != state.step:
                self._save(blocking=True)
            self._wait_for_saves()
            if self.info.is_main:
                log.info("max_steps=%d reached at epoch %d", cfg.max_steps, state.epoch)
        finally:
            if cfg.handle_signals:
                self._stop.uninstall()
            if self._progress is not None:
                self._progress.close()
            if self.store is not None:
                # Only reached with a save still pending when an exception is
                # propagating, possibly on this rank alone: no collective here, or it
                # would be matched against a peer's gradient all-reduce or block until
                # the timeout, and hide the real error.
                self.store.wait_local()
            self._loader = None
        return state

    def _wait_for_saves(self) -> None:
        """Collective wait for the in-flight save, on paths every rank takes together."""
        if self.store is not None:
            self.store.wait()

    def _max_steps_reached(self) -> bool:
        return self.config.max_steps is not None and self.state.step >= self.config.max_steps

    def _schedule(self, epoch: int) -> tuple[list[_Step], torch.Tensor]:
        """The steps of the rest of ``epoch`` and this rank's padding mask."""
        sampler, plan = self.state.sampler, self.plan
        assert plan is not None
        remaining = sampler.remaining
        local = sampler.local_indices()
        mask = sampler.local_padding_mask()
        n_steps = math.ceil(remaining / plan.global_batch)
        steps: list[_Step] = []
        ranges: list[tuple[int, int]] = []
        for k in range(n_steps):
            lo, hi = k * plan.per_rank, min((k + 1) * plan.per_rank, len(local))
            step = _Step(n_real=min(plan.global_batch, remaining - k * plan.global_batch))
            for a in range(lo, hi, plan.micro_batch):
                step.micro.append((a, min(a + plan.micro_batch, hi)))
            ranges.extend(step.micro)
            steps.append(step)
        self._batches.set(epoch, local, ranges)
        return steps, mask

    def _train_epoch(self, epoch: int) -> EpochSummary:
        cfg, state, info, plan = self.config, self.state, self.info, self.plan
        assert info is not None and plan is not None and self._loader is not None
        model, optimizer, scaler = state.model, state.optimizer, state.scaler
        steps, mask = self._schedule(epoch)
        device = next(iter(model.parameters())).device
        non_blocking = cfg.pin_memory and device.type == "cuda"
        model.train()
        t0 = time.monotonic()
        losses: list[float] = []
        samples = 0
        if not steps:  # resumed exactly at the end of the epoch
            return EpochSummary(epoch, 0, 0, 0.0, 0.0, float("nan"), info.world_size,
                                state.audit.epoch(epoch))
        batches = iter(self._loader)
        try:
            for k, step in enumerate(steps):
                if self._max_steps_reached():
                    raise _Stop("max_steps")
                weight = info.world_size / step.n_real
                optimizer.zero_grad(set_to_none=True)
                loss_sum = torch.zeros((), dtype=torch.float64, device=device)
                used: list[torch.Tensor] = []
                for j, (a, b) in enumerate(step.micro):
                    ids, batch = next(batches)
                    real = ~mask[a:b]
                    batch = to_device(batch, device, non_blocking)
                    last = j == len(step.micro) - 1
                    sync_ctx = (model.no_sync() if not last and hasattr(model, "no_sync")
                                else contextlib.nullcontext())
                    with sync_ctx:
                        per_sample = self.loss_fn(model, batch)
                        if per_sample.dim() != 1 or per_sample.shape[0] != b - a:
                            raise ValueError(
                                f"loss_fn must return one loss per sample (use "
                                f"reduction='none'): expected shape ({b - a},), got "
                                f"{tuple(per_sample.shape)}")
                        w = real.to(device=device, dtype=per_sample.dtype) * weight
                        loss = (per_sample * w).sum()
                        if scaler is not None:
                            scaler.scale(loss).backward()
                        else:
                            loss.backward()
                    loss_sum += loss.detach().to(torch.float64)
                    used.append(ids[real])
                # One small collective per step: stop flag, rank 0's clock, the loss.
                # Issued before optimizer.step and read after it, so it never waits
                # on the critical path.
                time_due = (info.is_main and cfg.checkpoint_every_seconds is not None and
                            time.monotonic() - self._last_save_time
                            >= cfg.checkpoint_every_seconds)
                flags_of = all_reduce_sum_async(torch.stack([
                    torch.tensor(float(self._stop.is_set()), dtype=torch.float64,
                                 device=device),
                    torch.tensor(float(time_due), dtype=torch.float64, device=device),
                    loss_sum]))
                self._before_optimizer_step()
                if scaler is not None:
                    if cfg.clip_grad_norm is not None:
                        scaler.unscale_(optimizer)
                        nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    if cfg.clip_grad_norm is not None:
                        nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
                    optimizer.step()
                if state.scheduler is not None and cfg.scheduler_interval == "step":
                    state.scheduler.step()
                state.step += 1
                state.sampler.advance(step.n_real)
                state.audit.record(epoch, torch.cat(used))
                flags = flags_of().tolist()
                loss_value = flags[2] / info.world_size
                losses.append(loss_value)
                samples += step.n_real
                self._after_step(epoch, step.n_real, loss_value)
                if flags[0] > 0:
                    raise _Stop("sigterm")
                # The epoch's last step is saved by _end_epoch (after the epoch hook).
                if k < len(steps) - 1 or not cfg.checkpoint_at_epoch_end:
                    every = cfg.checkpoint_every_steps
                    if (every is not None and state.step % every == 0) or flags[1] > 0:
                        self._save(blocking=cfg.blocking)
        finally:
            del batches  # drop prefetched batches (never counted)
        seconds = time.monotonic() - t0
        return EpochSummary(epoch, len(steps), samples, seconds,
                            samples / seconds if seconds > 0 else 0.0,
                            sum(losses) / len(losses), info.world_size,
                            state.audit.epoch(epoch))

    def _before_optimizer_step(self) -> None:
        """The parameters and optimizer state change next: finish the save's copy."""
        wait_staged = getattr(self.store, "wait_staged", None)
        if wait_staged is not None:
            wait_staged()

    def _copy_later(self) -> list[torch.Tensor]:
        """Tensors that change only in ``optimizer.step()``: params and optimizer state."""
        opt = self.state.optimizer
        out = [p for g in opt.param_groups for p in g["params"]]
        for st in opt.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        return out

    def _after_step(self, epoch: int, n_real: int, loss: float) -> None:
        assert self._progress is not None and self.info is not None
        lr = self.state.optimizer.param_groups[0].get("lr")
        lr = float(lr) if lr is not None else None
        self._progress.update(step=self.state.step, epoch=epoch, samples=n_real, loss=loss,
                              lr=lr, world_size=self.info.world_size)
        self.samples_per_second = self._progress.samples_per_second
        if self.on_step_end is not None:
            self.on_step_end(self.state, StepInfo(self.state.step, epoch, loss, n_real,
                                                  self.samples_per_second, lr,
                                                  self.info.world_size))

    def _end_epoch(self, epoch: int, summary: EpochSummary) -> None:
        cfg, state, info = self.config, self.state, self.info
        assert info is not None
        state.audit.sync(epoch)
        audit = state.audit.epoch(epoch)
        if cfg.audit != "off":
            if not audit.finish(state.sampler.dataset_length):
                if info.is_main:
                    log.error("SAMPLE AUDIT FAILED: %s", audit.message)
                if cfg.audit == "error":
                    raise SampleAuditError(audit.message)
            elif info.is_main:
                log.info("sample audit: %s", audit.message)
        if state.scheduler is not None and cfg.scheduler_interval == "epoch":
            state.scheduler.step()
        if self.on_epoch_end is not None:
            self.on_epoch_end(state, summary)
        self.summaries.append(summary)
        if info.is_main:
            log.info("epoch %d done: %d steps, %d samples in %.1fs (%.1f samples/s), "
                     "loss %.4f", epoch, summary.steps, summary.samples, summary.seconds,
                     summary.samples_per_second, summary.loss)
        stop = all_reduce_sum(torch.tensor([float(self._stop.is_set())]))[0] > 0
        state.epoch = epoch + 1
        state.sampler.set_epoch(epoch + 1)
        if cfg.checkpoint_at_epoch_end or stop:
            self._save(blocking=cfg.blocking or stop)
        if stop:
            raise _Stop("sigterm")

    def save(self, *, blocking: bool = True) -> None:
        """Checkpoint the state now (collective: every rank calls it)."""
        self._save(blocking=blocking)

    def _save(self, *, blocking: bool) -> None:
        state = self.state
        # Fold every rank's audit share in first so the checkpoint's audit matches
        # exactly the samples behind its model state.
        state.audit.sync(state.epoch)
        if self.store is None:
            return
        assert self.info is not None
        meta = {"epoch": state.epoch, "world_size": self.info.world_size,
                "consumed": int(state.sampler.consumed)}
        kw: dict[str, Any] = {}
        if not blocking and self.config.overlap_staging and hasattr(self.store, "wait_staged"):
            kw["copy_later"] = self._copy_later()
        self.store.save(state.state_dict(), step=state.step, metadata=meta, blocking=blocking,
                        **kw)
        self._last_saved_step = state.step
        self._last_save_time = time.monotonic()
