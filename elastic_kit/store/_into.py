"""Loading a checkpoint into a dict the caller holds: tensors in place, as DCP does.

``load_checkpoint(state_dict, url)`` with ``state_dict = {"model": model.state_dict(),
...}`` is the pattern of ``torch.distributed.checkpoint.load``, which copies into the
tensors it is given. Those tensors share their storage with the live parameters and
buffers (a module's ``state_dict()`` detaches, it does not copy; an optimizer's holds
its state tensors), so the load reaches the model and the optimizer. Replacing the
dict's values instead (``dict.update``) would leave the model with the weights it had
before while the step and epoch came from the checkpoint: a silently wrong resume.

:func:`load_into` therefore copies every loaded tensor into the tensor the dict holds
at the same key path, after checking every pair first (nothing is copied when one
shape differs), and sets everything else as ``dict.update`` would: new keys, values
that are not tensors, a tensor where the dict held none. A tensor the dict holds at a
path the checkpoint lacks fails the load, as it does in DCP and in a module's strict
``load_state_dict``: a bare ``model.state_dict()`` loaded into ``{"model": ...}``, or
a DDP ``module.`` prefix on one side only, would otherwise load nothing and say
nothing while the model trained on from the weights it had.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_kit.errors import CheckpointMismatchError
from elastic_kit.store._tree import is_dtensor

__all__ = ["load_into"]

def load_into(target: dict[Any, Any], loaded: dict[Any, Any]) -> None:
    """Load ``loaded`` into ``target`` in place (see the module docstring).

    Dicts present on both sides are entered; lists (and tuples) of the same length on
    both sides are entered item by item (a tuple is rebuilt from its items, loaded
    as a list's are: its tensors stay the caller's); a tensor of ``loaded`` whose place in ``target`` holds a
    tensor is copied into it (converted to its dtype and device, as
    ``Module.load_state_dict`` does; a DTensor receives its own box of a whole tensor);
    any other value replaces what ``target`` held there, a tensor on the meta device
    included (it has no memory to copy into).

    Raises:
        CheckpointMismatchError: (a ``ValueError``) a loaded tensor's shape differs
            from the shape of the tensor ``target`` holds at its path, or ``target``
            holds a tensor at a path the checkpoint lacks (or where it holds another
            value: a number, a list or tuple of another length); nothing was loaded.
        ValueError: a tensor ``target`` holds cannot be copied into in place (an
            expanded view, an inference tensor); nothing was loaded.
        RuntimeError: a copy failed otherwise, naming the tensor's path; the
            tensors before it were loaded.
    """
    if not isinstance(loaded, dict):
        raise TypeError(f"the checkpoint holds a {type(loaded).__qualname__}, not a dict; "
                        "pass state=None and read LoadedCheckpoint.state instead")
    copies: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    sets: list[tuple[Any, Any, Any]] = []
    missing: list[str] = []
    _plan(target, loaded, "", copies, sets, missing)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more"
                                          if len(missing) > 5 else "")
        top = sorted(map(repr, loaded))
        keys = ", ".join(top[:8]) + (" ..." if len(top) > 8 else "")
        raise CheckpointMismatchError(
            f"the checkpoint has no tensor for {len(missing)} of the tensors the state "
            f"holds: {shown}; its top-level keys are {keys}. Nothing was loaded (expected the same key paths: a checkpoint of a "
            f"bare model.state_dict() or with a DDP 'module.' prefix differs; to load "
            f"part of it, pass state=None and pick from LoadedCheckpoint.state)")
    for path, dst, src in copies:
        if tuple(dst.shape) != tuple(src.shape):
            raise CheckpointMismatchError(
                f"checkpoint tensor {path} has shape {list(src.shape)}, the tensor the "
                f"state holds there has {list(dst.shape)}; nothing was loaded")
        why = _not_writable(dst)
        if why:
            raise ValueError(f"the tensor the state holds at {path} cannot be loaded "
                             f"into: {why}; nothing was loaded")
    with torch.no_grad():
        for path, dst, src in copies:
            try:
                _copy(dst, src)
            except RuntimeError as e:
                raise RuntimeError(f"loading checkpoint tensor {path} failed ({e}); the "
                                   "tensors before it were loaded") from e
    for container, key, value in sets:  # in order: a tuple's items before the tuple
        container[key] = tuple(value.items) if isinstance(value, _TupleOf) else value


class _TupleOf:
    """A tuple to set once its items (a list the plan loads into) are loaded."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items


