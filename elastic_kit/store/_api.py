"""Function forms of the store: ``save_checkpoint`` / ``load_checkpoint``.

For scripts that want one call at a save point and one at start-up, with either a
URL (a store is created for the call) or an existing :class:`CheckpointStore`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from elastic_kit._checks import type_error
from elastic_kit.errors import CheckpointMismatchError
from elastic_kit.store._into import load_into
from elastic_kit.store._store import CheckpointStore, LoadedCheckpoint

__all__ = ["save_checkpoint", "load_checkpoint"]

_STORE_OPTIONS = ("keep_last", "node_local", "storage_options", "info", "checksum",
                  "reuse_staging", "io_timeout", "read_attempts", "load_timeout",
                  "stale_after_s", "filesystem", "private")


def _check_module_shapes(module: torch.nn.Module, loaded: dict[str, Any]) -> None:
    """Refuse, before anything is copied, a checkpoint whose tensor at a key of
    ``module``'s state dict has another shape: ``Module.load_state_dict`` copies the
    tensors that fit before it raises, leaving a model half loaded. (Missing and
    unexpected keys are left to it: a module's load hooks may rename them.)"""
    bad = []
    for key, own in module.state_dict(keep_vars=True).items():
        src = loaded.get(key)
        if (not isinstance(own, torch.Tensor) or not isinstance(src, torch.Tensor)
                or isinstance(own, torch.nn.parameter.UninitializedParameter)):
            continue
        if own.dim() == 0 and src.dim() == 1 and src.numel() == 1:
            continue  # torch's own loader takes a (1,) tensor for a 0-d one
        if tuple(own.shape) != tuple(src.shape):
            bad.append(f"{key} {list(src.shape)} (the module's: {list(own.shape)})")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointMismatchError(
            f"{len(bad)} checkpoint tensor(s) have another shape than the module's: "
            f"{shown}; nothing was loaded")


def _store(url_or_store: str | os.PathLike[str] | CheckpointStore, kw: dict[str, Any]) -> tuple[CheckpointStore, bool]:
    if isinstance(url_or_store, CheckpointStore):
        extra = sorted(k for k in kw if k in _STORE_OPTIONS)
        if extra:
            raise TypeError(f"options {extra} configure a new store; they cannot be applied to "
                            f"the existing {url_or_store!r}")
        return url_or_store, False
    opts = {k: kw.pop(k) for k in list(kw) if k in _STORE_OPTIONS}
    # a call saves (or loads) one checkpoint, as torch.save does: it deletes none of
    # the URL's others unless asked (they may be a Checkpointer's, with its own
    # keep_last: a script's export to the checkpointer's URL pruned them to three)
    opts.setdefault("keep_last", None)
    return CheckpointStore(url_or_store, **opts), True


def save_checkpoint(state: Any, url_or_store: str | os.PathLike[str] | CheckpointStore, *, step: int,
                    **kw: Any) -> None:
    """Save ``state`` (a dict, or an object with ``state_dict()``) as checkpoint ``step``.

    Not collective, like :meth:`CheckpointStore.save`: ``if rank == 0:
    save_checkpoint(...)`` works (other ranks would return at once anyway). ``kw``
    holds the store options (``keep_last``, ``node_local``, ``storage_options``,
    ``info``, ``checksum``, ...) when a URL is given, and the save options
    (``metadata``, ``blocking``). With a URL nothing else there is deleted unless
    ``keep_last`` is given (a :class:`CheckpointStore`'s default keeps 3): the URL's
    other checkpoints may be a :class:`~elastic_kit.Checkpointer`'s, kept by its own
    ``keep_last``.

    Raises ``TypeError`` when ``state`` is neither a dict nor has ``state_dict()``
    (``save_checkpoint(5, url, ...)``, or the two first arguments swapped).

    .. warning::
        With a URL the temporary store is closed before returning, so
        ``blocking=False`` only helps with a :class:`CheckpointStore` you keep.

    Example::

        save_checkpoint(train_state, "/shared/ckpt", step=step, metadata={"epoch": epoch})
    """
    # the state first, before a store (and its directory) is made: with the arguments
    # swapped, the URL is the state
    if not (isinstance(state, Mapping) or hasattr(state, "state_dict")):
        raise type_error("state", state, "a dict of the state, or an object with "
                                         "state_dict() (a TrainState, a module)")
    store, owned = _store(url_or_store, dict(kw))
    save_kw = {k: v for k, v in kw.items() if k not in _STORE_OPTIONS}
    sd = state.state_dict() if hasattr(state, "state_dict") and not isinstance(state, dict) else state
    try:
        store.save(sd, step=step, **save_kw)
    finally:
        if owned:
            store.close()


def load_checkpoint(state: Any, url_or_store: str | os.PathLike[str] | CheckpointStore,
                    **kw: Any) -> LoadedCheckpoint | None:
    """Load the newest verified checkpoint into ``state`` and return it (None if none).

    ``state`` is updated with ``load_state_dict`` when it has one, and left alone when
    None. A dict is loaded in place, as ``torch.distributed.checkpoint.load`` does:
    each loaded tensor is copied into the tensor the dict holds at the same key path
    (so ``{"model": model.state_dict()}`` loads into the model's own parameters,
    converted to their dtype and device), after every shape was checked and every
    tensor the dict holds was found in the checkpoint; any other value, and a key the
    dict lacks, is set as ``dict.update`` would (into the dict: an optimizer's learning
    rate lands in ``state["optim"]``, so call its ``load_state_dict`` after, as with
    DCP). Collective,
    like :meth:`CheckpointStore.load`; ``kw`` holds store options and
    ``map_location``. A sharded checkpoint is loaded into ``state``'s own layout (the
    DTensors of an FSDP2 model's :class:`~elastic_kit.TrainState`, or of a dict).

    Raises:
        CheckpointMismatchError: (a ``ValueError``) a checkpoint tensor's shape
            differs from the tensor ``state`` (a dict, a module, a ``TrainState``)
            holds at its key path, or a dict ``state`` holds a tensor at a key path
            the checkpoint lacks; nothing was loaded into ``state``. A module's
            missing or unexpected keys raise as ``Module.load_state_dict`` does.

    Example::

        loaded = load_checkpoint(train_state, "/shared/ckpt")
        start_step = loaded.step + 1 if loaded else 0
    """
    store, owned = _store(url_or_store, dict(kw))
    load_kw = {k: v for k, v in kw.items() if k not in _STORE_OPTIONS}
    if "into" not in load_kw and getattr(state, "sharded", False):
        load_kw["into"] = state.state_dict  # a sharded state loads into its own layout
    elif "into" not in load_kw and isinstance(state, dict):
        load_kw["into"] = state
    try:
        loaded = store.load(**load_kw)
        store.keep_copy(loaded)
    finally:
        if owned:
            store.close()
    if loaded is not None and state is not None:
        if hasattr(state, "load_state_dict"):
            if isinstance(state, torch.nn.Module) and isinstance(loaded.state, dict):
                _check_module_shapes(state, loaded.state)
            state.load_state_dict(loaded.state)
        elif isinstance(state, dict):
            load_into(state, loaded.state)
        else:
            raise TypeError(f"state of type {type(state).__qualname__} has no load_state_dict() "
                            "and is not a dict; pass None to only get the LoadedCheckpoint")
    return loaded
