"""The one small training script of the tests, in every shape they need.

:func:`train` runs one life of a worker group (one process of it) and returns what
the tests assert on. It is built on the library exactly as a user script is:
:func:`elastic_kit.init_distributed`, :func:`elastic_kit.wrap_ddp`,
:class:`elastic_kit.TrainState`, and either

- the script's own loop (``loop="own"``): a ``DataLoader`` over an
  :class:`~elastic_kit.ElasticDistributedSampler`, made elastic with
  :class:`elastic_kit.Checkpointer` (restore, per-sample weights, ``step``, the
  script's own ``save``/``snapshot``/``end_epoch`` calls at each epoch end), or
- :class:`elastic_kit.ElasticLoop` (``loop="elastic"``) with a
  :class:`~elastic_kit.CheckpointStore`.

:class:`TrainConfig` holds what the tests vary: the data and model, the loop, the
checkpointer's options, the calls at an epoch end and their order, where a life stops
on purpose ("crashes") and how, snapshots, ``max_steps``. The model is a tiny MLP
(``features -> hidden -> Tanh -> classes``) on a fixed synthetic set, float32 with a
cross-entropy per sample, or float64 regression with a squared error per sample.

Spawned gloo ranks call it through :func:`elastic_kit.testing.spawn_multi_process`::

    out = spawn_multi_process(2, train, TrainConfig(url=str(tmp_path / "run")))

The torchrun scenarios launch this file, whose options (``--help``) map onto the same
:class:`TrainConfig`; the worker adds only test plumbing there (``--events`` lines, the
summary JSON, a hold point, ``--step-delay``) and a fault injected through
:class:`elastic_kit.testing.FaultFileSystem`: ``--crash-in-save-at-step N`` makes the
writing process exit inside the store's commit of step N, after its payload and right
before its manifest::

    torchrun --nnodes=1:3 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29500 \\
        tests/train_script.py --checkpoint-dir /tmp/ck --summary-json /tmp/s.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import elastic_kit as ek

log = logging.getLogger("ek_worker")

#: Label rules of the synthetic set (``regression``: float64 targets).
TARGETS = ("x0", "x0+x1", "sum", "regression")
#: Calls a script can make after an epoch's steps (``TrainConfig.epoch_end``).
EPOCH_END_CALLS = ("save", "snapshot", "end_epoch")


@dataclass(frozen=True)
class TrainConfig:
    """One life of the test training script.

    Attributes:
        url: the checkpoint store's URL (``{node_rank}`` allowed; None: no store).
        loop: ``"own"`` (the script's loop with a Checkpointer) or ``"elastic"``.
        dataset_size: samples in the synthetic set.
        features, hidden: the MLP's input and hidden widths.
        target: the label rule, one of :data:`TARGETS`.
        data_seed, model_seed, sampler_seed: the set's generator, ``torch.manual_seed``
            before the model is built, the own loop's sampler seed.
        lr, momentum: SGD's.
        scheduler: None, ``"warmup"`` (LambdaLR to full lr over 5 steps, stepped per
            step by the own loop) or ``"halve"`` (StepLR, gamma 0.5, the loop's steps).
        ema: keep an EMA of the model in ``TrainState.extras`` (own loop).
        extras: count steps (``"seen"``) and epoch ends (``"seen_epochs"``) in
            ``TrainState.extras``.
        epochs: epochs to train.
        batch_size: the own loop's per-rank batch.
        probe: the own loop calls ``next(iter(loader))`` first in every epoch (the DDP
            tutorial's batch-size probe) and checks it is ``batch_size``.
        global_batch_size, micro_batch_size, batch_policy, loop_seed, max_steps: the
            ElasticLoop's (``batch_policy``/``loop_seed`` None: the library's default).
        checkpoint: Checkpointer / CheckpointerConfig options (the own loop defaults
            to ``handle_signals=False``).
        store: CheckpointStore options of the ElasticLoop's store (``keep_last``,
            ``node_local``, ``storage_options``).
        epoch_end: the own loop's calls after each epoch's steps, in order. With the
            ElasticLoop, ``("save", "end_epoch")`` is a ``loop.save()`` from the step
            hook at each epoch's last step, before the loop's end-of-epoch work.
        stop_after: steps of this life after which it stops (own loop).
        stop_at: ``"before_end_epoch"`` (right before the ``end_epoch`` call; with the
            ElasticLoop: lost during its end-of-epoch work, an ``on_epoch_end`` that
            raises) or ``"after_epoch"`` (after every ``epoch_end`` call; own loop):
            where it stops ...
        stop_epoch: ... in this epoch (None: the first epoch of this life).
        stop_how: ``"close"`` (``ckpt.close()``, an orderly end) or ``"kill"`` (no
            close: a process killed after its snapshot reached this node's memory and
            its peer's).
        snapshot_dir: ``ELASTIC_KIT_SNAPSHOT_DIR`` for this life (``{node}``: the group
            rank), with ``ELASTIC_KIT_SNAPSHOT_NODE=node<group rank>``; None: inherited.
        forbid_data: reading any sample raises (a finished job's data).
        collective_timeout: the gloo timeout (s) of ``init_distributed`` (None: its default).
        events, summary_json, save_final, step_delay, hold, log_steps: the torchrun
            worker's plumbing (see the module docstring).
        crash_in_save_at_step, crash_marker: the injected store fault (once: the
            marker file records that it happened).
        notice_after, notice_rank: rank ``notice_rank`` sends itself SIGUSR1 (a
            preemption notice) after that many steps of this life; the life then ends
            with the planned leave's exit: ``{"left_at": step, "code": status}``.
    """

    url: str | None = None
    loop: str = "own"
    dataset_size: int = 48
    features: int = 5
    hidden: int = 6
    target: str = "x0"
    data_seed: int = 5
    model_seed: int = 0
    sampler_seed: int = 2
    lr: float = 0.1
    momentum: float = 0.9
    scheduler: str | None = None
    ema: bool = False
    extras: bool = False
    epochs: int = 2
    batch_size: int = 4
    probe: bool = False
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    batch_policy: str | None = None
    loop_seed: int | None = None
    max_steps: int | None = None
    checkpoint: dict[str, Any] = field(default_factory=dict)
    store: dict[str, Any] = field(default_factory=dict)
    epoch_end: tuple[str, ...] = ("end_epoch",)
    stop_after: int | None = None
    stop_at: str | None = None
    stop_epoch: int | None = None
    stop_how: str = "kill"
    snapshot_dir: str | None = None
    forbid_data: bool = False
    collective_timeout: float | None = None
    events: str | None = None
    summary_json: str | None = None
    save_final: str | None = None
    step_delay: float = 0.0
    hold: bool = False
    log_steps: bool = False
    crash_in_save_at_step: int | None = None
    crash_marker: str | None = None
    notice_after: int | None = None
    notice_rank: int = 0

    def __post_init__(self) -> None:
        for name, value, allowed in (
                ("loop", self.loop, ("own", "elastic")), ("target", self.target, TARGETS),
                ("scheduler", self.scheduler, (None, "warmup", "halve")),
                ("stop_at", self.stop_at, (None, "before_end_epoch", "after_epoch")),
                ("stop_how", self.stop_how, ("close", "kill"))):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} must be one of {allowed}")
        if not set(self.epoch_end) <= set(EPOCH_END_CALLS) or "end_epoch" not in self.epoch_end:
            raise ValueError(f"epoch_end={self.epoch_end!r} must name end_epoch once and "
                             f"otherwise only {EPOCH_END_CALLS}")
        if self.loop == "elastic" and (
                self.epoch_end not in (("end_epoch",), ("save", "end_epoch"))
                or self.stop_at == "after_epoch" or self.stop_after is not None):
            raise ValueError(f"loop='elastic' takes epoch_end=('end_epoch',) or ('save', "
                             f"'end_epoch') and stop_at=None or 'before_end_epoch', not "
                             f"epoch_end={self.epoch_end!r}, stop_at={self.stop_at!r}, "
                             f"stop_after={self.stop_after!r} (use max_steps)")
        if self.crash_in_save_at_step is not None and not self.crash_marker:
            raise ValueError("crash_in_save_at_step needs crash_marker")

    @property
    def regression(self) -> bool:
        return self.target == "regression"


# ---------------------------------------------------------------------- data and model
class _Stopped(Exception):
    """The ElasticLoop's life ends on purpose (``stop_at``)."""


class _Forbidden(Dataset):
    """A dataset whose every read fails: a group restarted after the end must not read."""

    def __init__(self, inner: TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        raise AssertionError(f"sample {i} read by a group restarted after the end")


def make_dataset(cfg: TrainConfig) -> TensorDataset:
    """The fixed synthetic set: ``dataset_size`` samples of ``features`` values."""
    g = torch.Generator().manual_seed(cfg.data_seed)
    if cfg.regression:
        x = torch.randn(cfg.dataset_size, cfg.features, generator=g, dtype=torch.float64)
        w = torch.randn(cfg.features, 1, generator=g, dtype=torch.float64)
        y = torch.tanh(x @ w) + 0.1 * torch.randn(cfg.dataset_size, 1, generator=g,
                                                  dtype=torch.float64)
        return TensorDataset(x, y)
    x = torch.randn(cfg.dataset_size, cfg.features, generator=g)
    labels = {"x0": x[:, 0] > 0, "x0+x1": x[:, 0] + x[:, 1] > 0, "sum": x.sum(1) > 0}
    return TensorDataset(x, labels[cfg.target].long())


def make_model(cfg: TrainConfig) -> nn.Module:
    torch.manual_seed(cfg.model_seed)  # identical initial weights on every rank and life
    model = nn.Sequential(nn.Linear(cfg.features, cfg.hidden), nn.Tanh(),
                          nn.Linear(cfg.hidden, 1 if cfg.regression else 2))
    return model.double() if cfg.regression else model


def per_sample_loss(cfg: TrainConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One loss per sample: the squared error, or the cross-entropy."""
    if cfg.regression:
        return lambda out, y: ((out - y) ** 2).sum(dim=1)
    return nn.CrossEntropyLoss(reduction="none")


def param_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(ek.unwrap_model(model).state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _scheduler(cfg: TrainConfig, opt: torch.optim.Optimizer) -> Any:
    if cfg.scheduler == "warmup":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    if cfg.scheduler == "halve":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return None


# ---------------------------------------------------------------------- one life
def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run one life of the worker group; return this rank's result.

    A life that stops on purpose returns ``{"crashed_at": step}``; a finished one
    returns its final state (see :func:`_result`).
    """
    if cfg.snapshot_dir is not None:
        node = os.environ.get("GROUP_RANK", "0")
        os.environ["ELASTIC_KIT_SNAPSHOT_DIR"] = cfg.snapshot_dir.format(node=node)
        os.environ["ELASTIC_KIT_SNAPSHOT_NODE"] = f"node{node}"
    torch.set_num_threads(1)
    if cfg.collective_timeout is not None:
        info = ek.init_distributed(backend="gloo",
                                   timeout=timedelta(seconds=cfg.collective_timeout))
    else:
        info = ek.init_distributed()
    model = ek.wrap_ddp(make_model(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    sched = _scheduler(cfg, opt)
    extras: dict[str, Any] = {}
    if cfg.ema:
        extras["ema"] = torch.optim.swa_utils.AveragedModel(
            ek.unwrap_model(model),
            multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    if cfg.extras:
        extras.update(seen=0, seen_epochs=0)
    data = make_dataset(cfg)
    dataset: Dataset = _Forbidden(data) if cfg.forbid_data else data
    if cfg.loop == "own":
        return _own_loop(cfg, info, model, opt, sched, extras, dataset, data)
    return _elastic_loop(cfg, info, model, opt, sched, extras, dataset, data)


def _own_loop(cfg: TrainConfig, info: ek.DistInfo, model: nn.Module, opt: Any, sched: Any,
              extras: dict[str, Any], dataset: Dataset, data: TensorDataset) -> dict[str, Any]:
    sampler = ek.ElasticDistributedSampler(dataset, seed=cfg.sampler_seed)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler)
    crit = per_sample_loss(cfg)
    state = ek.TrainState(model, opt, scheduler=sched, sampler=sampler,
                          **({"extras": extras} if extras else {}))
    extras = state.extras  # the state's own dict: a restore sets its plain values
    ckpt = ek.Checkpointer(state, cfg.url, **{"handle_signals": False, **cfg.checkpoint})
    start = ckpt.restore()
    at_start = (sampler.epoch, sampler.consumed)

    def stop() -> dict[str, Any]:
        if cfg.stop_how == "close":
            ckpt.close()
        elif ckpt.snapshots is not None:  # a kill comes after the snapshot's stream here
            ckpt.snapshots.close(remove=False)
            torch.distributed.barrier()  # the peer's stream to us is in, too
        return {"crashed_at": state.step}

    done, lens, weights_sum = 0, [], []
    for epoch in range(start, cfg.epochs):
        sampler.set_epoch(epoch)
        if cfg.probe:
            probe = len(next(iter(loader))[0])  # StopIteration on an exhausted epoch
            assert probe == cfg.batch_size, probe
        for x, y in loader:
            lens.append((epoch, len(loader)))
            w = ckpt.sample_weights(len(x))
            weights_sum.append(float(w.sum()))
            loss = (crit(model(x), y) * w).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            if "ema" in extras:
                extras["ema"].update_parameters(ek.unwrap_model(model))
            if "seen" in extras:
                extras["seen"] += 1
            try:
                ckpt.step(len(x))
            except SystemExit as e:
                if cfg.notice_after is None:
                    raise
                return {"left_at": state.step, "code": e.code}
            done += 1
            if cfg.step_delay:
                time.sleep(cfg.step_delay)
            if cfg.stop_after is not None and done >= cfg.stop_after:
                return stop()
            if done == cfg.notice_after and info.rank == cfg.notice_rank:
                os.kill(os.getpid(), signal.SIGUSR1)
        stopping = cfg.stop_epoch is None or cfg.stop_epoch == epoch
        for call in cfg.epoch_end:
            if call == "end_epoch" and stopping and cfg.stop_at == "before_end_epoch":
                return stop()
            try:
                getattr(ckpt, call)()
            except SystemExit as e:  # a leave agreed at the epoch's last step
                if cfg.notice_after is None:
                    raise
                return {"left_at": state.step, "code": e.code}
            if call == "end_epoch" and "seen_epochs" in extras:
                extras["seen_epochs"] += 1
        if stopping and cfg.stop_at == "after_epoch":
            return stop()
    ckpt.close()
    out = _result(cfg, info, model, state, data)
    out.update(start=start, sampler_at_start=at_start, restored=ckpt.restored_step,
               restored_from=ckpt.restored_from, lens=lens, weights_sum=weights_sum)
    if "ema" in extras:
        out["ema"] = [p.detach().numpy().copy() for p in extras["ema"].module.parameters()]
    return out


def _elastic_loop(cfg: TrainConfig, info: ek.DistInfo, model: nn.Module, opt: Any,
                  sched: Any, extras: dict[str, Any], dataset: Dataset,
                  data: TensorDataset) -> dict[str, Any]:
    state = ek.TrainState(model, opt, scheduler=sched,
                          **({"extras": extras} if extras else {}))
    extras = state.extras  # the state's own dict: a restore sets its plain values
    store = _open_store(cfg)
    crit = per_sample_loss(cfg)
    started = {"logged": False}
    hold_point = _hold_point() if cfg.hold else None

    def log_restored() -> None:
        # Every rank says which step it restored (the node-local scenario checks that
        # all ranks restored the same, newest step). At the first step end the loop's
        # SIGTERM handling is installed, so a test may restart the group now.
        if not started["logged"]:
            started["logged"] = True
            if cfg.log_steps:
                log.info("EKW rank=%d world_size=%d restored step=%s", info.rank,
                         info.world_size, loop.restored_step)
            _append_event(cfg.events, event="start", rank=info.rank,
                          world_size=info.world_size, restart=info.restart_count,
                          restored_step=loop.restored_step, pid=os.getpid())

    def on_step_end(st: ek.TrainState, step: Any) -> None:
        log_restored()
        if cfg.epoch_end[0] == "save" and st.sampler.remaining == 0:
            loop.save()  # the epoch's last step, before the loop's end-of-epoch work
        if "seen" in extras:
            extras["seen"] += 1
        if cfg.log_steps and info.is_main:
            log.info("EKW step=%d world_size=%d loss=%.6f", step.step, step.world_size,
                     step.loss)
        if cfg.step_delay:
            time.sleep(cfg.step_delay)
        if hold_point is not None:
            hold_point(step.step, step.world_size, info.rank)

    def on_epoch_end(st: ek.TrainState, summary: Any) -> None:
        if cfg.stop_at == "before_end_epoch" and cfg.stop_epoch in (None, summary.epoch):
            raise _Stopped()  # the group is lost during its end-of-epoch work
        if "seen_epochs" in extras:
            extras["seen_epochs"] += 1

    options: dict[str, Any] = {}
    if cfg.batch_policy is not None:
        options["batch_policy"] = cfg.batch_policy
    if cfg.loop_seed is not None:
        options["seed"] = cfg.loop_seed
    loop = ek.ElasticLoop(
        state, dataset, loss_fn=lambda m, b: crit(m(b[0]), b[1]), store=store,
        on_step_end=on_step_end, on_epoch_end=on_epoch_end,
        config=ek.LoopConfig(epochs=cfg.epochs, global_batch_size=cfg.global_batch_size,
                             micro_batch_size=cfg.micro_batch_size, max_steps=cfg.max_steps,
                             checkpoint=ek.CheckpointerConfig(**cfg.checkpoint),
                             log_every=0, progress_bar=False, **options))
    try:
        loop.run()  # SIGTERM: checkpoint, then SystemExit(143) so torchrun restarts the group
    except SystemExit as e:
        _append_event(cfg.events, event="exit", rank=info.rank, world_size=info.world_size,
                      restart=info.restart_count, step=state.step, code=e.code,
                      pid=os.getpid())
        raise
    except _Stopped:
        return {"crashed_at": state.step}
    log_restored()
    _append_event(cfg.events, event="exit", rank=info.rank, world_size=info.world_size,
                  restart=info.restart_count, step=state.step, code=0, pid=os.getpid())
    out = _result(cfg, info, model, state, data)
    out.update(restored=loop.restored_step,
               epochs_trained=[(s.epoch, s.steps) for s in loop.summaries])
    if info.is_main:
        _write_outputs(cfg, model, out)
    if store is not None:
        store.close()
    return out


def _result(cfg: TrainConfig, info: ek.DistInfo, model: nn.Module, state: ek.TrainState,
            data: TensorDataset) -> dict[str, Any]:
    """What a finished life returns (every loop kind)."""
    plain = ek.unwrap_model(model)
    x, y = data.tensors
    with torch.no_grad():
        final_loss = (float(((plain(x) - y) ** 2).mean()) if cfg.regression
                      else float(per_sample_loss(cfg)(plain(x), y).mean()))
    return {
        "rank": info.rank,
        "world": info.world_size,
        "step": state.step,
        "epoch": state.epoch,
        "params": [p.detach().numpy().copy() for p in plain.parameters()],
        "named_params": {k: v.detach().numpy().copy() for k, v in plain.state_dict().items()},
        "audit": [(a.epoch, a.count, a.ok) for _, a in sorted(state.audit.epochs.items())],
        "report": state.run_report(),
        "history": state.history,
        "extras": {k: v for k, v in state.extras.items() if k != "ema"},
        "lr": state.optimizer.param_groups[0]["lr"],
        "param_sha256": param_sha256(model),
        "final_loss": final_loss,
    }


# ---------------------------------------------------------------------- worker plumbing
def _open_store(cfg: TrainConfig) -> ek.CheckpointStore | None:
    """The ElasticLoop's store; with ``crash_in_save_at_step`` on a FaultFileSystem whose
    manifest write of that step ends the writing process (payload written, no commit)."""
    if cfg.url is None:
        return None
    options = dict(cfg.store)
    url = cfg.url
    if options.get("node_local"):
        url = os.environ.get("EK_NODE_CHECKPOINT_DIR", url)
    if cfg.crash_in_save_at_step is None:
        return ek.CheckpointStore(url, **options)
    import fsspec

    from elastic_kit.store import MANIFEST_NAME, step_dir_name
    from elastic_kit.testing import FaultFileSystem

    step, marker = cfg.crash_in_save_at_step, str(cfg.crash_marker)
    target, _ = fsspec.core.url_to_fs(url, **(options.pop("storage_options", None) or {}))
    ffs = FaultFileSystem(target)

    def die(path: str) -> None:
        if os.path.exists(marker):
            return
        with open(marker, "w") as f:
            f.write(f"{os.getpid()}\n")
        log.error("EKW crash injected in save of step %d (payload written, no manifest)", step)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    for op in ("pipe", "open"):  # an object store PUTs the manifest; a local disk opens it
        ffs.add(op, match=f"{step_dir_name(step)}/{MANIFEST_NAME}", before=die, times=None,
                **({"mode": "wb"} if op == "open" else {}))
    return ek.CheckpointStore(url, filesystem=ffs, **options)


def _hold_point() -> Callable[..., None]:
    """The torchrun scenarios' hold point (``tests/torchrun/scenarios/_hold.py``)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "torchrun", "scenarios"))
    from _hold import hold_point

    return hold_point


def _append_event(path: str | None, **event: Any) -> None:
    """One JSON line, appended in a single write (the ranks share the file)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def _write_json_atomically(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def _write_outputs(cfg: TrainConfig, model: nn.Module, out: dict[str, Any]) -> None:
    """Rank 0's final parameters and summary JSON (the ImageNet example's keys)."""
    if cfg.save_final:
        plain = ek.unwrap_model(model)
        torch.save({k: v.detach().clone() for k, v in plain.state_dict().items()},
                   cfg.save_final)
    if cfg.summary_json:
        _write_json_atomically(cfg.summary_json, {
            **out["report"], "param_sha256": out["param_sha256"],
            "global_batch_size": cfg.global_batch_size, "dataset_size": cfg.dataset_size,
            "final_loss": out["final_loss"]})
    log.info("EKW done steps=%d sha=%s", out["step"], out["param_sha256"])


# ---------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The torchrun worker's options: an ElasticLoop on a float64 regression set."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", required=True,
                   help="fsspec URL or path of the CheckpointStore ({node_rank} allowed)")
    p.add_argument("--checkpoint-every", type=int, default=2, help="steps between saves")
    p.add_argument("--no-epoch-checkpoints", action="store_true",
                   help="no checkpoint at the end of each epoch (LoopConfig)")
    p.add_argument("--blocking-saves", action="store_true",
                   help="synchronous periodic checkpoints (default: background writes)")
    p.add_argument("--keep-last", type=int, default=0,
                   help="CheckpointStore keep_last (0: keep every checkpoint)")
    p.add_argument("--storage-options", default=None,
                   help="JSON dict of fsspec storage_options (s3 endpoint, credentials)")
    p.add_argument("--node-local-checkpoints", action="store_true",
                   help="CheckpointStore(node_local=True); the directory is "
                        "$EK_NODE_CHECKPOINT_DIR when set, else --checkpoint-dir")
    p.add_argument("--snapshot-every", default="auto",
                   help="in-memory snapshots (CheckpointerConfig.snapshot_every; the library's "
                        "default 'auto', or a number of steps, 0: off)")
    p.add_argument("--dataset-size", type=int, default=50)
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--target", choices=TARGETS, default="regression")
    p.add_argument("--global-batch-size", type=int, default=6)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--batch-policy", default="fixed_global")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="data, model and sampler seed")
    p.add_argument("--collective-timeout", type=float, default=30.0,
                   help="init_distributed timeout (s): how long survivors can block on a "
                        "lost peer before failing so that torchrun restarts the group")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds to sleep after each step, so a test can act mid-run")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--events", default=None,
                   help="append JSON lines here: every rank's start and exit of ElasticLoop.run")
    p.add_argument("--save-final", default=None, help="torch.save the final parameters here")
    p.add_argument("--crash-in-save-at-step", type=int, default=None,
                   help="the checkpoint writer exits after the payload but before the "
                        "manifest of this step")
    p.add_argument("--crash-marker", default=None,
                   help="file created before the injected crash, so it happens once")
    a = p.parse_args(argv)
    if a.crash_in_save_at_step is not None and not a.crash_marker:
        p.error("--crash-in-save-at-step needs --crash-marker")
    store: dict[str, Any] = {"keep_last": a.keep_last or None,
                             "node_local": a.node_local_checkpoints}
    if a.storage_options:
        store["storage_options"] = json.loads(a.storage_options)
    return TrainConfig(
        url=a.checkpoint_dir, loop="elastic", dataset_size=a.dataset_size,
        features=a.features, hidden=a.hidden, target=a.target, data_seed=a.seed,
        model_seed=a.seed, lr=a.lr, epochs=a.epochs, global_batch_size=a.global_batch_size,
        micro_batch_size=a.micro_batch_size, batch_policy=a.batch_policy, loop_seed=a.seed,
        max_steps=a.max_steps, store=store,
        checkpoint={"every_steps": a.checkpoint_every,
                    "save_at_epoch_end": not a.no_epoch_checkpoints,
                    "blocking": a.blocking_saves, "audit": "error",
                    "snapshot_every": (a.snapshot_every if a.snapshot_every == "auto"
                                       else int(a.snapshot_every))},
        collective_timeout=a.collective_timeout, events=a.events,
        summary_json=a.summary_json, save_final=a.save_final, step_delay=a.step_delay,
        hold=True, log_steps=True, crash_in_save_at_step=a.crash_in_save_at_step,
        crash_marker=a.crash_marker)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s: %(message)s")
    train(cfg)
    ek.destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
