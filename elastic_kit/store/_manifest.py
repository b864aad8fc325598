"""The manifest: the file that turns a directory of bytes into a checkpoint.

``manifest.json`` is written last. It records what the payload must look like
(every file with its size and checksum, and which of them is the payload that
``torch.load`` reads) and where it came from (step, world size, library and torch
versions, wall time, the caller's metadata, an id of the store that wrote it). A
directory without a manifest that parses, or whose files do not match it, is not a
checkpoint.

A manifest is input from storage, which anyone with write access may have edited:
:meth:`Manifest.from_json` validates every field (types, ranges, plain file names
inside the step directory) and turns anything malformed into
:class:`CheckpointCorruptError`, never into an ``OverflowError``, a
``RecursionError`` or a path outside the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from elastic_kit._version import __version__
from elastic_kit.errors import CheckpointCorruptError

__all__ = ["MANIFEST_NAME", "PAYLOAD_NAME", "FORMAT", "SHARDED_FORMAT", "CHECKSUMS", "MAX_MANIFEST_BYTES",
           "FileEntry", "Manifest", "check_file_name"]

MANIFEST_NAME = "manifest.json"
#: The payload's name on a first save; a re-save of a committed step writes its new
#: payload beside the old one under another name (see ``_layout``).
PAYLOAD_NAME = "state.pt"
#: Bumped when the layout changes incompatibly; readers refuse other formats.
FORMAT = "elastic_kit.checkpoint/1"
#: The format of a sharded checkpoint (one replicated payload plus tensor files of
#: shards, indexed by ``sharded``): a reader that knows only :data:`FORMAT` refuses it
#: rather than loading the payload's placeholders as if they were the state.
SHARDED_FORMAT = "elastic_kit.checkpoint/1+sharded"
CHECKSUMS = ("xxh3_128", "crc32", "sha256")
_DIGEST_LEN = {"xxh3_128": 32, "crc32": 8, "sha256": 64}
#: The largest manifest read (or written). A replicated checkpoint's is a few KB; a
#: sharded one lists every chunk, ~280 bytes each: 55k chunks (an 8 B-parameter model
#: with AdamW at 64 ranks) take 15 MiB, and the index's most chunks about 1.2 GiB.
MAX_MANIFEST_BYTES = 1536 << 20
_MAX_FILES = 1 << 16  # a sharded checkpoint has a file per writing rank
_MAX_STEP = 10**12 - 1  # 12 digits: the directory name must stay canonical
_MAX_SIZE = 1 << 62
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", re.ASCII)
_HEX_RE = re.compile(r"[0-9a-f]+", re.ASCII)


#: torchrun's ``--rdzv-id`` when none is given.
_NO_RUN_ID = "none"


def run_id() -> str:
    """The torchrun run this process belongs to (``TORCHELASTIC_RUN_ID``): every worker
    group of one job shares it, two jobs do not. "" outside torchrun, and for
    torchrun's default ``--rdzv-id`` (``none``), which every launch without one shares
    (a static ``--master-addr`` launch of any job): it tells no two jobs apart."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return "" if run == _NO_RUN_ID else run


def _library_version() -> str:
    return str(__version__)


def check_file_name(name: Any) -> str:
    """``name`` if it is a plain file name inside a step directory, else ValueError.

    Plain means ASCII letters, digits, ``._-``, no leading dot, no ``..``, no
    separator: a manifest can then only ever name files the store could have
    written, never ``../../etc/shadow`` or an absolute path.
    """
    if (not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name
            or name == MANIFEST_NAME):
        raise ValueError(f"file name {name!r} is not a plain file name inside the step "
                         f"directory (expected [A-Za-z0-9_][A-Za-z0-9._-]*, no '..')")
    return name


def _int(d: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = d[key]
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{key}={v!r:.60} must be an int in [{lo}, {hi}]")
    return v


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
        files: file name (relative to the step directory) -> :class:`FileEntry`;
            every file a reader opens is listed here.
        payload: the file of ``files`` that ``torch.load`` reads (``state.pt`` unless
            the step was saved again, see ``_layout``).
        checksum: the algorithm of every file's checksum: ``"xxh3_128"``, ``"crc32"``
            or ``"sha256"`` (a manifest without the field is crc32).
        metadata: the caller's JSON-able metadata (``{"epoch": 3, ...}``).
        epoch: ``metadata["epoch"]`` when given, for quick listing.
        world_size: the world size of the job that saved it.
        time: wall time of the commit (seconds since the epoch).
        writer: a random id of the store object that wrote it (two jobs writing one
            URL are told apart by it).
        run: the torchrun run id of the process that wrote it ("" outside torchrun):
            a late commit by a process of an earlier worker group of the same run is
            told from another job's.
        sharded: for sharded state, the index of its shards
            (:class:`~elastic_kit.store._shard_index.ShardIndex`); None otherwise.
    """

    step: int
    files: dict[str, FileEntry]
    payload: str = PAYLOAD_NAME
    checksum: str = "crc32"
    metadata: dict[str, Any] = field(default_factory=dict)
    epoch: int | None = None
    world_size: int = 1
    time: float = field(default_factory=time.time)
    writer: str = ""
    run: str = field(default_factory=run_id)
    format: str = FORMAT
    elastic_kit_version: str = field(default_factory=_library_version)
    torch_version: str = field(default_factory=lambda: str(torch.__version__))
    python_version: str = field(default_factory=platform.python_version)
    sharded: Any = None

    def __post_init__(self) -> None:
        if self.sharded is not None:
            self.format = SHARDED_FORMAT
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"checksum={self.checksum!r} must be one of {CHECKSUMS}")
        if type(self.step) is not int or not 0 <= self.step <= _MAX_STEP:
            raise ValueError(f"step={self.step!r} must be an int in [0, {_MAX_STEP}]")
        for name in self.files:
            check_file_name(name)
        if self.payload not in self.files:
            raise ValueError(f"payload {self.payload!r} is not among the listed files "
                             f"{sorted(self.files)}")

    @property
    def size_bytes(self) -> int:
        """Total payload size."""
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        """The manifest as JSON: pretty (humans read it when debugging a store), or
        compact with a shard index (an entry per chunk: a pretty one is three times
        the size).

        Raises:
            ValueError: the text would exceed :data:`MAX_MANIFEST_BYTES` (metadata
                far beyond a small dict): no reader would ever load it.
        """
        # every field but the shard index, which has its own form (asdict would copy
        # it, a dict per chunk, only for that copy to be replaced)
        d = asdict(replace(self, sharded=None))
        if self.sharded is None:
            del d["sharded"]  # a replicated checkpoint's manifest is as it always was
            text = json.dumps(d, indent=2, sort_keys=True, default=str)
        else:
            d["sharded"] = self.sharded.to_json()
            text = json.dumps(d, sort_keys=True, default=str, separators=(",", ":"))
        if len(text) > MAX_MANIFEST_BYTES:
            raise ValueError(
                f"the manifest of checkpoint step {self.step} would be {len(text)} bytes, "
                f"more than the {MAX_MANIFEST_BYTES} a manifest may have (no load would "
                f"read it): keep metadata to a small JSON-able dict "
                f"({len(json.dumps(self.metadata, default=str))} bytes here)")
        return text

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "") -> Manifest:
        """Parse and validate a manifest; :class:`CheckpointCorruptError` naming ``where``.

        Unknown keys are ignored, so a newer writer's extra fields do not break an
        older reader; a different ``format`` is refused. Every known field is checked
        for type and range, so that nothing malformed escapes as another exception.
        """
        try:
            if len(text) > MAX_MANIFEST_BYTES:
                raise ValueError(f"{len(text)} bytes, more than {MAX_MANIFEST_BYTES}")
            d = json.loads(text)
            return cls._from_dict(d)
        except RecursionError:
            raise CheckpointCorruptError(
                f"{where}: manifest does not parse: JSON nested too deeply") from None
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError,
                UnicodeDecodeError) as e:
            raise CheckpointCorruptError(f"{where}: manifest does not parse: {e}") from e

    @classmethod
    def _from_dict(cls, d: Any) -> Manifest:
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        fmt = d.get("format")
        if fmt not in (FORMAT, SHARDED_FORMAT):
            raise ValueError(f"format {fmt!r:.60}, expected {FORMAT!r} or {SHARDED_FORMAT!r}")
        if (fmt == SHARDED_FORMAT) != (d.get("sharded") is not None):
            raise ValueError(f"format {fmt!r} with{'out' if fmt == SHARDED_FORMAT else ''} "
                             f"a sharded index")
        checksum = d.get("checksum", "crc32")
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum={checksum!r:.60} must be one of {CHECKSUMS}")
        raw_files = d["files"]
        if not isinstance(raw_files, dict) or not 1 <= len(raw_files) <= _MAX_FILES:
            raise ValueError(f"files must be an object of 1 to {_MAX_FILES} entries, got "
                             f"{raw_files!r:.60}")
        files = {}
        for name, v in raw_files.items():
            check_file_name(name)
            if not isinstance(v, dict):
                raise ValueError(f"files[{name!r}] must be an object, got {v!r:.60}")
            size = _int(v, "size", 0, _MAX_SIZE)
            digest = v["checksum"]
            if (not isinstance(digest, str) or len(digest) != _DIGEST_LEN[checksum]
                    or not _HEX_RE.fullmatch(digest)):
                raise ValueError(f"files[{name!r}].checksum={digest!r:.80} is not a "
                                 f"{checksum} hex digest")
            files[name] = FileEntry(size=size, checksum=digest)
        payload = d.get("payload", PAYLOAD_NAME)
        if payload not in files:
            raise ValueError(f"payload {payload!r:.60} is not among the listed files "
                             f"{sorted(files)}: its bytes would be unverified")
        step = _int(d, "step", 0, _MAX_STEP)
        world_size = _int(d, "world_size", 1, 1 << 31) if "world_size" in d else 1
        epoch = d.get("epoch")
        if epoch is not None and (type(epoch) is not int or epoch < 0):
            raise ValueError(f"epoch={epoch!r:.60} must be an int >= 0 or null")
        metadata = d.get("metadata", {})
        if not isinstance(metadata, dict):
            raise ValueError(f"metadata must be an object, got {metadata!r:.60}")
        t = d.get("time", 0.0)
        if type(t) not in (int, float) or not math.isfinite(t):
            raise ValueError(f"time={t!r:.60} must be a finite number")
        strings = {}
        for key in ("writer", "run", "elastic_kit_version", "torch_version",
                    "python_version"):
            if key in d:
                if not isinstance(d[key], str):
                    raise ValueError(f"{key}={d[key]!r:.60} must be a string")
                strings[key] = d[key]
        sharded = None
        if d.get("sharded") is not None:
            from elastic_kit.store._shard_index import ShardIndex  # imports _serialize

            sharded = ShardIndex.from_json(d["sharded"], checksum=checksum,
                                           files={n: e.size for n, e in files.items()})
        return cls(step=step, files=files, payload=payload, checksum=checksum,
                   metadata=metadata, epoch=epoch, world_size=world_size, time=float(t),
                   sharded=sharded, **strings)
