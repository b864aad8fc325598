"""Options of the elastic loop and what its hooks receive."""

from __future__ import annotations

from collections.abc import Callable
import sys
import warnings
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import Any

from elastic_kit._checks import check_int, check_number, type_error
from elastic_kit.checkpointer import AUDIT_MODES, CheckpointerConfig
from elastic_kit.state import EpochAudit
from elastic_kit.errors import BatchPolicyError
from elastic_kit.loop._policy import (
    BatchPolicy, FixedGlobalBatch, LinearLRScaling, _positive, make_policy)

__all__ = ["LoopConfig", "StepInfo", "EpochSummary"]


#: The flat names LoopConfig once had for the checkpointer's options, and their
#: names in :class:`~elastic_kit.CheckpointerConfig`.
_DEPRECATED = {
    "checkpoint_every_steps": "every_steps",
    "checkpoint_every_seconds": "every_seconds",
    "checkpoint_at_epoch_end": "save_at_epoch_end",
    "blocking": "blocking",
    "overlap_staging": "overlap_staging",
    "audit": "audit",
    "sigterm_exit_code": "exit_code",
    "handle_signals": "handle_signals",
    "snapshot_every": "snapshot_every",
}
_UNSET: Any = object()


@dataclass
class LoopConfig:
    """Options of :class:`ElasticLoop` (validated on construction: an option of a wrong
    type raises ``TypeError``, a wrong value ``ValueError`` or, for the batch sizes,
    ``BatchPolicyError``, a ``ValueError``; numpy and torch integers are ints).

    Attributes:
        epochs: train until this many epochs are complete.
        global_batch_size: ``G`` for ``fixed_global``: samples per optimizer step over
            all ranks; must be divisible by every world size the job runs at. Required
            under ``fixed_global``, the default policy (no default fits every
            dataset), so ``LoopConfig()`` alone raises ``BatchPolicyError``.
        micro_batch_size: the most samples a rank feeds the model at once
            (``fixed_global``); the per-worker batch for ``linear_lr``.
        batch_policy: ``"fixed_global"`` (default), ``"linear_lr"`` or a
            :class:`~elastic_kit.loop.BatchPolicy` instance (a built-in one's own sizes
            are used: ``global_batch_size`` and ``micro_batch_size`` left out, or the
            same).
        max_steps: stop (after a checkpoint) once the global step reaches this.
        checkpoint: when and how to save, snapshot and stop: a
            :class:`~elastic_kit.CheckpointerConfig` (the options
            :class:`~elastic_kit.Checkpointer` takes), e.g.
            ``CheckpointerConfig(every_steps=200)``. The loop's audit defaults to
            ``"error"`` (log and raise :class:`~elastic_kit.SampleAuditError` when an
            epoch missed or repeated a sample).
        checkpoint_at_exit: checkpoint when the run ends (its last epoch, or
            ``max_steps``) at a step not saved yet, so that a restart after the end
            trains nothing again.
        scheduler_interval: ``"epoch"`` (``scheduler.step()`` once an epoch, after the
            optimizer step of its last step, before ``on_epoch_end``: a save of that
            step holds it) or ``"step"`` (after every optimizer step).
        clip_grad_norm: clip the gradient norm to this value before each step.
        log_every: rank 0 logs step, epoch, its own loss (of its share of the batch,
            so it changes with the world size; the epoch line's loss is every rank's),
            samples/s and ETA every this many steps (0: never).
        progress_bar: tqdm bar on rank 0; ``None``: when stderr is a terminal.
        shuffle: / seed: passed to the sampler the loop creates; ``seed`` also seeds,
            per epoch, the generator the loader's workers take their seeds from.
        num_workers, pin_memory, persistent_workers, prefetch_factor: DataLoader options
            (the last two need ``num_workers > 0``, as torch's DataLoader does).
        collate_fn: collates a list of samples (default: torch's ``default_collate``).

    The checkpointer's options once had flat names here (``checkpoint_every_steps``,
    ``checkpoint_every_seconds``, ``checkpoint_at_epoch_end``, ``blocking``,
    ``overlap_staging``, ``audit``, ``sigterm_exit_code``, ``handle_signals``,
    ``snapshot_every``): they are still accepted, with a ``DeprecationWarning``, and
    go into :attr:`checkpoint`.
    """

    epochs: int = 1
    global_batch_size: int | None = None
    micro_batch_size: int = 32
    batch_policy: str | BatchPolicy = "fixed_global"
    max_steps: int | None = None
    checkpoint: CheckpointerConfig = field(default_factory=CheckpointerConfig)
    checkpoint_at_exit: bool = True
    scheduler_interval: str = "epoch"
    clip_grad_norm: float | None = None
    log_every: int = 10
    progress_bar: bool | None = None
    shuffle: bool = True
    seed: int = 0
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    checkpoint_every_steps: InitVar[Any] = _UNSET
    checkpoint_every_seconds: InitVar[Any] = _UNSET
    checkpoint_at_epoch_end: InitVar[Any] = _UNSET
    blocking: InitVar[Any] = _UNSET
    overlap_staging: InitVar[Any] = _UNSET
    audit: InitVar[Any] = _UNSET
    sigterm_exit_code: InitVar[Any] = _UNSET
    handle_signals: InitVar[Any] = _UNSET
    snapshot_every: InitVar[Any] = _UNSET

    def __post_init__(self, *flat: Any) -> None:
        def _check(name: str, ok: bool, expected: str) -> None:
            if not ok:
                raise ValueError(f"LoopConfig.{name}={getattr(self, name)!r}: expected {expected}")

        if not isinstance(self.checkpoint, CheckpointerConfig):
            raise type_error("LoopConfig.checkpoint", self.checkpoint, "an ek.CheckpointerConfig")
        # dataclasses.replace() passes the flat names back (read through the
        # properties below): a value the nested config already has is no change
        given = {new: value for (old, new), value in zip(_DEPRECATED.items(), flat)
                 if value is not _UNSET and not self._holds(new, value)}
        if given:
            olds = [old for old, new in _DEPRECATED.items() if new in given]
            warnings.warn(
                f"LoopConfig({', '.join(olds)}=...) is deprecated: pass "
                f"checkpoint=ek.CheckpointerConfig({', '.join(given)}=...)",
                DeprecationWarning, stacklevel=3)
            self.checkpoint = replace(self.checkpoint, **given)
        def _number(name: str, **bounds: Any) -> None:
            setattr(self, name, check_int(f"LoopConfig.{name}", getattr(self, name), **bounds))

        # a wrong type is a TypeError, a wrong value a ValueError; int-likes (numpy or
        # torch integers) become ints
        _number("epochs", minimum=0)
        _number("micro_batch_size", minimum=1)
        _number("max_steps", minimum=0, allow_none=True)
        if not isinstance(self.scheduler_interval, str):
            raise type_error("LoopConfig.scheduler_interval", self.scheduler_interval,
                             "'epoch' or 'step'")
        _check("scheduler_interval", self.scheduler_interval in ("epoch", "step"),
               "'epoch' or 'step'")
        # a negative norm would flip the gradients' sign, zero would zero them
        self.clip_grad_norm = check_number("LoopConfig.clip_grad_norm", self.clip_grad_norm,
                                           above=0, allow_none=True)
        _number("log_every", minimum=0)
        if not (self.progress_bar is None or isinstance(self.progress_bar, bool)):
            raise type_error("LoopConfig.progress_bar", self.progress_bar, "None, True or False")
        for name in ("checkpoint_at_exit", "shuffle", "pin_memory", "persistent_workers"):
            if not isinstance(getattr(self, name), bool):
                raise type_error(f"LoopConfig.{name}", getattr(self, name), "True or False")
        _number("seed")
        _number("num_workers", minimum=0)
        _number("prefetch_factor", minimum=1, allow_none=True)
        # torch's DataLoader refuses these without worker processes: say so here, not
        # drop them silently (the loader is only built at run())
        _check("prefetch_factor", self.prefetch_factor is None or self.num_workers > 0,
               "None with num_workers=0 (it counts batches per loader worker)")
        _check("persistent_workers", not self.persistent_workers or self.num_workers > 0,
               "False with num_workers=0 (there are no workers to keep)")
        if self.global_batch_size is not None:
            self.global_batch_size = _positive("global_batch_size", self.global_batch_size)
        if not isinstance(self.batch_policy, (str, BatchPolicy)):
            raise type_error("LoopConfig.batch_policy", self.batch_policy,
                             "'fixed_global', 'linear_lr' or an ek.loop.BatchPolicy")
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise type_error("LoopConfig.collate_fn", self.collate_fn,
                             "None or a callable taking a list of samples")
        if self.batch_policy == "linear_lr" and self.global_batch_size is not None:
            # the global batch then grows with the world size: a fixed one asked for
            # as well is a contradiction, not an option to ignore
            raise BatchPolicyError(
                f"LoopConfig.global_batch_size={self.global_batch_size!r} with "
                "batch_policy='linear_lr': that policy keeps micro_batch_size per rank "
                "and the global batch grows with the world size; drop global_batch_size "
                "or use batch_policy='fixed_global'")
        if isinstance(self.batch_policy, BatchPolicy):
            self._check_sizes_agree(self.batch_policy)
        else:
            # Fails early with a BatchPolicyError naming the missing/invalid value.
            make_policy(self.batch_policy, global_batch_size=self.global_batch_size,
                        micro_batch_size=self.micro_batch_size)

    def _check_sizes_agree(self, policy: BatchPolicy) -> None:
        """The sizes of a built-in policy instance are the ones used: sizes given beside
        it that differ would be ignored in silence (a policy of the user's own may
        read them as it likes)."""
        held: dict[str, int | None] = {}
        if isinstance(policy, FixedGlobalBatch):
            held = {"global_batch_size": policy.global_batch_size,
                    "micro_batch_size": policy.micro_batch_size}
        elif isinstance(policy, LinearLRScaling):  # its global batch grows with W
            held = {"global_batch_size": None,
                    "micro_batch_size": policy.micro_batch_size or policy.batch_size}
        defaults = {f.name: f.default for f in fields(self)}  # a size left there: not given
        for name, value in held.items():
            given = getattr(self, name)
            if given != defaults[name] and given != value:
                raise BatchPolicyError(
                    f"LoopConfig.{name}={given!r} with batch_policy={policy!r}, whose "
                    f"{name} is {value!r} and is what the loop uses: drop {name} or "
                    "make the two agree")

    def policy(self) -> BatchPolicy:
        """The :class:`~elastic_kit.loop.BatchPolicy` these options describe."""
        if isinstance(self.batch_policy, BatchPolicy):
            return self.batch_policy
        return make_policy(self.batch_policy, global_batch_size=self.global_batch_size,
                           micro_batch_size=self.micro_batch_size)

    def _holds(self, name: str, value: Any) -> bool:
        if name == "audit":
            return (value in AUDIT_MODES
                    and AUDIT_MODES[value] == self.checkpoint.audit_mode("error"))
        current = getattr(self.checkpoint, name)
        return type(value) is type(current) and value == current

    def checkpointer_options(self) -> dict[str, Any]:
        """The :class:`~elastic_kit.Checkpointer` keyword arguments the loop uses
        (the loop's audit defaults to ``"error"``)."""
        options = self.checkpoint.options()
        options["audit"] = self.checkpoint.audit_mode("error")
        return options


def _read_by_replace() -> bool:
    """Whether the property read two frames up is ``dataclasses.replace`` passing the
    fields back (``_replace`` on Python 3.13+)."""
    frame = sys._getframe(2)
    return (frame.f_globals.get("__name__") == "dataclasses"
            and frame.f_code.co_name in ("replace", "_replace"))


def _deprecated_alias(old: str, new: str) -> property:
    def read(self: LoopConfig) -> Any:
        if _read_by_replace():
            # not a value the caller gave: replace(config, checkpoint=...) must take
            # the new nested config as it is, not the old one's values through here
            return _UNSET
        if new == "audit":
            return self.checkpoint.audit_mode("error")
        return getattr(self.checkpoint, new)

    def write(self: LoopConfig, value: Any) -> None:
        warnings.warn(f"setting LoopConfig.{old} is deprecated: set LoopConfig.checkpoint = "
                      f"dataclasses.replace(config.checkpoint, {new}=...)",
                      DeprecationWarning, stacklevel=2)
        self.checkpoint = replace(self.checkpoint, **{new: value})

    return property(read, write, doc=f"Deprecated: ``checkpoint.{new}``.")


# The flat names stay readable, as the nested values (no warning), and settable (with
# a warning); dataclasses.replace reads them as unset; the dataclass's __init__ already
# holds their defaults, so the class attributes can become properties.
for _old, _new in _DEPRECATED.items():
    setattr(LoopConfig, _old, _deprecated_alias(_old, _new))


