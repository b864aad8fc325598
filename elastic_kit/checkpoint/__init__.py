"""Crash-safe checkpoints on any fsspec URL.

Layout of a store::

    <url>/step-000000000100/state.pt        torch.save payload (CPU tensors)
    <url>/step-000000000100/manifest.json   written last: the commit
    <url>/.tmp-step-...                     a save in progress (local disks only)

The public names are :class:`CheckpointStore`, :class:`CheckpointInfo`,
:class:`LoadedCheckpoint`, :func:`save_checkpoint` and :func:`load_checkpoint`.
Internals: ``_store`` (the store), ``_api`` (function forms), ``_layout`` (the
on-storage layout: names, scan, verify, commit, prune), ``_manifest`` (validation),
``_serialize`` (weights-only state, hashing writer), ``_broadcast`` (tensor-by-tensor
state broadcast), ``_fs`` (URLs, timeouts, retries, fsync).
"""

from __future__ import annotations

from elastic_kit.checkpoint._api import load_checkpoint, save_checkpoint
from elastic_kit.checkpoint._store import CheckpointInfo, CheckpointStore, LoadedCheckpoint

__all__ = [
    "CheckpointStore",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "save_checkpoint",
    "load_checkpoint",
]
