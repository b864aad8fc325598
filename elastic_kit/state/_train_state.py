"""TrainState: everything a restarted worker group needs to continue a run.

A :class:`TrainState` references the live training objects (model, optimizer, LR
scheduler, grad scaler, sampler) and owns the scalar progress (epoch, global step),
the user's extras (``best_acc1`` ...), the per-restart :attr:`~TrainState.history`
and the per-epoch :class:`~elastic_kit.loop.SampleAudit`. :meth:`TrainState.state_dict`
turns all of it, RNG states included, into plain containers of tensors and numbers,
which is what ``torch.load(weights_only=True)`` accepts; numpy's and Python's RNG
states are converted to tensors on the way.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import random
import sys
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer

from elastic_kit._checks import type_error
from elastic_kit.distributed import unwrap_model
from elastic_kit.errors import CheckpointMismatchError
from elastic_kit.state._audit import SampleAudit
from elastic_kit.store import is_dtensor, validate_state

__all__ = ["TrainState", "capture_rng_state", "plain_rng_state", "raw_rng_state",
           "restore_rng_state"]

log = logging.getLogger(__name__)

STATE_FORMAT = 1


class _NumpyState:
    """numpy's global generator state, as ``np.random.get_state()`` gives it, without
    its cost (24 us, most of a step-end mark's) when the generator was not used since
    the last call: the MT19937 state's bytes (key and position, 2,500 bytes read in
    0.3 us) are compared with the last ones. A draw always moves the position, except
    one that takes the legacy normal cached by the draw before; so the last state is
    reused only when the bytes are unchanged and it had no cached normal. Where the
    bytes do not match what ``get_state`` says (another numpy layout), it always calls
    ``get_state``."""

    _BYTES = 624 * 4 + 4  # uint32 key[624]; int pos

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bitgen: Any = None
        self._addr = 0
        self._raw = b""
        self._state: Any = None
        self._usable = True

    def get(self) -> Any:
        with self._lock:
            if not self._usable:
                return np.random.get_state()
            bitgen = np.random.mtrand._rand._bit_generator
            if bitgen is not self._bitgen:
                self._bitgen, self._state = bitgen, None
                try:
                    self._addr = int(bitgen.ctypes.state_address)
                except (AttributeError, TypeError):
                    self._usable = False
                    return np.random.get_state()
            raw = ctypes.string_at(self._addr, self._BYTES)
            state = self._state
            if state is not None and raw == self._raw and not state[3]:
                return state
            state = np.random.get_state()
            if self._state is None and raw != _mt_bytes(state):
                self._usable = False  # not the layout this reads
                return state
            self._raw, self._state = raw, state
            return state

    def forget(self) -> None:
        """Drop the kept state: call after setting numpy's state. The bytes compared
        leave out the cached normal, so a state set with the same MT19937 bytes but
        another cached normal would otherwise be answered with the kept one."""
        with self._lock:
            self._state = None


def _mt_bytes(state: Any) -> bytes:
    """The MT19937 state struct's bytes for a ``get_state()`` tuple."""
    return (np.asarray(state[1], dtype=np.uint32).tobytes()
            + int(state[2]).to_bytes(4, sys.byteorder, signed=True))


_NUMPY_STATE = _NumpyState()


def raw_rng_state() -> dict[str, Any]:
    """torch CPU, current CUDA device, numpy and Python ``random`` states as their
    getters return them: cheap enough to take at every step, converted by
    :func:`plain_rng_state` only when kept."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available()
        and torch.cuda.is_initialized() else None,
        "numpy": _NUMPY_STATE.get(),
        "python": random.getstate(),
    }


def plain_rng_state(raw: dict[str, Any]) -> dict[str, Any]:
    """:func:`raw_rng_state`'s states as plain types and tensors (what a checkpoint holds)."""
    name, keys, pos, has_gauss, gauss = raw["numpy"]
    version, internal, gauss_next = raw["python"]
    return {
        "torch": raw["torch"],
        "cuda": raw["cuda"],
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "python": {
            "version": int(version),
            # through numpy: a third of the time of torch.tensor() on a 625-int tuple
            "internal": torch.from_numpy(np.array(internal, dtype=np.int64)),
            "gauss_next": gauss_next,
        },
    }


