"""Crash-safe checkpoints on any fsspec URL.

Layout of a store::

    <url>/step-000000000100/state.pt        torch.save payload (CPU tensors)
    <url>/step-000000000100/manifest.json   written last: the commit
    <url>/.tmp-step-...                     a save in progress (local disks only)
    <url>/run-identity                      the run this store holds (see run_identity)

The public names are :class:`CheckpointStore`, :class:`CheckpointInfo`,
:class:`LoadedCheckpoint`, :func:`save_checkpoint` and :func:`load_checkpoint`. The
layout's names and rules (:class:`Layout`, :func:`step_dir_name`, :class:`Manifest`,
...) are exported too, for the in-memory tier, which keeps snapshots in the same
format; they are not part of ``elastic_kit``'s top-level API.
Internals: ``_store`` (the store), ``_api`` (function forms), ``_layout`` (the
on-storage rules: names, scan, verify, commit order, retention, stale cleanup),
``_backend`` (the operations a storage performs below those rules),
``_backend_local`` and ``_backend_object`` (a local disk; an object store),
``_manifest`` (validation),
``_tree`` (the one walk over a state tree and the one validator, exported for the
other packages: :func:`map_tree`, :func:`leaves`, :func:`validate_state`,
:func:`iter_tensors`, :func:`state_nbytes`),
``_serialize`` (weights-only state, hashing writer), ``_broadcast`` (tensor-by-tensor
state broadcast), ``_fs`` (URLs, timeouts, retries, fsync).
"""

from __future__ import annotations

from elastic_kit.store._api import load_checkpoint, save_checkpoint
from elastic_kit.store._fs import resolve_url
from elastic_kit.store._identity import IDENTITY_NAME
from elastic_kit.store._backend_local import TMP_PREFIX
from elastic_kit.store._layout import Layout, parse_step_dir, step_dir_name
from elastic_kit.store._manifest import MANIFEST_NAME, Manifest, check_file_name
from elastic_kit.store._store import (
    CheckpointInfo, CheckpointStore, LoadedCheckpoint, SaveHandle,
)
from elastic_kit.store._tree import (
    is_dtensor, iter_tensors, leaves, map_tree, state_nbytes, validate_state,
)

__all__ = [
    "CheckpointStore",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "save_checkpoint",
    "load_checkpoint",
    "SaveHandle",
    # the layout, for the in-memory tier
    "Layout",
    "IDENTITY_NAME",
    "Manifest",
    "MANIFEST_NAME",
    "TMP_PREFIX",
    "check_file_name",
    "parse_step_dir",
    "resolve_url",
    "step_dir_name",
    # the one state-tree walker and validator, for the other packages
    "map_tree",
    "leaves",
    "validate_state",
    "iter_tensors",
    "state_nbytes",
    "is_dtensor",
]
