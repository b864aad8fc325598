"""The snapshot stream of each device: one side stream for a snapshot's copies."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["side_stream"]

_SIDE_STREAMS: dict[torch.device, Any] = {}


def side_stream(device: torch.device) -> Any:
    """The device's snapshot stream, made once (a stream made per snapshot costs a
    driver call each time)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream
