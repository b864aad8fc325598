"""ElasticLoop: the run loop that makes a DDP script elastic.

One :meth:`ElasticLoop.run` call is one life of a worker group: restore the newest
checkpoint, train until the last epoch, ``max_steps`` or SIGTERM, checkpoint on the
way. torchrun calls the script again after a restart and the next ``run`` continues.

How a step is built (see :mod:`elastic_kit.loop._policy`): at the start of an epoch
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
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import elastic_kit.checkpointer as _checkpointer
from elastic_kit._checks import type_error
from elastic_kit.distributed import (
    DistInfo, all_reduce_sum, averages_gradients, init_distributed,
)
from elastic_kit.loop._config import EpochSummary, LoopConfig, StepInfo
from elastic_kit.loop._data import ScheduleBatchSampler, loader_dataset, to_device
from elastic_kit.loop._policy import BatchPlan
from elastic_kit._console import say
from elastic_kit.loop._progress import ProgressReporter
from elastic_kit.state import TrainState
from elastic_kit.sampler import ElasticDistributedSampler

__all__ = ["ElasticLoop"]

log = logging.getLogger("elastic_kit.loop")

#: ``loss_fn(model, batch)``: one loss per sample, or ``(losses, outputs)`` where
#: ``outputs`` (logits, a dict of metrics...) reaches ``on_step_end`` in ``StepInfo.outputs``.
LossFn = Callable[[nn.Module, Any], Any]


@dataclass
class _Step:
    """One optimizer step of an epoch's schedule: its real samples over all ranks and
    this rank's micro-batches as ``(start, end)`` local positions."""

    n_real: int
    micro: list[tuple[int, int]] = field(default_factory=list)
    #: whether this rank's share of the step holds padding (only the epoch's last
    #: steps can): only then is each sample's loss weighted through the padding mask
    padded: bool = False


def _check_arguments(state: Any, loss_fn: Any, store: Any, config: Any, on_epoch_end: Any,
                     on_step_end: Any) -> None:
    """Refuse arguments of the wrong kind when the loop is made, not as an
    ``AttributeError`` at :meth:`ElasticLoop.run` (or after a whole epoch, for a hook)."""
    if not isinstance(state, TrainState):
        raise type_error("state", state, "an ek.TrainState (the model, optimizer and "
                                         "sampler together; a model goes in TrainState(model))")
    if not callable(loss_fn):
        raise type_error("loss_fn", loss_fn, "a callable (model, batch) -> losses")
    if store is not None and not isinstance(store, (str, os.PathLike)) and not all(
            callable(getattr(store, name, None)) for name in ("save", "load", "wait", "close")):
        raise type_error("store", store, "None, an ek.CheckpointStore (or a StoreLike) or a "
                                         "path or URL")
    if config is not None and not isinstance(config, LoopConfig):
        raise type_error("config", config, "None or an ek.LoopConfig")
    for name, hook in (("on_epoch_end", on_epoch_end), ("on_step_end", on_step_end)):
        if hook is not None and not callable(hook):
            raise type_error(name, hook, "None or a callable (state, info) -> None")


