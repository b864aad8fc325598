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
``_flat_commit`` (one writer's tensors in one flat tensor file, committed around the
file as it lies and read back as views of its mapping: the in-memory tier's format),
``_serialize`` (weights-only state, hashing writer), ``_broadcast`` (tensor-by-tensor
state broadcast), ``_fs`` (URLs, timeouts, retries, fsync).
"""

from __future__ import annotations

from elastic_kit.store._api import load_checkpoint, save_checkpoint
from elastic_kit.store._broadcast import agree_on_holder, broadcast_state, target_device
from elastic_kit.store._flat_commit import (
    FLAT_NAME, FlatCheckpoint, FlatHashes, FlatPlan, commit_flat, copy_tensors, flat_file,
    hash_flat, is_flat, open_flat, plan_flat, pool_cpu_seconds, release_flat, split_state, storable,
    tensor_views, zero_bytes,
)
from elastic_kit.store._digest import combine as combine_digest, partial as digest_partial
from elastic_kit.store._fs import resolve_url
from elastic_kit.store._identity import IDENTITY_NAME
from elastic_kit.store._backend_local import TMP_PREFIX
from elastic_kit.store._layout import Layout, StepDir, parse_step_dir, step_dir_name
from elastic_kit.store._manifest import MANIFEST_NAME, Manifest, check_file_name
from elastic_kit.store._sharded import local_box
from elastic_kit.store._tensorfile import map_file
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
    "StepDir",
    "IDENTITY_NAME",
    "Manifest",
    "MANIFEST_NAME",
    "TMP_PREFIX",
    "check_file_name",
    "parse_step_dir",
    "resolve_url",
    "step_dir_name",
    # one writer's flat tensor file, mapped in place (the in-memory tier's one copy)
    "FLAT_NAME",
    "FlatPlan",
    "FlatHashes",
    "FlatCheckpoint",
    "split_state",
    "storable",
    "pool_cpu_seconds",
    "plan_flat",
    "tensor_views",
    "map_file",
    "copy_tensors",
    "zero_bytes",
    "hash_flat",
    "commit_flat",
    "release_flat",
    "flat_file",
    "is_flat",
    "open_flat",
    # sharded state kept by the in-memory tier: a shard's box and the
    # layout-independent digest
    "local_box",
    "digest_partial",
    "combine_digest",
    # restoring on every rank from the one that holds the newest step
    "agree_on_holder",
    "broadcast_state",
    "target_device",
    # the one state-tree walker and validator, for the other packages
    "map_tree",
    "leaves",
    "validate_state",
    "iter_tensors",
    "state_nbytes",
    "is_dtensor",
]
