"""The checkpointer's options, validated once, for :class:`Checkpointer` and the loop.

:class:`~elastic_kit.Checkpointer` takes them as keyword arguments and
:class:`~elastic_kit.LoopConfig` nests them (``LoopConfig(checkpoint=...)``), so each
option has one name, one default and one validator.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_kit._checks import check_int, check_number, type_error
from elastic_kit.health import DEFAULT_TIMEOUT_S as DEFAULT_HEARTBEAT_TIMEOUT_S
from elastic_kit.snapshot import DEFAULT_BUDGET

__all__ = ["CheckpointerConfig", "AUDIT_MODES", "DEFAULT_KEEP_LAST"]

#: What ``audit`` accepts, and the mode each value means.
AUDIT_MODES = {False: "off", True: "error", "off": "off", "warn": "warn", "error": "error"}

class _DefaultKeepLast(int):
    """``keep_last``'s default, 3, told apart from a 3 the caller gave: a store object
    handed to the checkpointer keeps what it was made to keep, and a ``keep_last``
    given beside it is refused rather than dropped in silence."""

    def __repr__(self) -> str:
        return "3"


#: ``keep_last``'s default: equal to 3, and this very object wherever none was given.
DEFAULT_KEEP_LAST: int = _DefaultKeepLast(3)

#: The options that are True or False (nothing else: ``blocking="no"`` is truthy).
_FLAGS = ("blocking", "save_at_epoch_end", "overlap_staging", "handle_signals",
          "handle_preemption")


@dataclass(frozen=True)
class CheckpointerConfig:
    """When and how a loop saves, snapshots and stops (validated on construction: an
    option of a wrong type raises ``TypeError``, a wrong value ``ValueError``; numpy and
    torch integers are ints).

    Attributes:
        every_steps: save every this many optimizer steps (None: not by steps).
        every_seconds: save when this long has passed since the last save (rank 0's
            clock decides, so all ranks agree).
        keep_last: checkpoints a store made from a URL keeps (3 by default). Given
            (even as 3) with a store object, the checkpointer or loop refuses it with a
            ``TypeError``: that store keeps what it was made to keep.
        blocking: make the periodic saves synchronous. Non-blocking saves (default)
            copy the state and write it on a background thread; SIGTERM saves are
            always synchronous.
        save_at_epoch_end: save at the end of every epoch.
        audit: ``False``/``"off"``, ``True``/``"error"`` (raise
            :class:`~elastic_kit.SampleAuditError` at the end of an epoch that missed or
            repeated a sample), ``"warn"``, or None: the owner's default (off for a
            :class:`~elastic_kit.Checkpointer`, ``"error"`` for
            :class:`~elastic_kit.ElasticLoop`). The audit keeps, per epoch, a count and
            an order-independent digest of the sample ids the sampler dealt to each
            completed step, summed over ranks and saved in every checkpoint.
        overlap_staging: a non-blocking save copies the parameters and optimizer
            state on the save thread while the next forward and backward run; the
            copy is waited for in a pre-hook of ``optimizer.step()``, the only place
            they change. Turn off if parameters change in place outside
            ``optimizer.step()``.
        handle_signals: catch SIGTERM (torchrun's restart notice; under torchrun also
            SIGINT and SIGHUP, which its agent forwards on Ctrl-C or a lost terminal):
            a step soon after (every rank at the same one, within about 0.4 s of
            training; at the latest the epoch's end) saves synchronously and exits
            with ``exit_code``. Python runs signal handlers on the main thread only:
            a checkpointer made on another thread (a framework that runs the
            training function in a thread) installs none (it warns) and a SIGTERM
            then ends the process unsaved, unless the main thread's own handler
            calls :meth:`~elastic_kit.Checkpointer.request_stop` (``restart=True``)
            and the training thread's ``SystemExit`` is passed on as the process's
            exit status. A handler the script set before is put back by
            :meth:`~elastic_kit.Checkpointer.close`; while the checkpointer lives it
            gets only a signal that comes as ``close()`` writes the last checkpoint
            (once that is written). One set after replaces the
            checkpointer's (no save; it warns), and if it calls the handler it
            replaced, after ``close()`` that call goes on to the handler the
            checkpointer replaced, if that was a function.
        exit_code: the exit status after a SIGTERM save (non-zero, so torchrun
            restarts the group instead of reporting success).
        snapshot_every: in-memory snapshots (see :mod:`elastic_kit.snapshot`): the full
            state in node-local shared memory every this many steps, which survives
            a torchrun group restart, so a restart redoes only the steps since the
            newest snapshot instead of everything since the last durable save.
            ``"auto"``: on under torchrun, with the interval chosen to cost at most
            ``snapshot_budget`` of the training time (the default); an int: every
            that many steps; ``0`` or ``None``: off. Needs a store. Outside torchrun
            nothing restarts the workers, so ``"auto"`` is off there.
        snapshot_budget: the share of training time automatic snapshots may cost, in
            (0, 1) (1%: Young's optimal interval for a 0.5 s snapshot and a failure
            every ~40 minutes; more buys back only seconds of redone work per failure).
        heartbeat_timeout: seconds of silence after which a worker of another node
            counts as lost (a frozen or unreachable host; see
            :mod:`elastic_kit.health`): the survivors exit at once so torchrun
            re-forms the group, instead of waiting in their collective for the process
            group's timeout. Only in groups of two nodes or more; ``None`` or ``0``:
            off; ``$ELASTIC_KIT_HEARTBEAT_TIMEOUT`` overrides it.
        handle_preemption: turn a preemption notice (the cloud's metadata service, read
            only on GCE, AWS or Azure hosts; SIGUSR1, SLURM's ``--signal``) into a
            planned leave: every rank snapshots the same step, the snapshot reaches a
            peer node's memory, the announced node leaves and the others restart
            without it, with nothing redone (see :mod:`elastic_kit.health`).

    Example::

        cfg = ek.CheckpointerConfig(every_steps=200, audit=True)
        ckpt = ek.Checkpointer(state, "s3://bucket/run", **cfg.options())
        loop = ek.ElasticLoop(state, dataset, loss_fn=loss_fn, store=store,
                              config=ek.LoopConfig(global_batch_size=256, checkpoint=cfg))
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    keep_last: int | None = DEFAULT_KEEP_LAST
    blocking: bool = False
    save_at_epoch_end: bool = True
    audit: bool | str | None = None
    overlap_staging: bool = True
    handle_signals: bool = True
    exit_code: int = 143
    snapshot_every: int | str | None = "auto"
    snapshot_budget: float = DEFAULT_BUDGET
    heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT_S
    handle_preemption: bool = True

    def __post_init__(self) -> None:
        """Wrong types raise ``TypeError``, wrong values ``ValueError`` (torch's
        convention); int-likes (numpy or torch integers) become ints."""
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: expected {expected}")

        def settle(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise type_error(name, getattr(self, name), "True or False")
        settle("every_steps", check_int("every_steps", self.every_steps, minimum=1,
                                        allow_none=True))
        settle("every_seconds", check_number("every_seconds", self.every_seconds, above=0,
                                             allow_none=True))
        if self.keep_last is not DEFAULT_KEEP_LAST:  # the default stays itself
            settle("keep_last", check_int("keep_last", self.keep_last, minimum=1,
                                          allow_none=True))
        # a str or a bool, not just a value equal to a key (1 == True; [] is unhashable)
        modes = "True, False, 'off', 'warn', 'error' or None"
        if self.audit is not None and not isinstance(self.audit, (bool, str)):
            raise type_error("audit", self.audit, modes)
        if self.audit is not None and self.audit not in AUDIT_MODES:
            raise bad("audit", modes)
        snap = self.snapshot_every
        if not (snap is None or snap == "auto"):
            if isinstance(snap, str):
                raise bad("snapshot_every", "'auto', None or an int >= 0 (0: off)")
            # a plain int (a NumPy integer becomes one): the snapshot tier takes no other
            settle("snapshot_every", check_int("snapshot_every", snap, minimum=0))
        exit_code = check_int("exit_code", self.exit_code)
        if not 1 <= exit_code <= 255:
            raise bad("exit_code", "an int in [1, 255]")
        settle("exit_code", exit_code)
        budget = check_number("snapshot_budget", self.snapshot_budget,
                              expected="a number in (0, 1)")
        if not 0 < budget < 1:
            raise bad("snapshot_budget", "a number in (0, 1)")
        check_number("heartbeat_timeout", self.heartbeat_timeout, at_least=0, allow_none=True,
                     expected="None, 0 (off) or a finite number of seconds > 0")

    def audit_mode(self, default: str = "off") -> str:
        """``"off"``, ``"warn"`` or ``"error"``; ``default`` when ``audit`` is None."""
        return default if self.audit is None else AUDIT_MODES[self.audit]

    def options(self) -> dict[str, object]:
        """The options as :class:`~elastic_kit.Checkpointer`'s keyword arguments."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
