"""One walk over a state tree, and one rule for what a checkpoint may hold.

A state tree is nested ``dict`` / ``OrderedDict`` / ``Counter``, ``list``, ``tuple`` and
``set`` containers of tensors and Python primitives: what
``torch.load(weights_only=True)`` reads back. Several parts of the library look at
such trees (the store's staging copy and validation, the tensor listing, the byte
count of the snapshot tier's space check, TrainState's check of the user's extras,
the split of sharded tensors from the replicated rest). They all walk it here, so
they agree on which containers are walked, which keys are allowed and what a
refusal says: a rule that differs between two walkers lets a state pass one check
and fail at restore time.

- :func:`map_tree` rebuilds the containers and hands every leaf to a function
  (keeping a module state dict's ``_metadata``, see :func:`_module_metadata`);
- :func:`leaves` lists ``(path, leaf)`` without rebuilding;
- :func:`validate_state` is the one validator (:func:`refuse` builds its message);
- :func:`iter_tensors`, :func:`state_nbytes` and :func:`is_dtensor` are small
  queries on top.

Paths are Python subscripts (``['model']['0.weight']``), so a message points at the
value the user must change.
"""

from __future__ import annotations

import argparse
import collections
from typing import Any, Callable, Iterator

import torch

__all__ = ["PRIMITIVES", "TENSOR_TYPES", "check_key", "map_tree", "leaves", "refuse",
           "validate_state", "iter_tensors", "state_nbytes", "is_dtensor"]

#: Leaf types weights-only loading reads back (exact types: numpy scalars subclass
#: float and int, but are refused).
PRIMITIVES = (int, float, complex, str, bytes, bool, type(None), torch.Size, torch.dtype,
              torch.device, torch.layout, torch.qscheme)
#: Tensor types a plain (replicated) checkpoint holds; a DTensor is sharded state.
TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_DICTS = (dict, collections.OrderedDict, collections.Counter)
#: Key types: the immutable, hashable primitives (``torch.Size`` keys are tuples).
_KEY_TYPES = (int, float, complex, str, bool, type(None), bytes, torch.dtype, torch.device,
              torch.layout, torch.qscheme)
#: The types :func:`map_tree` walks into (anything else is a leaf).
_CONTAINERS = frozenset((*_DICTS, list, tuple, set))


def check_key(key: Any, path: str, *, root: str = "state") -> None:
    """Raise TypeError unless ``key`` is a key weights-only loading accepts."""
    if isinstance(key, tuple):
        for k in key:
            check_key(k, path, root=root)
    elif type(key) not in _KEY_TYPES:
        raise TypeError(
            f"{root}{path} has a dict key {key!r} of type {type(key).__qualname__}; "
            "checkpoint keys must be str, int, float, complex, bool, None, bytes, "
            "torch.dtype, torch.device, torch.layout, torch.qscheme or tuples of them"
        )


def map_tree(state: Any, leaf: Callable[[str, Any], Any], *, path: str = "",
             root: str = "state") -> Any:
    """Rebuild the containers of ``state`` with ``leaf(path, value)`` for every leaf.

    Containers are walked by exact type (a ``defaultdict`` or a namedtuple is a leaf,
    which the validator then refuses); keys are checked on the way. A set is kept as
    it is (it holds only hashable primitives, checked like keys). An OrderedDict's
    ``_metadata`` (module versions, from ``state_dict()``) is copied onto the rebuilt
    one (:func:`_module_metadata`).

    Raises:
        TypeError: a dict key or set member that weights-only loading refuses.
    """
    t = type(state)
    if t in _DICTS:
        out = t() if t is not collections.Counter else collections.Counter()
        # a state dict's thousands of leaves: a str key needs no check, and a value
        # that is no container goes to ``leaf`` without a call to this function
        for k, v in state.items():
            sub = f"{path}[{k!r}]"
            if type(k) is not str:
                check_key(k, sub, root=root)
            out[k] = (map_tree(v, leaf, path=sub, root=root) if type(v) in _CONTAINERS
                      else leaf(sub, v))
        if t is collections.OrderedDict:
            meta = _module_metadata(state)
            if meta is not None:
                out._metadata = meta  # type: ignore[attr-defined]
        return out
    if t is list or t is tuple:
        items = [map_tree(v, leaf, path=f"{path}[{i}]", root=root)
                 for i, v in enumerate(state)]
        return items if t is list else tuple(items)
    if t is set:
        for v in state:
            check_key(v, f"{path}{{...}}", root=root)
        return set(state)
    return leaf(path, state)