def _plan(target: Any, loaded: Any, path: str,
          copies: list[tuple[str, torch.Tensor, torch.Tensor]],
          sets: list[tuple[Any, Any, Any]], missing: list[str]) -> None:
    """Collect the copies and assignments that load ``loaded`` into ``target``, and
    the paths of the tensors ``target`` holds where ``loaded`` has nothing."""
    items = (loaded.items() if isinstance(loaded, dict)
             else enumerate(loaded))
    if isinstance(target, dict) and isinstance(loaded, dict):
        for key, value in target.items():
            if key not in loaded:
                _tensor_paths(value, f"{path}[{key!r}]", missing)
    for key, value in items:
        sub = f"{path}[{key!r}]"
        if isinstance(target, dict):
            has, current = key in target, target.get(key)
        else:
            has, current = True, target[key]
        if not has:
            sets.append((target, key, value))
        elif isinstance(current, dict) and isinstance(value, dict):
            _plan(current, value, sub, copies, sets, missing)
        elif (type(current) is list and type(value) is list
              and len(current) == len(value)):
            _plan(current, value, sub, copies, sets, missing)
        elif (type(current) is tuple and type(value) is tuple
              and len(current) == len(value)):
            # a tuple cannot take assignments: it is loaded as a list (its tensors in
            # place, its other values set), and a tuple of that list replaces it
            items_of = list(current)
            _plan(items_of, value, sub, copies, sets, missing)
            sets.append((target, key, _TupleOf(items_of)))
        elif (isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor)
              and not current.is_meta and (is_dtensor(current) or not is_dtensor(value))):
            # (a meta tensor holds no memory to copy into: it is replaced, as any value;
            # a DTensor is loaded only where the state holds one: read_sharded)
            if current is not value:
                copies.append((sub, current, value))
        else:
            if not (isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor)):
                # the tensors the state holds here would be replaced, not loaded: a
                # tensor where the checkpoint has another value, a list or tuple of
                # another length
                _tensor_paths(current, sub, missing, value)
            sets.append((target, key, value))


def _tensor_paths(value: Any, path: str, out: list[str], instead: Any = None) -> None:
    """The key paths of the tensors in ``value`` (entered through dicts, lists and
    tuples), appended to ``out``; ``instead``: what the checkpoint holds at ``path``
    (named when it is not a tensor's absence but another value)."""
    before = len(out)
    if isinstance(value, torch.Tensor):
        out.append(path)
    elif isinstance(value, dict):
        for k, v in value.items():
            _tensor_paths(v, f"{path}[{k!r}]", out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _tensor_paths(v, f"{path}[{i}]", out)
    if instead is not None and len(out) > before:
        what = (f"a {type(instead).__name__} of length {len(instead)}"
                if isinstance(instead, (list, tuple))
                else f"a value of type {type(instead).__name__}")
        out[before] += f" (the checkpoint holds {what} at {path})"


def _not_writable(dst: torch.Tensor) -> str:
    """Why ``dst`` cannot be copied into in place ("" when it can): checked before any
    copy, so that such a state is refused whole, not loaded in part."""
    if is_dtensor(dst):
        return ""
    if dst.is_inference() and not torch.is_inference_mode_enabled():
        return "an inference tensor (made under torch.inference_mode(); clone it)"
    if torch._debug_has_internal_overlap(dst) == 1:  # MemOverlap::Yes
        return ("its elements share memory (an expanded or broadcast view; "
                "give it memory of its own, e.g. .clone())")
    return ""


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; a DTensor ``dst`` takes its own box of a whole ``src``."""
    if is_dtensor(dst) and not is_dtensor(src):
        from elastic_kit.store._sharded import local_box

        shape, offsets, _ = local_box(dst)
        box = src[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
        dst.to_local().copy_(box)
    else:
        dst.copy_(src)