def capture_rng_state() -> dict[str, Any]:
    """torch CPU, current CUDA device, numpy and Python ``random`` states as plain types."""
    return plain_rng_state(raw_rng_state())


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`. The states may have been loaded onto a
    device (a restore's ``map_location``): every generator takes its state from the
    CPU."""
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].to(torch.uint8).cpu())
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].cpu().numpy().astype(np.uint32), int(n["pos"]),
                         int(n["has_gauss"]), float(n["cached_gaussian"])))
    _NUMPY_STATE.forget()
    p = state["python"]
    random.setstate((int(p["version"]), tuple(int(x) for x in p["internal"].tolist()),
                     p["gauss_next"]))


def _put_back(before: list[tuple[Any, dict[str, Any]]]) -> None:
    """Load each object's earlier state again (newest first)."""
    for obj, state in reversed(before):
        obj.load_state_dict(state)


def _scaler_enabled(scaler: Any) -> bool:
    """Whether a GradScaler-like object is enabled (one without ``is_enabled``: yes)."""
    enabled = getattr(scaler, "is_enabled", None)
    return bool(enabled()) if callable(enabled) else True


def _is_stateful(obj: Any) -> bool:
    """True for objects saved through their own ``state_dict()`` (modules, EMA models,
    optimizers, schedulers, GradScalers): kept live in ``extras`` and loaded in place."""
    return (not isinstance(obj, (dict, type)) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def _ddp_inner(obj: Any) -> Any:
    """The module inside a DDP wrapper (so its state loads with or without DDP); any
    other object as it is: an EMA ``AveragedModel`` also has ``.module``, but its own
    state (``n_averaged``) must be kept."""
    return obj.module if isinstance(obj, nn.parallel.DistributedDataParallel) else obj


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (FSDP2's ``fully_shard``, tensor
    parallelism): its state is then saved and loaded shard by shard."""
    return any(is_dtensor(p) for p in unwrap_model(model).parameters())


#: Key of a sharded optimizer state dict taken before the optimizer's first step:
#: its state tensors only give the layout (see :func:`_sharded_state`).
UNSTEPPED_KEY = "unstepped"


def _sharded_state(model: nn.Module, optimizer: Optimizer | None) -> tuple[Any, Any]:
    """Model and optimizer state of a sharded model, as DTensors (no gather).

    ``torch.distributed.checkpoint.state_dict`` keys the optimizer state by parameter
    name rather than by position, and gives a fresh optimizer its state tensors (a
    step with zero gradients and learning rate 0), so that the layout to load into
    is known before the first step. That step is not the run's: Adam's step count
    would become 1 (its bias correction shifts) and SGD's momentum would start at
    ``weight_decay * param``. So a fresh optimizer is left fresh, and its state dict
    keeps the tensors (a restore reads its checkpoint into them) marked
    :data:`UNSTEPPED_KEY`: loading it leaves the optimizer without state, as it was.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return get_model_state_dict(model), None
    if optimizer.state:
        return get_state_dict(model, optimizer)
    with _left_fresh(optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer)
    if optim_sd.get("state"):
        optim_sd[UNSTEPPED_KEY] = True
    return model_sd, optim_sd


def _is_whole(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not is_dtensor(value)


def _distributed_like(whole: torch.Tensor, like: Any, path: str) -> Any:
    """This rank's part of ``whole``, as a DTensor of ``like``'s mesh, placements and
    dtype (every rank holds the same whole tensor: no communication)."""
    from torch.distributed.tensor import distribute_tensor

    if tuple(whole.shape) != tuple(like.shape):
        raise CheckpointMismatchError(
            f"checkpoint tensor {path} has shape {list(whole.shape)}, the sharded state "
            f"holds {list(like.shape)}; nothing was loaded")
    return distribute_tensor(whole.to(device=like.device, dtype=like.dtype),
                             like.device_mesh, like.placements, src_data_rank=None)


def _shard_like_params(optimizer: Optimizer, path: str) -> None:
    """Whole state tensors of DTensor parameters (a checkpoint read without a layout
    for them: an optimizer in ``extras`` that had not stepped) become DTensors laid
    out as their parameter."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optimizer.state.get(p)
            if not is_dtensor(p) or not entry:
                continue
            for key, v in list(entry.items()):
                if _is_whole(v) and tuple(v.shape) == tuple(p.shape) and v.dim() > 0:
                    entry[key] = _distributed_like(v, p, f"{path}[{key!r}]")


def _dcp_names(model: nn.Module, name: str) -> set[str]:
    """The names torch's distributed state dict gives parameter ``name`` of ``model``
    (its own function where there is one: it drops the wrappers' parts of a name,
    ``_orig_mod.`` of compiled blocks, ``_checkpoint_wrapped_module.`` of activation
    checkpointing, and applies modules' ``_fqn_modifiers``)."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns

        return {str(n) for n in _get_fqns(model, name)}
    except Exception:  # another torch: every name it may give (one more does no harm)
        name = name.replace("_checkpoint_wrapped_module.", "")
        return {name, ".".join(part for part in name.split(".") if part != "_orig_mod")}


def _without_saved_state(model: nn.Module, optim_sd: dict[str, Any]) -> list[nn.Parameter]:
    """The model's parameters that need a gradient and have no state in ``optim_sd``
    (keyed by name, as torch's distributed state dict names them; a tied parameter
    under any of its names)."""
    saved = set((optim_sd.get("state") or {}).keys())
    names: dict[int, tuple[nn.Parameter, set[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, set()))[1].update(_dcp_names(model, name))
    return [p for p, ns in names.values() if p.requires_grad and not saved & ns]


def _by_index(optim_sd: Any) -> bool:
    """Whether ``optim_sd`` is an optimizer's own ``state_dict()`` (parameters by
    position), as an unsharded job saves it, not keyed by parameter name."""
    if not isinstance(optim_sd, dict) or not isinstance(optim_sd.get("param_groups"), list):
        return False
    return any(isinstance(p, int) for g in optim_sd["param_groups"] if isinstance(g, dict)
               for p in g.get("params", ()))


def _holds_whole(optim_sd: Any) -> bool:
    """Whether an optimizer state dict holds whole state tensors (beyond scalars such
    as Adam's step): one read whole, without ``into=``."""
    state = optim_sd.get("state") if isinstance(optim_sd, dict) else None
    return isinstance(state, dict) and any(
        _is_whole(v) and v.dim() > 0 for entry in state.values() if isinstance(entry, dict)
        for v in entry.values())


def _by_name(optim_sd: dict[str, Any], model: nn.Module, optimizer: Optimizer
             ) -> dict[str, Any]:
    """An optimizer state dict of whole tensors in the form a sharded one loads (by
    parameter name, state tensors as DTensors laid out as their parameter). Saved by
    an unsharded job it names parameters by position: position ``i`` is the ``i``-th
    parameter of the optimizer's groups, as ``Optimizer.state_dict`` numbers them."""
    _, template = _sharded_state(model, optimizer)
    names = [n for g in template["param_groups"] for n in g["params"]]
    if not _by_index(optim_sd):
        names_of = {n: n for n in names}
    else:
        names_of = dict(enumerate(names))
    groups = optim_sd["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in template["param_groups"]]:
        raise CheckpointMismatchError(
            f"checkpoint optimizer has groups of {[len(g['params']) for g in groups]} "
            f"parameters, this optimizer {[len(g['params']) for g in template['param_groups']]}; "
            f"nothing was loaded")
    try:
        state: dict[str, Any] = {}
        for key, entry in (optim_sd.get("state") or {}).items():
            name = names_of[key]
            like = template["state"].get(name, {})
            state[name] = {k: _distributed_like(v, like[k], f"optimizer[{name!r}][{k!r}]")
                           if _is_whole(v) and is_dtensor(like.get(k)) else v
                           for k, v in entry.items()}
        return {"state": state,
                "param_groups": [dict(g, params=[names_of[p] for p in g["params"]])
                                 for g in groups]}
    except KeyError as e:
        raise CheckpointMismatchError(
            f"checkpoint optimizer state names parameter {e.args[0]!r}, which this "
            f"optimizer does not hold; nothing was loaded") from e


@contextlib.contextmanager
def _left_fresh(optimizer: Optimizer, *, unless_loaded: bool = False) -> Iterator[None]:
    """Undo, on leaving, what torch's state-dict functions did to an optimizer that had
    no state on entering (their zero-gradient step): its state and the flag an LR
    scheduler reads to tell whether the optimizer stepped. ``unless_loaded``: only
    when the block raised (a load that succeeded keeps what it loaded)."""
    if optimizer.state:
        yield
        return
    missing = object()
    called = optimizer.__dict__.get("_opt_called", missing)

    def undo() -> None:
        optimizer.state.clear()
        if called is missing:
            optimizer.__dict__.pop("_opt_called", None)
        else:
            optimizer.__dict__["_opt_called"] = called

    try:
        yield
    except BaseException:
        undo()
        raise
    if not unless_loaded:
        undo()


def _expected_model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict under the names a checkpoint of it uses: for a sharded
    model, ``torch.distributed.checkpoint.state_dict``'s (what :meth:`TrainState.state_dict`
    saves and :meth:`TrainState.load_state_dict` loads), which drops the
    ``_orig_mod.`` of blocks compiled inside the model (``layers[i] =
    torch.compile(block)``); ``model.state_dict()`` keeps it."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)
    return model.state_dict()


def _check_model_fits(model: nn.Module, saved: Any) -> None:
    """Raise before anything is loaded when ``saved`` is not a state dict of ``model``."""
    if not isinstance(saved, dict):
        raise CheckpointMismatchError(
            f"checkpoint 'model' is a {type(saved).__name__}, expected a state dict")
    current = _expected_model_state(model)
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    # a lazy module's parameter has no shape until loaded (its load takes the saved one)
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(v.shape)}"
              for k, v in current.items() if k in saved and isinstance(v, torch.Tensor)
              and not is_lazy(v) and isinstance(saved[k], torch.Tensor)
              and saved[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append(f"other shapes ({'; '.join(shapes[:5])})")
        raise CheckpointMismatchError(
            "checkpoint does not fit the model: " + ", ".join(parts)
            + "; nothing was loaded")


def _check_extra_fits(name: str, live: Any, saved: Any) -> None:
    """Raise before anything is loaded when ``saved`` cannot load into the live extra
    ``name``: what can be checked without loading (a sampler's own check; a module's
    keys and shapes, an optimizer's groups, where they load with torch's own
    ``load_state_dict``); anything else is left to its ``load_state_dict`` (a class
    that overrides it may migrate an older state, or load it non-strictly)."""
    if not _is_stateful(live):
        return
    live = _ddp_inner(live)
    check = getattr(live, "check_state_dict", None)
    loads = type(live).load_state_dict
    try:
        if callable(check) and all(hasattr(live, a) for a in _SAMPLER_API):
            check(saved)
        elif (isinstance(live, nn.Module) and loads is nn.Module.load_state_dict
              and not is_sharded(live)):
            _check_model_fits(live, saved)
        elif (isinstance(live, Optimizer) and loads is Optimizer.load_state_dict
              and isinstance(saved, dict)):
            _check_optimizer_fits(live, saved)
    except (TypeError, ValueError) as e:  # CheckpointMismatchError is a ValueError
        message = str(e)
        if not message.endswith("nothing was loaded"):
            message += "; nothing was loaded"
        raise CheckpointMismatchError(
            f"checkpoint extras[{name!r}] does not fit {type(live).__name__}: {message}"
        ) from e


def _check_optimizer_fits(optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """Raise before anything is loaded when ``saved`` is not a state of ``optimizer``:
    other group sizes, or (state keyed by position) per-parameter state of another
    shape than the parameter at its position (the parameters given in another
    order: it would load, then fail at the next step, or swap moments silently)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        raise CheckpointMismatchError("checkpoint optimizer state has no 'param_groups' list")
    ours = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g.get("params", [])) for g in groups]
    if ours != theirs:
        raise CheckpointMismatchError(
            f"checkpoint optimizer has parameter groups of sizes {theirs}, this optimizer "
            f"{ours}; nothing was loaded")
    state = saved.get("state")
    if not isinstance(state, dict):
        return
    for g, (group, saved_group) in enumerate(zip(optimizer.param_groups, groups)):
        for pos, key, ours_shape, saved_shape in _misplaced_state(
                group["params"], saved_group.get("params", []), state):
            raise CheckpointMismatchError(
                f"checkpoint optimizer state does not fit parameter {pos} of group {g}: its "
                f"{key!r} has shape {saved_shape}, the parameter {ours_shape} (parameters "
                f"given to the optimizer in another order?); nothing was loaded")


def _misplaced_state(params: list[Any], ids: list[Any], state: dict[Any, Any]
                     ) -> Iterator[tuple[int, str, tuple[int, ...], tuple[int, ...]]]:
    """``(position, key, parameter shape, saved shape)`` for each saved per-parameter
    state tensor whose shape is not its parameter's. Per-parameter is told from the
    shapes: a key (``exp_avg``, ``momentum_buffer`` ...) whose saved tensors of more
    than one element all have shapes of the group's parameters. Other state (LBFGS's
    flat history, Adafactor's factored ``row_var``) is left to the optimizer."""
    shapes: dict[str, dict[int, tuple[int, ...]]] = {}
    for pos, pid in enumerate(ids):
        entry = state.get(pid) if isinstance(pid, int) else None
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                shapes.setdefault(str(key), {})[pos] = tuple(value.shape)
    # a lazy module's parameter has no shape until loaded: nothing to compare with
    ours = [None if is_lazy(p) else tuple(p.shape) for p in params]
    available = Counter(ours)
    for key, by_pos in shapes.items():
        if Counter(by_pos.values()) - available:
            continue  # not shaped like the parameters: not per-parameter state
        for pos, shape in by_pos.items():
            mine = ours[pos]
            if mine is not None and shape != mine:
                yield pos, key, mine, shape


#: What the state and the checkpointer use of a sampler (ElasticDistributedSampler's).
_SAMPLER_API = ("state_dict", "load_state_dict", "advance", "consumed")


def _check_parts(model: Any, optimizer: Any, scheduler: Any, scaler: Any,
                 extras: Any) -> None:
    """Refuse, when the state is made, a part of the wrong kind: one passes until a
    restore or a save, where it fails as an ``AttributeError`` naming neither the
    part nor the mistake (a scheduler given as the optimizer, the model left None)."""
    if not isinstance(model, nn.Module):
        raise type_error("model", model, "a torch.nn.Module (plain, DDP or FSDP)")
    saved = ("state_dict", "load_state_dict")
    for name, part, needs, expected in (
            ("optimizer", optimizer, ("param_groups", *saved),
             "None or a torch.optim.Optimizer (a scheduler goes in scheduler=...)"),
            ("scheduler", scheduler, saved,
             "None or an LR scheduler (with state_dict and load_state_dict)"),
            ("scaler", scaler, saved,
             "None or a torch.amp.GradScaler (with state_dict and load_state_dict)")):
        lacks = [attr for attr in needs if not hasattr(part, attr)]
        if part is not None and lacks:
            raise type_error(name, part, f"{expected}; it has no {', '.join(lacks)}")
    if extras is not None and not isinstance(extras, Mapping):
        raise type_error("extras", extras, "None or a dict of values to keep across restarts")


class TrainState:
    """The resumable state of a training run.

    Args:
        model: the (DDP-wrapped or plain) model; saved unwrapped, so a checkpoint
            loads with or without DDP. A model sharded with FSDP2 (``fully_shard``:
            DTensor parameters) is saved as DTensors (model and optimizer state, via
            ``torch.distributed.checkpoint.state_dict``), which the store writes
            shard by shard and loads at any world size (see :attr:`sharded`).
        optimizer: its optimizer (``param_groups``, ``state_dict`` and
            ``load_state_dict``), or None.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        scaler: a ``torch.amp.GradScaler``.
        A part of the wrong kind (a model that is no ``nn.Module``, a scheduler given
        as the optimizer, ``extras`` that is no dict) raises ``TypeError`` here.
        sampler: the :class:`~elastic_kit.ElasticDistributedSampler` (the loop
            creates one when left ``None``).
        extras: user values to keep across restarts: plain values
            (``{"best_acc1": 0.0}``: dicts, lists, tensors, numbers, str) and objects
            with ``state_dict()``/``load_state_dict()`` (an EMA model, a second
            optimizer), which are saved through ``state_dict()`` and loaded in place.

    Attributes:
        epoch: the epoch in progress (or next to start).
        step: global optimizer step count.
        extras: the user's dict.
        history: one entry per (re)start of the worker group: ``{"world_size",
            "step", "restart", "restored_step", "restored_from"}``.
        audit: the :class:`~elastic_kit.loop.SampleAudit`; ``audit.epochs[e]`` is the
            :class:`~elastic_kit.loop.EpochAudit` of epoch ``e``.
        initial_world_size: the world size the run started with (``W0`` of
            ``linear_lr``).
        lr_scale: the learning-rate factor currently baked into the optimizer and
            scheduler state.

    Example::

        state = TrainState(model, optimizer, scheduler=sched, extras={"best_acc1": 0.0})
        torch.save(state.state_dict(), "ckpt.pt")
        state.load_state_dict(torch.load("ckpt.pt", weights_only=True))
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 scheduler: Any = None, scaler: Any = None, sampler: Any = None,
                 extras: dict[str, Any] | None = None) -> None:
        _check_parts(model, optimizer, scheduler, scaler, extras)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.epoch = 0
        self.step = 0
        self.extras: dict[str, Any] = dict(extras or {})
        self.history: list[dict[str, Any]] = []
        self.audit = SampleAudit()
        self.initial_world_size: int | None = None
        self.lr_scale = 1.0
        self._sharded_seen = False  # the model was seen to hold DTensor parameters

    @property
    def sampler(self) -> Any:
        """The sampler whose position the state holds (None: none)."""
        return self._sampler

    @sampler.setter
    def sampler(self, sampler: Any) -> None:
        lacks = [name for name in _SAMPLER_API if not hasattr(sampler, name)]
        if sampler is not None and lacks:
            # torch's DistributedSampler, kept by a script being ported, has no
            # position to save: refused here, not by an AttributeError at restore()
            raise TypeError(
                f"TrainState(sampler=...) got a {type(sampler).__qualname__}, which has no "
                f"{', '.join(lacks)}: the state saves the sampler's position in the epoch; "
                f"expected an ek.ElasticDistributedSampler (a drop-in for "
                f"DistributedSampler), or None")
        self._sampler = sampler

    @property
    def sharded(self) -> bool:
        """True when the model holds DTensor parameters (FSDP2): :meth:`state_dict`
        then holds DTensors, which :class:`~elastic_kit.CheckpointStore` saves shard by
        shard from every rank and loads at any world size."""
        return is_sharded(self.model)

    @property
    def global_step(self) -> int:
        """Alias of :attr:`step`."""
        return self.step

    def state_dict(self, *, rng: bool = True) -> dict[str, Any]:
        """Plain containers of tensors and numbers; see the module docstring.

        The tensors are the live ones (parameters, optimizer moments): copy them
        before the next step if the result is kept (the checkpoint store stages them).
        """
        extras: dict[str, Any] = {}
        for k, v in self.extras.items():
            if _is_stateful(v):
                extras[k] = _ddp_inner(v).state_dict()
            else:
                # DTensors too (an FSDP2 model's EMA): the store saves them as shards
                validate_state(v, path=f"extras[{k!r}]", root="", allow_dtensor=True)
                extras[k] = v
        model = unwrap_model(self.model)
        model_sd = None
        if not self._sharded_seen:
            # Whether the model is sharded, from its state dict's values: a snapshot
            # takes the state often, and walking the parameters first cost a fifth of
            # ResNet-50's state_dict(). Once sharded, a model stays sharded.
            model_sd = model.state_dict()
            self._sharded_seen = (any(is_dtensor(v) for v in model_sd.values())
                                  and is_sharded(model))
        if self._sharded_seen:
            model_sd, optim_sd = _sharded_state(model, self.optimizer)
        else:
            optim_sd = self.optimizer.state_dict() if self.optimizer is not None else None
        sd: dict[str, Any] = {
            "format": STATE_FORMAT,
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "epoch": int(self.epoch),
            "step": int(self.step),
            "extras": extras,
            "history": [dict(h) for h in self.history],
            "audit": self.audit.state_dict(),
            "initial_world_size": self.initial_world_size,
            "lr_scale": float(self.lr_scale),
            "rng": capture_rng_state() if rng else None,
        }
        return sd

    def _load_small_parts(self, sd: dict[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
        """Load the scheduler's and the scaler's states; returns each loaded object
        with its state before. On a failure, put back the ones already loaded and raise
        :class:`CheckpointMismatchError`."""
        before: list[tuple[Any, dict[str, Any]]] = []
        for name in ("scheduler", "scaler"):
            obj, part = getattr(self, name), sd.get(name)
            if obj is None:
                continue
            if part is None:
                log.warning("checkpoint has no %s state; keeping the fresh %s", name, name)
                continue
            if name == "scaler" and part == {} and _scaler_enabled(obj):
                # a disabled GradScaler saves {} (AMP off, or a CPU run of a script that
                # enables it on GPUs only): nothing to load, as with no state at all
                log.warning("checkpoint's scaler state is empty (saved by a disabled "
                            "scaler); keeping the fresh %s", type(obj).__name__)
                continue
            try:
                before.append((obj, copy.deepcopy(obj.state_dict())))
                obj.load_state_dict(part)
            except (ValueError, KeyError, RuntimeError, TypeError, IndexError,
                    AttributeError) as e:
                _put_back(before)
                raise CheckpointMismatchError(
                    f"checkpoint {name} state does not fit the {name}: {e}; nothing was "
                    "loaded") from e
        return before

    def load_state_dict(self, sd: dict[str, Any], *, restore_rng: bool = True) -> None:
        """Load what :meth:`state_dict` produced (possibly from another world size).

        Raises:
            CheckpointMismatchError: the checkpoint is of another model (missing or
                unexpected keys, other shapes) or another dataset length.
        """
        if not isinstance(sd, dict) or "model" not in sd:
            raise CheckpointMismatchError(
                f"not a TrainState checkpoint: expected a dict with 'model', 'step', ... "
                f"got {type(sd).__name__} with keys {sorted(sd)[:8] if isinstance(sd, dict) else ''}")
        for key in ("epoch", "step"):
            if type(sd.get(key)) is not int or sd[key] < 0:
                raise CheckpointMismatchError(
                    f"TrainState checkpoint {key!r}={sd.get(key)!r}: expected an int >= 0")
        # Check everything that can be checked before changing anything, so a
        # checkpoint of another model or dataset leaves the live objects untouched.
        _check_model_fits(unwrap_model(self.model), sd["model"])
        if self.optimizer is not None and sd.get("optimizer") is not None:
            _check_optimizer_fits(self.optimizer, sd["optimizer"])
        if self.sampler is not None and sd.get("sampler") is not None:
            check = getattr(self.sampler, "check_state_dict", None)
            saved_len = sd["sampler"].get("dataset_length") if isinstance(
                sd["sampler"], dict) else None
            if callable(check):
                try:
                    check(sd["sampler"])
                except CheckpointMismatchError:
                    raise
                except (TypeError, ValueError) as e:
                    raise CheckpointMismatchError(
                        f"checkpoint sampler state does not fit: {e}; nothing was loaded"
                    ) from e
            elif saved_len is not None and saved_len != getattr(self.sampler, "dataset_length",
                                                                 saved_len):
                raise CheckpointMismatchError(
                    f"sampler state was saved for a dataset of length {saved_len}, but this "
                    f"dataset has length {self.sampler.dataset_length}; nothing was loaded")
        saved_extras = sd.get("extras") or {}
        if not isinstance(saved_extras, dict):
            raise CheckpointMismatchError(
                f"TrainState checkpoint 'extras' is a {type(saved_extras).__name__}, "
                "expected a dict")
        for k, v in saved_extras.items():
            _check_extra_fits(k, self.extras.get(k), v)
        for k, live in self.extras.items():
            if k not in saved_extras and _is_stateful(live):
                # built before the restore (an EMA copies the fresh weights): it keeps
                # them, which nothing else would tell
                log.warning("checkpoint has no extras[%r]; keeping the fresh %s (its state "
                            "is not the restored model's: e.g. an EMA copied the weights "
                            "before the restore)", k, type(live).__name__)
        # The scheduler's and the scaler's fit can only be known by loading them: they
        # go first, undone on failure, so a checkpoint that does not fit them leaves
        # the model and the optimizer untouched too.
        loaded = self._load_small_parts(sd)
        try:
            try:
                if self.sharded:
                    self._load_sharded(sd)
                else:
                    unwrap_model(self.model).load_state_dict(sd["model"])
            except (RuntimeError, ValueError, TypeError, KeyError) as e:
                if isinstance(e, CheckpointMismatchError):
                    raise
                raise CheckpointMismatchError(f"checkpoint does not fit the model: {e}") from e
            if not self.sharded and self.optimizer is not None:
                if sd.get("optimizer") is None:
                    log.warning("checkpoint has no optimizer state; keeping the fresh "
                                "optimizer")
                else:
                    try:
                        self.optimizer.load_state_dict(sd["optimizer"])
                    except (ValueError, KeyError, RuntimeError) as e:
                        raise CheckpointMismatchError(
                            f"checkpoint optimizer state does not fit the optimizer: {e}"
                        ) from e
        except CheckpointMismatchError:
            _put_back(loaded)  # what the checks before could not see: as before
            raise
        if self.sampler is not None and sd.get("sampler") is not None:
            try:
                self.sampler.load_state_dict(sd["sampler"])
            except ValueError as e:
                if isinstance(e, CheckpointMismatchError):
                    raise
                raise CheckpointMismatchError(str(e)) from e
        for k, v in saved_extras.items():
            live = self.extras.get(k)
            if _is_stateful(live):
                try:
                    _ddp_inner(live).load_state_dict(v)
                    if isinstance(live, Optimizer):
                        _shard_like_params(live, f"extras[{k!r}]")
                except (ValueError, KeyError, RuntimeError) as e:
                    raise CheckpointMismatchError(
                        f"checkpoint extras[{k!r}] does not fit {type(live).__name__}: {e}"
                    ) from e
            else:
                self.extras[k] = v
        self.epoch = int(sd["epoch"])
        self.step = int(sd["step"])
        self.history = [dict(h) for h in sd.get("history") or []]
        self.audit.load_state_dict(sd.get("audit") or [])
        self.initial_world_size = sd.get("initial_world_size")
        self.lr_scale = float(sd.get("lr_scale", 1.0))
        if restore_rng and sd.get("rng") is not None:
            restore_rng_state(sd["rng"])

    def _load_sharded(self, sd: dict[str, Any]) -> None:
        """Model and optimizer of a sharded model from DTensors (each rank copies its
        own shards; the optimizer state is keyed by parameter name)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_state_dict,
        )

        model = unwrap_model(self.model)
        # copies of the top level: torch renames keys in place (to the ``_orig_mod.``
        # names of compiled blocks), which would leave ``sd`` unfit for another load
        model_sd = dict(sd["model"])
        # whole tensors (an unsharded job's checkpoint, or one read without into=):
        # each rank takes its part, as DTensors of the layout it holds now
        live = _expected_model_state(model)
        for k, v in model_sd.items():
            if _is_whole(v) and is_dtensor(live.get(k)):
                model_sd[k] = _distributed_like(v, live[k], f"model[{k!r}]")
        optim_sd = sd.get("optimizer")
        if self.optimizer is not None and (_by_index(optim_sd) or _holds_whole(optim_sd)):
            optim_sd = _by_name(optim_sd, model, self.optimizer)
        if self.optimizer is not None and optim_sd is not None:
            unstepped = isinstance(optim_sd, dict) and bool(optim_sd.get(UNSTEPPED_KEY))
            optim_sd = {k: v for k, v in optim_sd.items() if k != UNSTEPPED_KEY}
            # parameters the saved optimizer held no state for (no gradient yet when
            # it was saved: an unrouted expert, a head used later): torch's strict load
            # refuses them, so the load is not strict then, and they are left without
            # state, as saved
            stateless = _without_saved_state(model, optim_sd)
            opts = StateDictOptions(strict=not stateless)
            # a fresh optimizer gets torch's zero-gradient step first: undone when the
            # load fails, and after loading a state of an optimizer that had not stepped
            with _left_fresh(self.optimizer, unless_loaded=not unstepped):
                set_state_dict(model, self.optimizer, model_state_dict=model_sd,
                               optim_state_dict=optim_sd, options=opts)
            if unstepped:  # also where this optimizer had stepped: now as the saved one
                self.optimizer.state.clear()
            else:
                for p in stateless:
                    self.optimizer.state.pop(p, None)
        else:
            if self.optimizer is not None:
                log.warning("checkpoint has no optimizer state; keeping the fresh optimizer")
            set_model_state_dict(model, model_sd)

    def run_report(self) -> dict[str, Any]:
        """What happened to this run so far, as JSON-able values for a run summary.

        Built from :attr:`history` and :attr:`audit`, which travel in checkpoints, so
        a worker started by the last restart reports every earlier segment too
        (up to the newest checkpoint).

        Returns:
            ``steps``, ``epochs``, ``world_sizes`` (one ``{"world_size", "step",
            "restart", "restored_step", "restored_from"}`` per start of the worker
            group; ``restored_from``: ``"memory"``, ``"peer"``, ``"store"`` or None),
            ``restarts``
            (the highest torchrun restart count seen), ``restored_steps`` (checkpoint
            steps restored, in order) and ``audit`` (``{"epoch", "count",
            "expected", "ok"}`` per finished epoch).
        """
        keys = ("world_size", "step", "restart", "restored_step", "restored_from")
        return {
            "steps": self.step,
            "epochs": self.epoch,
            "world_sizes": [{k: h.get(k) for k in keys} for h in self.history],
            "restarts": max((h["restart"] for h in self.history), default=0),
            "restored_steps": [h["restored_step"] for h in self.history
                               if h.get("restored_step") is not None],
            "audit": [{"epoch": a.epoch, "count": a.count, "expected": a.expected_count,
                       "ok": bool(a.ok)}
                      for _, a in sorted(self.audit.epochs.items()) if a.ok is not None],
        }

    def apply_lr_scale(self, scale: float) -> None:
        """Make the optimizer's (and scheduler's) learning rates ``base * scale``.

        Multiplies by ``scale / lr_scale``: the restored optimizer state already
        carries :attr:`lr_scale`, so calling this after every restart never compounds.
        """
        if self.optimizer is None or scale == self.lr_scale:
            self.lr_scale = float(scale)
            return
        rescale_lr(self.optimizer, self.scheduler, scale / self.lr_scale)
        self.lr_scale = float(scale)


#: Scheduler classes (``torch.optim.lr_scheduler``, ``torch.optim.swa_utils``) whose
#: learning rates :func:`rescale_lr` knows all of; any other gets a warning, once.
_KNOWN_SCHEDULERS = frozenset({
    "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
    "ExponentialLR", "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
    "SequentialLR", "ChainedScheduler", "OneCycleLR", "CyclicLR", "ReduceLROnPlateau",
    "SWALR",
})
#: learning rates kept in param groups: ``lr``; ``initial_lr`` (every scheduler);
#: ``max_lr``, ``min_lr`` (OneCycleLR); ``swa_lr`` (SWALR)
_GROUP_LRS = ("lr", "initial_lr", "max_lr", "min_lr", "swa_lr")
#: learning rates kept in schedulers, lists and numbers: ``max_lrs`` (CyclicLR),
#: ``min_lrs`` and ``default_min_lr`` (ReduceLROnPlateau), ``eta_min`` (cosine)
_SCHEDULER_LRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "default_min_lr", "eta_min")
_warned_schedulers: set[str] = set()


def rescale_lr(optimizer: Optimizer, scheduler: Any, factor: float) -> None:
    """Multiply every learning rate the optimizer and scheduler hold by ``factor``, so
    that every later learning rate is ``factor`` times what it would have been.

    Scales the param groups' ``lr`` and ``initial_lr`` (and OneCycleLR's ``max_lr`` /
    ``min_lr``, SWALR's ``swa_lr``), and the scheduler's ``base_lrs`` / ``_last_lr``,
    CyclicLR's ``max_lrs``, ReduceLROnPlateau's ``min_lrs``, the cosine schedulers'
    ``eta_min``, recursing into the schedulers of a SequentialLR or
    ChainedScheduler: closed-form and recursive schedulers alike continue from the
    scaled values. Callers pass the ratio of the new scale to the scale already
    applied (see :meth:`TrainState.apply_lr_scale`), which makes it idempotent across
    restarts.

    .. warning::
        A scheduler class other than torch's has only its ``base_lrs`` / ``_last_lr``
        (and the fields above, where it has them) scaled; a learning rate it keeps
        elsewhere keeps its value. This is logged once per class.
    """
    if factor == 1.0:
        return
    scaled: set[int] = set()  # tensors scaled in place (one may sit in several places)
    for group in optimizer.param_groups:
        for key in _GROUP_LRS:
            if key in group:
                value = group[key]
                if isinstance(value, torch.Tensor):  # tensor lr (capturable optimizers)
                    if id(value) not in scaled:
                        value.mul_(factor)
                        scaled.add(id(value))
                else:
                    group[key] = value * factor
    if scheduler is not None:
        _rescale_scheduler(scheduler, factor, scaled, set())


def _rescale_scheduler(scheduler: Any, factor: float, scaled: set[int], seen: set[int]
                       ) -> None:
    if id(scheduler) in seen:
        return
    seen.add(id(scheduler))
    cls = type(scheduler)
    if not (cls.__name__ in _KNOWN_SCHEDULERS and cls.__module__ in (
            "torch.optim.lr_scheduler", "torch.optim.swa_utils")) \
            and cls.__qualname__ not in _warned_schedulers:
        _warned_schedulers.add(cls.__qualname__)
        log.warning("rescale_lr: scheduler %s is not one of torch's; scaled only its %s "
                    "where it has them; learning rates it keeps elsewhere keep their "
                    "values", cls.__qualname__, ", ".join(_SCHEDULER_LRS))

    def scale(value: Any) -> Any:  # a new value, except a tensor already scaled in place
        return value if id(value) in scaled else value * factor

    for attr in _SCHEDULER_LRS:
        values = getattr(scheduler, attr, None)
        if isinstance(values, list):
            setattr(scheduler, attr, [scale(v) for v in values])
        elif isinstance(values, (int, float, torch.Tensor)) and not isinstance(values, bool):
            setattr(scheduler, attr, scale(values))
    for child in getattr(scheduler, "_schedulers", None) or ():
        _rescale_scheduler(child, factor, scaled, seen)
