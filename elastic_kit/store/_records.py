"""What the store hands back: a save's handle and the records of checkpoints.

Kept apart from :class:`~elastic_kit.store.CheckpointStore` so the records read in one
place; the store builds them from manifests (:meth:`CheckpointInfo.from_manifest`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from elastic_kit.store._manifest import Manifest

__all__ = ["SaveHandle", "CheckpointInfo", "LoadedCheckpoint", "resolved"]


def resolved() -> Future[None]:
    """A future that is already done (a save with nothing left to wait for)."""
    fut: Future[None] = Future()
    fut.set_result(None)
    return fut


@dataclass(frozen=True)
class SaveHandle:
    """What :meth:`CheckpointStore.save` returns: its step and two futures.

    The shape of DCP's ``AsyncSaveResponse``: ``staged`` resolves once the save no
    longer reads the caller's tensors (they may change again: the optimizer
    pre-hook of a non-blocking save waits for it), ``committed`` once the
    checkpoint is committed, or with the write's error. A blocking save, and a
    save on a rank that does not write, returns both resolved.

    A failed non-blocking write is raised by :meth:`wait` (and ``committed``), and
    also, as before, by the store's next ``save``/``wait``/``close``.
    """

    step: int
    staged: Future[None] = field(default_factory=resolved)
    committed: Future[None] = field(default_factory=resolved)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed; raise the write's error."""
        self.committed.result(timeout)

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self.committed.done()


@dataclass
class CheckpointInfo:
    """A committed checkpoint: the one record of one, built from its manifest.

    :meth:`CheckpointStore.list` returns these; :meth:`CheckpointStore.load` returns a
    :class:`LoadedCheckpoint`, which is one of these plus the state.

    Attributes:
        step: the step it was saved at.
        path: its ``step-<n>`` directory (this node's copy when node-local).
        metadata: the ``metadata`` given to ``save``.
        size_bytes: the payload's size.
        time: the commit's wall time in seconds since the epoch.
        epoch: the manifest's epoch (``metadata["epoch"]`` when it was an int).
        world_size: the world size of the job that saved it.
        manifest: the parsed ``manifest.json`` (files, checksums, versions).
    """

    step: int
    path: str
    metadata: dict[str, Any]
    size_bytes: int
    time: float
    epoch: int | None = None
    world_size: int = 1
    manifest: Manifest | None = field(default=None, repr=False)

    @classmethod
    def from_manifest(cls, path: str, manifest: Manifest, **extra: Any) -> Any:
        """The record of the checkpoint in ``path`` that ``manifest`` commits."""
        return cls(step=manifest.step, path=path, metadata=manifest.metadata,
                   size_bytes=manifest.size_bytes, time=manifest.time, epoch=manifest.epoch,
                   world_size=manifest.world_size, manifest=manifest, **extra)


@dataclass
class LoadedCheckpoint(CheckpointInfo):
    """What :meth:`CheckpointStore.load` returns: a :class:`CheckpointInfo` and the state.

    Attributes:
        state: the state dict (tensors on ``map_location``, CPU by default).
        lacked_locally: with ``node_local=True``, this node's storage did not hold the
            step: it was broadcast from another node (:meth:`CheckpointStore.keep_copy`
            commits it here).
    """

    state: dict[str, Any] = field(kw_only=True)
    lacked_locally: bool = field(default=False, kw_only=True)