def _module_metadata(state: Any) -> collections.OrderedDict[str, dict[str, Any]] | None:
    """A copy of the ``_metadata`` that ``nn.Module.state_dict()`` sets on its
    OrderedDict, or None when there is none or it has another form.

    ``load_state_dict`` reads each module's ``version`` from it; without it every
    module is taken for the oldest format and migrates a current state (a
    quantization observer resets its ``eps``, an InstanceNorm drops its running
    stats). It is kept only in its plain form (str keys, each value a dict of str
    keys and primitive values), which weights-only loading reads back; it is
    copied, so that a staged state does not change with the live one.
    """
    meta = getattr(state, "_metadata", None)
    if not isinstance(meta, dict):
        return None
    out: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
    for prefix, local in meta.items():
        if type(prefix) is not str or type(local) is not dict:
            return None
        if any(type(k) is not str or type(v) not in PRIMITIVES for k, v in local.items()):
            return None
        out[prefix] = dict(local)
    return out


def leaves(state: Any, *, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of ``state``, depth first, in container order
    (sets are not entered: their members are primitives)."""
    t = type(state)
    if t in _DICTS:
        for k, v in state.items():
            yield from leaves(v, path=f"{path}[{k!r}]")
    elif t is list or t is tuple:
        for i, v in enumerate(state):
            yield from leaves(v, path=f"{path}[{i}]")
    elif t is not set:
        yield path, state


def refuse(value: Any, path: str, *, root: str = "state") -> TypeError:
    """The error for a leaf weights-only loading cannot read back, with a hint."""
    t = type(value)
    hint = ""
    if t is bytearray:
        return TypeError(f"{root}{path} is a bytearray, which can change while a "
                         "non-blocking save writes it; store bytes(value) instead")
    if isinstance(value, argparse.Namespace):
        hint = " (store vars(args), a dict, instead of the argparse.Namespace)"
    elif t.__module__ == "numpy":
        hint = " (convert numpy values with .item() or torch.from_numpy)"
    elif isinstance(value, tuple):
        hint = " (namedtuples are custom classes: use a dict or a plain tuple)"
    elif is_dtensor(value):
        hint = (" (sharded state: CheckpointStore.save writes DTensors as shards; "
                "torch.save cannot)")
    elif hasattr(value, "state_dict"):
        hint = " (store obj.state_dict() rather than the object)"
    return TypeError(
        f"{root}{path} is a {t.__module__}.{t.__qualname__}, which "
        f"torch.load(weights_only=True) cannot read back; expected tensors, dict/list/"
        f"tuple/set, or int/float/str/bytes/bool/None{hint}"
    )


def _check_leaf(path: str, value: Any, root: str) -> Any:
    t = type(value)
    if t in TENSOR_TYPES or t in PRIMITIVES:
        return value
    raise refuse(value, path, root=root)


def validate_state(state: Any, *, path: str = "", root: str = "state",
                   allow_dtensor: bool = False) -> None:
    """Raise TypeError naming the first key or value weights-only loading refuses.

    The one validator: the store checks a state with it before saving, and
    TrainState checks the user's extras with it when building its state dict.
    ``root`` + ``path`` name the value in the message (``state['opt'][1]``,
    ``extras['when']``). ``allow_dtensor``: a DTensor leaf passes (a state the store
    will save, which writes DTensors as shards: an FSDP2 model's EMA in extras).
    """
    for p, leaf in _walk_checked(state, path, root):
        if allow_dtensor and is_dtensor(leaf):
            continue
        _check_leaf(p, leaf, root)


def _walk_checked(state: Any, path: str, root: str) -> Iterator[tuple[str, Any]]:
    t = type(state)
    if t in _DICTS:
        for k, v in state.items():
            sub = f"{path}[{k!r}]"
            check_key(k, sub, root=root)
            yield from _walk_checked(v, sub, root)
    elif t is list or t is tuple:
        for i, v in enumerate(state):
            yield from _walk_checked(v, f"{path}[{i}]", root)
    elif t is set:
        for v in state:
            check_key(v, f"{path}{{...}}", root=root)
    else:
        yield path, state


def iter_tensors(state: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a state tree, depth first."""
    for _, leaf in leaves(state):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def state_nbytes(state: Any) -> int:
    """Bytes of the tensors in a state tree (a DTensor counts its local shard)."""
    total = 0
    for t in iter_tensors(state):
        local = t.to_local() if is_dtensor(t) else t
        total += local.numel() * local.element_size()
    return total


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (imported only when a
    tensor of another type than a plain tensor or parameter is seen)."""
    if type(value) in TENSOR_TYPES or not isinstance(value, torch.Tensor):
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)