class ElasticLoop:
    """Train ``state`` on ``dataset`` elastically; see the package docstring.

    Built on the same public pieces a script with its own loop uses: the
    :class:`~elastic_kit.ElasticDistributedSampler` deals the epoch, a
    :class:`~elastic_kit.Checkpointer` restores, advances the sampler, audits, saves
    and handles SIGTERM, and a :class:`~elastic_kit.loop.BatchPlan` splits the fixed
    global batch over the current world size. One optimizer step is
    :meth:`forward_backward` (micro-batches with gradient accumulation and per-sample
    weights), :meth:`optimizer_step` (unscale and clip once, step, schedule) and the
    checkpointer's bookkeeping.

    Args:
        state: the :class:`TrainState` (model, optimizer, ...). Its ``sampler`` is
            created when ``None``.
        dataset: a map-style dataset; wrap it in :class:`~elastic_kit.SeededDataset`
            for per-sample seeded augmentation.
        loss_fn: ``loss_fn(model, batch)`` returns one loss per sample of the collated
            micro-batch ``batch`` (already on the model's device), e.g.
            ``criterion(model(x), y)`` with ``reduction="none"``; or a tuple
            ``(losses, outputs)`` whose ``outputs`` the ``on_step_end`` hook sees.
        store: a :class:`~elastic_kit.CheckpointStore` (or any
            :class:`~elastic_kit.checkpointer.StoreLike`), or a path or fsspec URL
            (a store is made from it with ``config.checkpoint``'s ``keep_last``);
            ``None`` trains without checkpoints. A store object keeps its own
            ``keep_last``: one set in ``config.checkpoint`` as well is refused
            (``TypeError``).
        config: a :class:`LoopConfig` (give one: its default batch policy needs
            ``global_batch_size``, and ``None`` stands for ``LoopConfig()``, which
            raises ``BatchPolicyError`` saying so).
        on_epoch_end: ``fn(state, summary)`` after every epoch, on every rank, before
            the epoch's checkpoint (validation; update ``state.extras`` here).
        on_step_end: ``fn(state, step_info)`` after every optimizer step, every rank;
            ``step_info`` has this rank's loss (the epoch's mean over all ranks is
            in :class:`EpochSummary`), the learning rate, throughput, the gradient
            norm when clipping, and the step's ``outputs``.

    Mixed precision: wrap the forward pass in ``torch.autocast`` inside ``loss_fn``
    and pass a ``GradScaler`` as ``TrainState(scaler=...)``; the loop scales, unscales
    (once, for ``clip_grad_norm``), steps and updates it.

    Progress: rank 0 reports restores, the batch plan, every ``log_every`` steps and
    every epoch through the ``elastic_kit`` logger when logging is configured, and on
    stderr otherwise, so it is visible by default.

    .. warning::
        ``on_epoch_end`` runs on every rank and may use collectives (a distributed
        validation), but must not call :meth:`run` or save the store itself.

    Attributes:
        info: this worker's :class:`~elastic_kit.DistInfo` (set by :meth:`run`).
        plan: the :class:`~elastic_kit.loop.BatchPlan` at the current world size.
        checkpointer: the :class:`~elastic_kit.Checkpointer` of this run.
        restored_step: the checkpoint step :meth:`run` restored, or ``None``.
        summaries: the :class:`EpochSummary` of every epoch this run finished.
        samples_per_second: the latest throughput estimate (all ranks together).

    Raises (when made): ``TypeError`` for an argument of the wrong kind (``state`` no
    :class:`TrainState`, ``config`` no :class:`LoopConfig`, a hook or ``loss_fn`` not
    callable), ``ValueError`` for a state the loop cannot train (no optimizer).

    Raises (from :meth:`run`):
        BatchPolicyError: the global batch does not divide by the world size.
        SampleAuditError: an epoch missed or repeated a sample (``audit="error"``).
        SystemExit: with ``checkpoint.exit_code`` (:class:`~elastic_kit.CheckpointerConfig`) after a
            SIGTERM checkpoint (or ``request_stop(restart=True)``).
    """

    def __init__(self, state: TrainState, dataset: Any, *, loss_fn: LossFn,
                 store: _checkpointer.StoreLike | str | os.PathLike[str] | None = None,
                 config: LoopConfig | None = None,
                 on_epoch_end: Callable[[TrainState, EpochSummary], None] | None = None,
                 on_step_end: Callable[[TrainState, StepInfo], None] | None = None) -> None:
        _check_arguments(state, loss_fn, store, config, on_epoch_end, on_step_end)
        if state.optimizer is None:
            raise ValueError("TrainState.optimizer is None: the loop needs an optimizer")
        if isinstance(state.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            # the loop calls scheduler.step() with no metric: torch's TypeError would
            # come after a whole epoch of training, at every restart
            raise TypeError(
                "TrainState.scheduler is a ReduceLROnPlateau, which steps on a metric, and "
                "the loop steps its scheduler without one: keep it in TrainState.extras "
                "(saved and restored with the state) and call its step(metric) in "
                "on_epoch_end")
        self.state = state
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.store = store
        self.config = config or LoopConfig()
        self.on_epoch_end = on_epoch_end
        self.on_step_end = on_step_end
        if (store is not None and not isinstance(store, (str, os.PathLike))
                and self.config.checkpoint.keep_last is not _checkpointer.DEFAULT_KEEP_LAST):
            # the store keeps what it was made to keep: said now, not at run()
            raise TypeError(
                f"config.checkpoint.keep_last={self.config.checkpoint.keep_last!r} "
                f"configures a store made from a URL; the loop's store is an existing "
                f"{type(store).__name__}, which keeps its own keep_last: make it with "
                f"that keep_last instead")
        self.policy = self.config.policy()
        self.info: DistInfo | None = None
        self.plan: BatchPlan | None = None
        self.checkpointer: _checkpointer.Checkpointer | None = None
        self.restored_step: int | None = None
        self.summaries: list[EpochSummary] = []
        self.samples_per_second = 0.0
        self._loader: DataLoader | None = None
        self._loader_generator: torch.Generator | None = None
        self._batches = ScheduleBatchSampler()
        self._device: torch.device | None = None  # the model's, looked up once an epoch
        self._weights: tuple[tuple[Any, ...], torch.Tensor] | None = None
        self._progress: ProgressReporter | None = None
        self._stop_requested = False
        self._stop_restart = False

    # ------------------------------------------------------------------ setup
    @property
    def sampler(self) -> Any:
        """The :class:`~elastic_kit.ElasticDistributedSampler` in use."""
        return self.state.sampler

    def request_stop(self, *, restart: bool = False) -> None:
        """Save and end training: every rank stops at the same step, within about
        0.4 s of training after the call (the ranks agree at their next flag exchange;
        with one rank, at the end of the current step). Steps trained in between are
        kept and saved.

        ``restart=False`` (early stopping, a time budget): :meth:`run` returns on every
        rank after the save, and the script ends as after the last epoch (torchrun
        then ends the job). ``restart=True``: as if SIGTERM had arrived on this rank
        (:meth:`run` raises ``SystemExit`` with the checkpointer's ``exit_code``, and
        torchrun restarts the group). A request is for the run in progress, or the
        next one when made before it: it ends with that run, and calling :meth:`run`
        again trains on."""
        self._stop_requested = True
        self._stop_restart = restart
        if self.checkpointer is not None:
            self.checkpointer.request_stop(restart=restart)

    def _setup(self) -> _checkpointer.Checkpointer:
        info = self.info = init_distributed()
        state, cfg = self.state, self.config
        if state.sampler is None:
            state.sampler = ElasticDistributedSampler(
                self.dataset, num_replicas=info.world_size, rank=info.rank,
                shuffle=cfg.shuffle, seed=cfg.seed)
        covered = getattr(state.sampler, "dataset_length", None)
        try:
            length: int | None = len(self.dataset)
        except TypeError:  # a map-style dataset without __len__: nothing to compare
            length = None
        if covered is not None and length is not None and covered != length:
            # a shorter one trains on a prefix of the data (its audit passes); a longer
            # one fails in the loader mid-epoch with an IndexError naming neither
            raise ValueError(
                f"state.sampler covers a dataset of {covered} samples, but the loop's "
                f"dataset has {length}: build the sampler on the loop's dataset "
                f"(or leave state.sampler None: the loop makes one)")
        if getattr(state.sampler, "drop_last", False):
            raise ValueError(
                "the sampler has drop_last=True; the loop needs drop_last=False (it pads "
                "the tail of an epoch and gives the padding zero weight, so every sample "
                "counts once)")
        # DDP (no_sync) and FSDP2 (set_requires_gradient_sync) average the gradients
        if info.world_size > 1 and not averages_gradients(state.model):
            log.warning("world size %d but the model is neither DistributedDataParallel "
                        "nor FSDP2: gradients are not averaged over ranks (use wrap_ddp)",
                        info.world_size)
        # Fail on an impossible batch plan before touching the store.
        self.policy.plan(info.world_size, state.initial_world_size or info.world_size)
        ckpt = self.checkpointer = _checkpointer.Checkpointer(
            state, self.store, **cfg.checkpointer_options(), info=info)
        # a state of an epoch's last step holds that epoch's scheduler step (see
        # train_step), and _end_restored_epoch runs its on_epoch_end after a restore
        ckpt.replays_epoch_end = True
        if self._stop_requested:
            ckpt.request_stop(restart=self._stop_restart)
        try:
            ckpt.restore(map_location="cpu")
        except BaseException:
            ckpt.abandon()  # what the restore set up (hooks, threads) goes with it
            raise
        self.restored_step = ckpt.restored_step
        self.plan = self.policy.plan(info.world_size, state.initial_world_size or info.world_size)
        state.apply_lr_scale(self.plan.lr_scale)
        if info.is_main:
            say(log, "batch plan: global batch %d = %d ranks x %d (micro-batch %d, %d "
                "accumulation steps), lr scale %.4g", self.plan.global_batch,
                self.plan.world_size, self.plan.per_rank, self.plan.micro_batch,
                self.plan.accumulation_steps, self.plan.lr_scale)
        return ckpt

    def _make_loader(self) -> DataLoader:
        cfg = self.config
        kwargs: dict[str, Any] = {}
        if cfg.num_workers > 0:
            kwargs["persistent_workers"] = cfg.persistent_workers
            if cfg.prefetch_factor is not None:
                kwargs["prefetch_factor"] = cfg.prefetch_factor
        dataset, self._batches.keyed = loader_dataset(self.dataset)
        # Each iterator draws its workers' base seed from the loader's generator, or
        # from torch's global one without it: an iterator made where a restart
        # resumed (mid-epoch) would then shift every later draw of the global
        # generator (dropout) from the uninterrupted run's. Seeded per epoch in
        # train_epoch.
        self._loader_generator = torch.Generator()
        return DataLoader(dataset, batch_sampler=self._batches, num_workers=cfg.num_workers,
                          pin_memory=cfg.pin_memory, collate_fn=cfg.collate_fn,
                          generator=self._loader_generator, **kwargs)

    def _remaining_samples(self) -> int:
        s, n = self.state.sampler, self.state.sampler.dataset_length
        return s.remaining + max(self.config.epochs - self.state.epoch - 1, 0) * n

    # --------------------------------------------------------------- the run
    def run(self) -> TrainState:
        """Restore, train, checkpoint; returns the state when training is done.

        Collective: every rank calls it.
        """
        ckpt = self._setup()
        cfg, state, info = self.config, self.state, self.info
        assert info is not None
        total_steps = None if cfg.max_steps is None else max(cfg.max_steps - state.step, 0)
        finished = False
        self._progress = None
        try:
            self._progress = ProgressReporter(
                enabled=info.is_main, log_every=cfg.log_every,
                total_samples=self._remaining_samples(), total_steps=total_steps,
                progress_bar=cfg.progress_bar)
            if ckpt.finished_at_restore is not None:
                self._end_restored_epoch(ckpt.finished_at_restore)
            # A group restarted after the end trains nothing: no loader, no workers.
            self._loader = None if self._done() else self._make_loader()
            while not self._done():
                epoch = state.epoch
                state.sampler.set_epoch(epoch)
                summary = self.train_epoch(epoch)
                if self._max_steps_reached() and state.sampler.remaining > 0:
                    break  # stopped inside the epoch
                self._end_epoch(summary)
            if (cfg.checkpoint_at_exit and ckpt.store is not None
                    and ckpt.last_saved_step != state.step):
                # the run's end is saved (an epoch end may not be: save_at_epoch_end
                # off), so a restart after it trains nothing again
                ckpt.save(blocking=True)
            if self._max_steps_reached():
                if info.is_main:
                    say(log, "max_steps=%d reached at step %d, epoch %d", cfg.max_steps,
                        state.step, state.epoch)
            elif info.is_main:
                say(log, "training finished: %d epochs, step %d", cfg.epochs, state.step)
            ckpt.close()
            finished = True
        except _checkpointer.FinishedEarly:
            finished = True  # request_stop(): saved, and the checkpointer closed
        finally:
            if self._progress is not None:
                self._progress.close()
            if not finished:
                # An exception (or SystemExit after a SIGTERM save) is propagating,
                # possibly on this rank alone: no collective here, or it would be
                # matched against a peer's gradient all-reduce or block until the
                # timeout, and hide the real error.
                ckpt.abandon()
            self._loader = None
            self._stop_requested = self._stop_restart = False  # it ended this run
        return state

    def _done(self) -> bool:
        """Whether training is over: the last epoch or ``max_steps`` reached."""
        return self.state.epoch >= self.config.epochs or self._max_steps_reached()

    def _max_steps_reached(self) -> bool:
        return self.config.max_steps is not None and self.state.step >= self.config.max_steps

    # --------------------------------------------------------------- an epoch
    def _schedule(self, epoch: int) -> tuple[list[_Step], torch.Tensor]:
        """The steps of the rest of ``epoch`` and this rank's padding mask."""
        sampler, plan = self.state.sampler, self.plan
        assert plan is not None
        remaining = sampler.remaining
        local = sampler.local_indices()
        mask = sampler.local_padding_mask()
        n_steps = math.ceil(remaining / plan.global_batch)
        n_local = len(local)
        pads = mask.nonzero()
        first_pad = int(pads[0]) if len(pads) else n_local  # padding is a tail, if any
        steps: list[_Step] = []
        ranges: list[tuple[int, int]] = []
        # plain integer arithmetic: an epoch of 1e6 samples has ~3e4 steps, and this
        # runs at every epoch start and every resume
        per_rank, micro, g = plan.per_rank, plan.micro_batch, plan.global_batch
        for k in range(n_steps):
            lo = k * per_rank
            hi = lo + per_rank if lo + per_rank < n_local else n_local
            rest = remaining - k * g
            parts = [(a, a + micro if a + micro < hi else hi) for a in range(lo, hi, micro)]
            steps.append(_Step(n_real=g if rest > g else rest, micro=parts,
                               padded=hi > first_pad))
            ranges.extend(parts)
        self._batches.set(epoch, local, ranges)
        return steps, mask

    def train_epoch(self, epoch: int) -> EpochSummary:
        """Train the rest of ``epoch`` (all of it unless resumed mid-epoch)."""
        state, info = self.state, self.info
        assert info is not None and self._loader is not None
        steps, mask = self._schedule(epoch)
        state.model.train()
        self._device = next(iter(state.model.parameters())).device
        t0 = time.monotonic()
        done = 0
        loss_total: torch.Tensor | None = None  # this rank's, summed over the steps (fp64)
        samples = 0
        if steps:
            if self._loader_generator is not None:
                self._loader_generator.manual_seed(
                    (self.config.seed * 1_000_003 + epoch) % (1 << 63))
            batches = iter(self._loader)
            try:
                for step in steps:
                    if self._max_steps_reached():
                        break
                    loss = self.train_step(epoch, step, batches, mask)
                    if loss_total is None:
                        loss_total = loss.to(torch.float64, copy=True)
                    else:
                        loss_total.add_(loss)
                    done += 1
                    samples += step.n_real
            finally:
                del batches  # drop prefetched batches (never counted)
        seconds = time.monotonic() - t0
        mean_loss = float("nan")
        if loss_total is not None:  # one collective per epoch, the same steps on every rank
            mean_loss = float(all_reduce_sum(loss_total.cpu().view(1))[0]) / (
                info.world_size * done)
        return EpochSummary(epoch, done, samples, seconds,
                            samples / seconds if seconds > 0 else 0.0, mean_loss,
                            info.world_size, state.audit.epoch(epoch))

    # ---------------------------------------------------------------- a step
    def train_step(self, epoch: int, step: _Step, batches: Iterator[Any],
                   mask: torch.Tensor) -> torch.Tensor:
        """One optimizer step: forward/backward, optimizer step, bookkeeping; this
        rank's loss of the step (a 0-dim tensor on the model's device; summed over
        ranks it is ``world_size`` times the step's mean loss).

        Nothing here waits on the other ranks beyond DDP's own gradient all-reduce:
        the checkpointer's flags travel in an occasional overlapped exchange, and
        the loss is not all-reduced per step.
        """
        ckpt, info = self.checkpointer, self.info
        assert ckpt is not None and info is not None and self.plan is not None
        loss_sum, outputs = self.forward_backward(step, batches, mask)
        lr = self.state.optimizer.param_groups[0].get("lr")  # the step's (a per-step
        lr = float(lr) if lr is not None else None          # scheduler changes it next)
        grad_norm = self.optimizer_step()
        state = self.state
        if (state.scheduler is not None and self.config.scheduler_interval == "epoch"
                and state.sampler.remaining <= step.n_real):
            # the epoch's last step: its scheduler step is part of the step, so that
            # any save of it (a SIGTERM's, at once; a snapshot as the process fails)
            # holds it; a restart at an exhausted epoch moves straight on
            state.scheduler.step()
        ckpt.record_step(self.plan.per_rank)
        loss = loss_sum.detach()
        self._report(epoch, step.n_real, loss, grad_norm, outputs, lr)
        ckpt.after_step()
        return loss

    def forward_backward(self, step: _Step, batches: Iterator[Any],
                         mask: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Run the step's micro-batches with gradient accumulation.

        Each real sample's loss is weighted ``W / n_real`` and padding 0, so DDP's
        average over ``W`` ranks is the mean over the step's real samples whatever
        ``W`` is. Under DDP, gradients are all-reduced only on the last micro-batch;
        an FSDP2 model reduce-scatters them on every micro-batch (not syncing would
        keep each rank's gradients unsharded between micro-batches: the whole model's
        size per rank, which FSDP is there to avoid).

        Returns:
            ``(sum of weighted losses on this rank, outputs of loss_fn)``.
        """
        state, cfg = self.state, self.config
        assert self.info is not None
        model, scaler = state.model, state.scaler
        device = self._device
        if device is None:  # called outside train_epoch
            device = next(iter(model.parameters())).device
        non_blocking = cfg.pin_memory and device.type == "cuda"
        weight = self.info.world_size / step.n_real
        state.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        outputs: list[Any] = []
        for j, (a, b) in enumerate(step.micro):
            batch = next(batches)
            if device.type != "cpu":  # a loader's batches are on the CPU already
                batch = to_device(batch, device, non_blocking)
            last = j == len(step.micro) - 1
            sync = (model.no_sync() if not last and hasattr(model, "no_sync")
                    else contextlib.nullcontext())
            with sync:
                per_sample = self.loss_fn(model, batch)
                if isinstance(per_sample, tuple):
                    per_sample, out = per_sample
                    outputs.append(out)
                if per_sample.dim() != 1 or per_sample.shape[0] != b - a:
                    raise ValueError(
                        f"loss_fn must return one loss per sample (use reduction='none'): "
                        f"expected shape ({b - a},), got {tuple(per_sample.shape)}")
                if step.padded:
                    w = (~mask[a:b]).to(device=device, dtype=per_sample.dtype) * weight
                else:  # no padding: one weight for all, reused from step to step
                    w = self._uniform_weights(b - a, weight, per_sample)
                # d(sum_i w_i * loss_i)/d loss_i = w_i: backward from the per-sample
                # losses with the weights as their gradient is the weighted sum's
                # backward without its two autograd nodes (a sum and a product cost
                # a short step more than the whole loop's bookkeeping)
                (scaler.scale(per_sample) if scaler is not None else per_sample).backward(w)
            losses.append(torch.dot(per_sample.detach(), w))
        # every rank has at least one micro-batch in every step of the schedule
        loss_sum = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        return loss_sum, outputs

    def _uniform_weights(self, n: int, weight: float, like: torch.Tensor) -> torch.Tensor:
        """``n`` copies of ``weight`` shaped like ``like``; the tensor of the previous
        call when it fits (every step but the epoch's last has the same)."""
        key = (n, weight, like.dtype, like.device)
        cached = self._weights
        if cached is None or cached[0] != key:
            cached = self._weights = (key, torch.full((n,), weight, dtype=like.dtype,
                                                      device=like.device))
        return cached[1]

    def optimizer_step(self) -> float | None:
        """Unscale and clip once, step the optimizer (and scaler, and a per-step
        scheduler); returns the gradient norm when clipping, else None.

        A non-blocking checkpoint's copy of the parameters is awaited by the
        checkpointer's pre-hook on ``optimizer.step()``.
        """
        state, cfg = self.state, self.config
        optimizer, scaler = state.optimizer, state.scaler
        grad_norm = None
        if cfg.clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            grad_norm = float(nn.utils.clip_grad_norm_(state.model.parameters(),
                                                       cfg.clip_grad_norm))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if state.scheduler is not None and cfg.scheduler_interval == "step":
            state.scheduler.step()
        return grad_norm

    def _report(self, epoch: int, n_real: int, loss: torch.Tensor, grad_norm: float | None,
                outputs: list[Any], lr: float | None) -> None:
        ckpt = self.checkpointer
        assert self._progress is not None and self.info is not None and ckpt is not None
        self._progress.update(step=self.state.step, epoch=epoch, samples=n_real, loss=loss,
                              lr=lr, world_size=self.info.world_size)
        self.samples_per_second = self._progress.samples_per_second
        if self.on_step_end is not None:
            metrics: dict[str, Any] = {"loss": loss.item,
                                       "samples_per_second": self.samples_per_second}
            if lr is not None:
                metrics["lr"] = lr
            if grad_norm is not None:
                metrics["grad_norm"] = grad_norm
            with ckpt.paused():
                self.on_step_end(self.state, StepInfo(
                    self.state.step, epoch, loss.item, n_real, self.samples_per_second, lr,
                    self.info.world_size, outputs=outputs, metrics=metrics))

    def _end_restored_epoch(self, epoch: int) -> None:
        """The end-of-epoch work of an epoch the restored state had trained to its end
        but not closed (saved at its last step: a peer failed during ``on_epoch_end``,
        say, and the survivor wrote its snapshot: this checkpointer's
        ``replays_epoch_end``): ``on_epoch_end`` with a summary of the nothing this group trained of it,
        and the epoch-end checkpoint. The restore already checked its audit and moved
        the state to the next epoch."""
        state, info, ckpt = self.state, self.info, self.checkpointer
        assert info is not None and ckpt is not None
        summary = EpochSummary(epoch, 0, 0, 0.0, 0.0, float("nan"), info.world_size,
                               state.audit.epoch(epoch))
        if info.is_main:
            say(log, "epoch %d was trained to its end before the restart: its end-of-epoch "
                "work now", epoch)
        if self.on_epoch_end is not None:
            with ckpt.paused():
                self.on_epoch_end(state, summary)
        self.summaries.append(summary)
        if ckpt.save_at_epoch_end and ckpt.last_saved_step != state.step:
            ckpt.save(blocking=True)

    def _end_epoch(self, summary: EpochSummary) -> None:
        cfg, state, info, ckpt = self.config, self.state, self.info, self.checkpointer
        assert info is not None and ckpt is not None
        ckpt.finish_audit()
        if self.on_epoch_end is not None:
            # from here the state may hold what on_epoch_end changed (a learning rate,
            # an early-stopping count), which a restore would apply again when it runs
            # on_epoch_end once more: a rank that exits now writes no snapshot
            ckpt.replays_epoch_end = False
            with ckpt.paused():
                self.on_epoch_end(state, summary)
        self.summaries.append(summary)
        if info.is_main:
            say(log, "epoch %d done: %d steps, %d samples in %.1fs (%.1f samples/s), "
                "loss %.4f", summary.epoch, summary.steps, summary.samples, summary.seconds,
                summary.samples_per_second, summary.loss)
        ckpt.end_epoch()
        ckpt.replays_epoch_end = True

    def save(self, *, blocking: bool = True) -> None:
        """Checkpoint the state now (collective: every rank calls it, inside :meth:`run`)."""
        if self.checkpointer is None:
            raise RuntimeError("ElasticLoop.save() is only available while run() runs")
        self.checkpointer.save(blocking=blocking)
