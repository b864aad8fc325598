"""What a checkpointer needs of a store, as a protocol, so wrappers can stand in."""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import torch

from elastic_kit.store import LoadedCheckpoint

__all__ = ["StoreLike"]


class StoreLike(Protocol):
    """What a checkpointer (and :class:`~elastic_kit.ElasticLoop`) needs of a store.

    :class:`~elastic_kit.CheckpointStore` is the implementation; tests and benchmarks
    wrap it (to count or time saves) by providing these methods.
    """

    url: str

    def load(self, *, map_location: Any = None) -> LoadedCheckpoint | None: ...

    def save(self, state_dict: dict[str, Any], *, step: int,
             metadata: dict[str, Any] | None = None, blocking: bool = True,
             copy_later: Iterable[torch.Tensor] = ()) -> None: ...

    def wait(self) -> None: ...

    def wait_local(self) -> None: ...

    def wait_staged(self) -> None: ...

    def close(self) -> None: ...
