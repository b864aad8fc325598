"""The manifest: the file that turns a directory of bytes into a checkpoint.

``manifest.json`` is written last. It records what the payload must look like
(every file with its size and checksum) and where it came from (step, world size,
library and torch versions, wall time, the caller's metadata). A directory without
a manifest that parses, or whose files do not match it, is not a checkpoint.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from elastic_kit.errors import CheckpointCorruptError

__all__ = ["MANIFEST_NAME", "FORMAT", "FileEntry", "Manifest"]

MANIFEST_NAME = "manifest.json"
#: Bumped when the layout changes incompatibly; readers refuse other formats.
FORMAT = "elastic_kit.checkpoint/1"
CHECKSUMS = ("xxh3_128", "crc32", "sha256")


def _library_version() -> str:
    try:
        from elastic_kit import __version__

        return str(__version__)
    except Exception:  # pragma: no cover - only during a broken partial import
        return "unknown"


@dataclass(frozen=True)
class FileEntry:
    """One payload file: its size in bytes and its checksum (hex)."""

    size: int
    checksum: str


@dataclass
class Manifest:
    """What a committed checkpoint holds; serialized as ``manifest.json``.

    Attributes:
        step: the global step the state belongs to.
        files: payload file name (relative to the step directory) -> :class:`FileEntry`.
        checksum: the algorithm of every file's checksum: ``"xxh3_128"``, ``"crc32"``
            or ``"sha256"`` (a manifest without the field is crc32).
        metadata: the caller's JSON-able metadata (``{"epoch": 3, ...}``).
        epoch: ``metadata["epoch"]`` when given, for quick listing.
        world_size: the world size of the job that saved it.
        time: wall time of the commit (seconds since the epoch).
    """

    step: int
    files: dict[str, FileEntry]
    checksum: str = "crc32"
    metadata: dict[str, Any] = field(default_factory=dict)
    epoch: int | None = None
    world_size: int = 1
    time: float = field(default_factory=time.time)
    format: str = FORMAT
    elastic_kit_version: str = field(default_factory=_library_version)
    torch_version: str = field(default_factory=lambda: str(torch.__version__))
    python_version: str = field(default_factory=platform.python_version)

    def __post_init__(self) -> None:
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"checksum={self.checksum!r} must be one of {CHECKSUMS}")
        if self.step < 0:
            raise ValueError(f"step={self.step} must be >= 0")

    @property
    def size_bytes(self) -> int:
        """Total payload size."""
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        """The manifest as pretty JSON (humans read it when debugging a store)."""
        d = asdict(self)
        return json.dumps(d, indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "") -> Manifest:
        """Parse a manifest, raising :class:`CheckpointCorruptError` naming ``where``.

        Unknown keys are ignored, so a newer writer's extra fields do not break an
        older reader; a different ``format`` is refused.
        """
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise ValueError(f"expected a JSON object, got {type(d).__name__}")
            fmt = d.get("format")
            if fmt != FORMAT:
                raise ValueError(f"format {fmt!r}, expected {FORMAT!r}")
            files = {str(k): FileEntry(size=int(v["size"]), checksum=str(v["checksum"]))
                     for k, v in d["files"].items()}
            known = {f for f in cls.__dataclass_fields__} - {"files"}
            kwargs = {k: v for k, v in d.items() if k in known}
            return cls(files=files, **kwargs)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(f"{where}: manifest does not parse: {e}") from e
