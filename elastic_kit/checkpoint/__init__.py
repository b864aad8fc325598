"""Crash-safe checkpoints on any fsspec URL (issue 3).

Layout of a store::

    <url>/step-000000000100/state.pt        torch.save payload (CPU tensors)
    <url>/step-000000000100/manifest.json   written last: the commit
    <url>/.tmp-step-...                     a save in progress (local disks only)

Modules: :mod:`~elastic_kit.checkpoint.store` (the store), ``api`` (function forms),
``writer`` (commit / verify / delete one directory), ``manifest``, ``serialize``
(validation, hashing writer, weights-only loading), ``broadcast`` (tensor-by-tensor
state broadcast), ``asyncsave`` (the background writer), ``fs`` (URLs, fsync).
"""

from __future__ import annotations

from elastic_kit.checkpoint.api import load_checkpoint, save_checkpoint
from elastic_kit.checkpoint.fs import resolve_url, step_dir_name
from elastic_kit.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest
from elastic_kit.checkpoint.serialize import prepare_state, validate_state
from elastic_kit.checkpoint.store import CheckpointInfo, CheckpointStore, LoadedCheckpoint
from elastic_kit.checkpoint.writer import PAYLOAD_NAME

__all__ = [
    "CheckpointStore",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "save_checkpoint",
    "load_checkpoint",
    "Manifest",
    "FileEntry",
    "MANIFEST_NAME",
    "PAYLOAD_NAME",
    "resolve_url",
    "step_dir_name",
    "validate_state",
    "prepare_state",
]
