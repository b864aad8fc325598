"""Writing, verifying and deleting one checkpoint directory, crash-safely.

The single rule everything here follows: *a checkpoint exists only once its
manifest is in place, and the manifest is the last thing written*. How that is
made atomic depends on the storage:

- local / NFS: payload and manifest go into ``.tmp-step-<n>-<id>/``; both files and
  the directory are fsync'ed, the directory is renamed to ``step-<n>/`` and the
  parent is fsync'ed. A crash leaves either the old state or a ``.tmp-*`` directory
  that the next save removes.
- object stores (and ``memory://``): the payload is uploaded into ``step-<n>/`` and
  the manifest is uploaded after it. A crash leaves a directory without a manifest,
  which readers skip and the next save removes.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import torch

from elastic_kit.checkpoint.fs import (
    TMP_PREFIX, fsync_dir, is_local, join, parse_step_dir, step_dir_name,
)
from elastic_kit.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest
from elastic_kit.checkpoint.serialize import (
    HashingWriter, hash_stream, iter_tensors, torch_zip_crc_off,
)
from elastic_kit.errors import CheckpointCorruptError

__all__ = ["PAYLOAD_NAME", "StepDir", "scan", "read_manifest", "verify", "write_checkpoint",
           "delete_step", "clean_stale"]

log = logging.getLogger(__name__)

PAYLOAD_NAME = "state.pt"
WRITEBACK_EVERY = 8 << 20  # local files: start the disk's writeback every 8 MiB written
_HOST = socket.gethostname().replace("-", "_") or "host"


@dataclass(frozen=True)
class StepDir:
    """A ``step-<n>`` directory, committed or not."""

    step: int
    path: str


def scan(fs: fsspec.AbstractFileSystem, root: str) -> list[StepDir]:
    """Every ``step-<n>`` directory under ``root``, oldest first (committed or not)."""
    try:
        fs.invalidate_cache(root)  # s3fs caches listings: another rank may have written
    except Exception:  # pragma: no cover - not every filesystem caches
        pass
    try:
        names = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        step = parse_step_dir(name)
        if step is not None:
            out.append(StepDir(step, join(root, name.rstrip("/").rsplit("/", 1)[-1])))
    return sorted(out, key=lambda d: d.step)


def read_manifest(fs: fsspec.AbstractFileSystem, d: StepDir) -> Manifest:
    """The parsed manifest of ``d``; :class:`CheckpointCorruptError` when missing or bad."""
    path = join(d.path, MANIFEST_NAME)
    try:
        text = fs.cat_file(path)
    except FileNotFoundError as e:
        raise CheckpointCorruptError(
            f"{d.path}: {MANIFEST_NAME} is missing (a save that did not finish?)") from e
    m = Manifest.from_json(text, where=path)
    if m.step != d.step:
        raise CheckpointCorruptError(
            f"{path}: manifest says step {m.step} but the directory is step {d.step}")
    return m


def verify(fs: fsspec.AbstractFileSystem, d: StepDir, *, deep: bool = True,
           keep: bool = False) -> tuple[Manifest, Any]:
    """Check ``d`` against its manifest.

    Args:
        deep: also recompute every checksum (reads the whole payload); otherwise
            only existence and sizes are checked.
        keep: return a source for :func:`torch.load`: the local path (already in the
            page cache) or, on remote storage, the bytes read while hashing, so an
            object is downloaded once.

    Returns:
        ``(manifest, source)``; ``source`` is None unless ``keep``.

    Raises:
        CheckpointCorruptError: naming the directory and what does not match.
    """
    m = read_manifest(fs, d)
    local = is_local(fs)
    source: Any = None
    for name, entry in m.files.items():
        path = join(d.path, name)
        try:
            size = int(fs.size(path))
        except FileNotFoundError as e:
            raise CheckpointCorruptError(
                f"{d.path}: the manifest names {name}, which does not exist") from e
        if size != entry.size:
            raise CheckpointCorruptError(
                f"{d.path}: {name} is {size} bytes but the manifest says {entry.size} "
                f"(truncated or partially written)")
        if not deep:
            continue
        buf = io.BytesIO() if keep and not local and name == PAYLOAD_NAME else None
        opener = open(path, "rb") if local else fs.open(path, "rb")
        with opener as f:
            _, digest = hash_stream(f, m.checksum, sink=buf.write if buf else None)
        if digest != entry.checksum:
            raise CheckpointCorruptError(
                f"{d.path}: {name} has {m.checksum} {digest} but the manifest says "
                f"{entry.checksum} (corrupt payload)")
        if keep and name == PAYLOAD_NAME:
            if buf is not None:
                buf.seek(0)
            source = buf if buf is not None else path
    if keep and source is None:
        source = join(d.path, PAYLOAD_NAME) if local else io.BytesIO(
            fs.cat_file(join(d.path, PAYLOAD_NAME)))
    return m, source


def _save_into(f: IO[bytes], state: Any, checksum: str, *, fsync: bool) -> FileEntry:
    """torch.save ``state`` into ``f`` while checksumming; fsync overlaps the hashing."""
    w = HashingWriter(f, checksum, stable=list(iter_tensors(state)),
                      writeback_every=WRITEBACK_EVERY if fsync else None)
    try:
        with torch_zip_crc_off(w):
            torch.save(state, w)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        size, digest = w.finish()
    finally:
        w.close()
    return FileEntry(size=size, checksum=digest)


def write_checkpoint(fs: fsspec.AbstractFileSystem, root: str, state: Any, *, step: int,
                     checksum: str = "xxh3_128", metadata: dict[str, Any] | None = None,
                     world_size: int = 1) -> tuple[str, Manifest]:
    """Write and commit ``state`` as ``root/step-<n>``; returns (path, manifest).

    A committed checkpoint of the same step is replaced (its directory is swapped out
    only after the new one is complete on local storage).
    """
    metadata = dict(metadata or {})
    epoch = metadata.get("epoch")
    name = step_dir_name(step)
    final = join(root, name)

    def manifest_for(entry: FileEntry) -> Manifest:
        return Manifest(step=step, files={PAYLOAD_NAME: entry}, checksum=checksum,
                        metadata=metadata, epoch=epoch if isinstance(epoch, int) else None,
                        world_size=world_size)

    if is_local(fs):
        os.makedirs(root, exist_ok=True)
        tmp = join(root, _tmp_name(name))
        os.mkdir(tmp)
        try:
            with open(join(tmp, PAYLOAD_NAME), "wb") as f:
                entry = _save_into(f, state, checksum, fsync=True)
            manifest = manifest_for(entry)
            with open(join(tmp, MANIFEST_NAME), "w", encoding="utf-8") as f:
                f.write(manifest.to_json())
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            trash = None
            if os.path.exists(final):
                trash = join(root, _tmp_name("old-" + name))
                os.rename(final, trash)
            os.rename(tmp, final)
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return final, manifest

    manifest_path = join(final, MANIFEST_NAME)
    if fs.exists(manifest_path):
        fs.rm(manifest_path)  # un-commit the old copy of this step before overwriting it
    with fs.open(join(final, PAYLOAD_NAME), "wb") as f:
        entry = _save_into(f, state, checksum, fsync=False)
    manifest = manifest_for(entry)
    fs.pipe_file(manifest_path, manifest.to_json().encode("utf-8"))
    return final, manifest


def delete_step(fs: fsspec.AbstractFileSystem, root: str, d: StepDir) -> None:
    """Delete one checkpoint so that a crash half way never leaves it 'committed'."""
    if is_local(fs):
        trash = join(root, _tmp_name("del-" + step_dir_name(d.step)))
        try:
            os.rename(d.path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)
        return
    try:
        fs.rm(join(d.path, MANIFEST_NAME))  # uncommit first
    except FileNotFoundError:
        pass
    try:
        fs.rm(d.path, recursive=True)
    except FileNotFoundError:
        pass


def _tmp_name(what: str) -> str:
    """``.tmp-<what>-<host>-<pid>-<rand>``: the owner is named so cleaners can spare it."""
    return f"{TMP_PREFIX}{what}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _is_abandoned(path: str, name: str, stale_after_s: float) -> bool:
    """True when no live process can still be writing the temporary directory ``name``.

    Same host: its pid is gone. Another host (shared NFS) or an unknown name: it has
    not been modified for ``stale_after_s`` seconds.
    """
    parts = name.rsplit("-", 3)
    if len(parts) == 4 and parts[2].isdigit() and parts[1] == _HOST:
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, owned by someone else
            return False
        return False
    try:
        return time.time() - os.path.getmtime(path) > stale_after_s
    except FileNotFoundError:
        return False


def clean_stale(fs: fsspec.AbstractFileSystem, root: str, *, newest_committed: int,
                stale_after_s: float = 3600.0) -> int:
    """Remove leftovers of crashed saves; returns how many were removed.

    On local storage, every ``.tmp-*`` directory whose writer is gone (its pid is dead
    on this host; on another host, untouched for ``stale_after_s``), so that a
    concurrent ``elastic-kit prune`` or a second store object never removes a save
    in flight; and on any storage, every ``step-<n>`` directory without a manifest
    older than ``newest_committed``.
    """
    removed = 0
    if is_local(fs):
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return 0
        for n in names:
            if n.startswith(TMP_PREFIX) and _is_abandoned(join(root, n), n, stale_after_s):
                log.info("removing the leftover of an interrupted save: %s", join(root, n))
                shutil.rmtree(join(root, n), ignore_errors=True)
                removed += 1
    for d in scan(fs, root):
        if d.step < newest_committed and not fs.exists(join(d.path, MANIFEST_NAME)):
            log.info("removing the leftover of an interrupted save: %s", d.path)
            delete_step(fs, root, d)
            removed += 1
    return removed