class StepInfo:
    """What ``on_step_end(state, info)`` receives after every optimizer step.

    Attributes:
        step: the global step just completed.
        epoch: its epoch.
        loss: this rank's loss of the step: the mean over its share of the step's real
            samples, weighted as DDP averages the ranks (as torchvision's reference
            logs per step; :class:`EpochSummary` has the mean over all ranks).
        samples: real samples in the step, all ranks.
        samples_per_second: recent throughput, all ranks.
        lr: the first parameter group's learning rate in the step (before a per-step
            scheduler moves it on).
        world_size: ranks in the current worker group.
        outputs: the second element of each micro-batch's ``loss_fn`` result when it
            returned ``(losses, outputs)`` (this rank's), else empty.
        metrics: ``loss``, ``samples_per_second``, ``lr`` and, when clipping,
            ``grad_norm`` (before clipping) as one dict, for loggers.

    ``loss`` (and ``metrics``, which holds it) is read from the device on first
    access, so a hook that logs every ``N`` steps does not synchronise with the GPU on
    the others. No collective runs per step for it: a global per-step loss would cost
    an all-reduce every step.
    """

    def __init__(self, step: int, epoch: int, loss: float | Callable[[], float], samples: int,
                 samples_per_second: float, lr: float | None, world_size: int,
                 outputs: list[Any] | None = None,
                 metrics: dict[str, float] | None = None) -> None:
        self.step = step
        self.epoch = epoch
        self._loss = loss
        self.samples = samples
        self.samples_per_second = samples_per_second
        self.lr = lr
        self.world_size = world_size
        self.outputs: list[Any] = outputs if outputs is not None else []
        self._metrics: dict[str, float] = metrics if metrics is not None else {}

    @property
    def loss(self) -> float:
        if callable(self._loss):
            self._loss = float(self._loss())
        return self._loss

    @property
    def metrics(self) -> dict[str, float]:
        if "loss" in self._metrics and callable(self._metrics["loss"]):
            self._metrics["loss"] = self.loss
        return self._metrics

    def __repr__(self) -> str:
        return (f"StepInfo(step={self.step}, epoch={self.epoch}, loss={self.loss!r}, "
                f"samples={self.samples}, samples_per_second={self.samples_per_second!r}, "
                f"lr={self.lr!r}, world_size={self.world_size})")


@dataclass
class EpochSummary:
    """What ``on_epoch_end(state, summary)`` receives (also in ``loop.summaries``).

    ``steps``, ``samples``, ``seconds`` and ``samples_per_second`` cover the part of
    the epoch this worker group trained (all of it unless the group restarted
    mid-epoch); ``audit`` covers the whole epoch across restarts.
    """

    epoch: int
    steps: int
    samples: int
    seconds: float
    samples_per_second: float
    loss: float
    world_size: int
    audit: EpochAudit
