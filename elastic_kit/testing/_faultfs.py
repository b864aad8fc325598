"""A fault-injecting fsspec filesystem: storage that fails on purpose, for tests.

:class:`FaultFileSystem` wraps a real filesystem (local, ``memory://``, ``s3://`` on a
moto server) and forwards every call to it, except where a :class:`Fault` rule says
otherwise: raise an error (a 403, a 503, a dropped connection, a full disk) on the
n-th matching call, or after so many bytes of a read or write stream, or run a
callback first (to interleave another process's work at an exact moment). Code
under test sees a normal fsspec filesystem and reacts to real exceptions; nothing
in it is patched.

Example::

    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("read", match="state.pt", error=ConnectionResetError(104, "reset"), times=2)
    store = CheckpointStore(str(tmp_path / "ck"), filesystem=ffs)
    store.load()                      # the first two payload reads are cut off
    assert ffs.fired("read") == 2

Operations a rule can name: ``"ls"``, ``"info"``, ``"cat"`` (``cat_file``),
``"pipe"`` (``pipe_file``), ``"open"`` (any mode; narrow with ``mode="rb"``),
``"read"`` and ``"write"`` (on the file objects ``open`` returns, with
``after_bytes``), ``"close"`` (of those file objects: an object store completes an
upload there, and a failed one leaves nothing), ``"rm"`` (``rm_file`` and ``rm``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from fsspec import AbstractFileSystem

__all__ = ["FaultFileSystem", "Fault"]

_OPS = ("ls", "info", "cat", "pipe", "open", "read", "write", "close", "rm")


@dataclass
class Fault:
    """One rule: on calls of ``op`` whose path contains ``match``, misbehave.

    Attributes:
        op: the operation (see the module docstring).
        match: a substring of the path (``""``: every path).
        error: raised when the rule fires (None: only ``before`` runs).
        times: how often it fires (None: every time).
        skip: matching calls to let through first.
        after_bytes: for ``read``/``write``: bytes passed through before it fires.
        mode: for ``open``: only files opened in this mode (``"rb"``, ``"wb"``).
        before: called (with the path) when the rule fires, before the error.
        fired: how often it fired so far.
    """

    op: str
    match: str = ""
    error: BaseException | None = None
    times: int | None = 1
    skip: int = 0
    after_bytes: int = 0
    mode: str | None = None
    before: Callable[[str], Any] | None = None
    fired: int = 0
    _seen: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"op={self.op!r} must be one of {_OPS}")


class _FaultFile:
    """A file object of the target filesystem whose reads/writes obey the rules."""

    def __init__(self, ffs: FaultFileSystem, path: str, inner: Any) -> None:
        self._ffs, self._path, self._inner = ffs, path, inner
        self._bytes = {"read": 0, "write": 0}

    def _room(self, op: str) -> int | None:
        """Bytes that may still pass before a rule fires now (None: no rule)."""
        rule = self._ffs._rule(op, self._path, stream=True)
        if rule is None:
            return None
        room = rule.after_bytes - self._bytes[op]
        if room <= 0:
            self._ffs._fire(rule, self._path)
            return None  # a rule with only ``before`` lets the call through
        return room

    def read(self, n: int = -1) -> bytes:
        room = self._room("read")
        if room is not None and (n is None or n < 0 or n > room):
            n = room
        data = self._inner.read(n)
        self._bytes["read"] += len(data)
        return bytes(data)

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        done = 0
        while done < mv.nbytes:
            room = self._room("write")
            part = mv[done:] if room is None else mv[done:done + room]
            self._inner.write(part)
            self._bytes["write"] += part.nbytes
            done += part.nbytes
        return mv.nbytes

    def close(self) -> None:
        if not self.closed:
            # before the target's close: an upload that fails there lands nothing
            self._ffs._check("close", self._path)
        self._inner.close()

    def discard(self) -> None:
        discard = getattr(self._inner, "discard", None)
        if callable(discard):
            discard()

    @property
    def closed(self) -> bool:
        return bool(self._inner.closed)

    @closed.setter
    def closed(self, value: bool) -> None:
        self._inner.closed = value

    def __enter__(self) -> _FaultFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FaultFileSystem(AbstractFileSystem):
    """Forwards to ``target``; :meth:`add` rules make chosen calls fail.

    Args:
        target: the real filesystem whose files the code under test reads and writes.
    """

    protocol = "ekfault"
    cachable = False

    def __init__(self, target: AbstractFileSystem, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target
        self.rules: list[Fault] = []
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ rules
    def add(self, op: str, *, match: str = "", error: BaseException | None = None,
            times: int | None = 1, skip: int = 0, after_bytes: int = 0,
            mode: str | None = None, before: Callable[[str], Any] | None = None) -> Fault:
        """Add a rule (see :class:`Fault`) and return it."""
        rule = Fault(op, match, error, times, skip, after_bytes, mode, before)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule (calls go straight to the target again)."""
        with self._lock:
            self.rules.clear()

    def fired(self, op: str | None = None) -> int:
        """How often rules (of ``op``) fired."""
        return sum(r.fired for r in self.rules if op is None or r.op == op)

    def _rule(self, op: str, path: str, *, mode: str | None = None,
              stream: bool = False) -> Fault | None:
        with self._lock:
            if not stream:
                self.calls.append((op, path))
            for r in self.rules:
                if r.op != op or r.match not in path or (r.times is not None and r.fired >= r.times):
                    continue
                if r.mode is not None and mode is not None and r.mode != mode:
                    continue
                if not stream:
                    r._seen += 1
                    if r._seen <= r.skip:
                        continue
                return r
        return None

    def _fire(self, rule: Fault, path: str) -> None:
        with self._lock:
            rule.fired += 1
        if rule.before is not None:
            rule.before(path)
        if rule.error is not None:
            raise rule.error

    def _check(self, op: str, path: str, mode: str | None = None) -> None:
        rule = self._rule(op, path, mode=mode)
        if rule is not None:
            self._fire(rule, path)

    # ------------------------------------------------------------------ forwarding
    @property
    def fsid(self) -> str:
        return f"ekfault-{id(self)}"

    def ls(self, path: str, detail: bool = True, **kw: Any) -> Any:
        self._check("ls", path)
        return self.target.ls(path, detail=detail, **kw)

    def info(self, path: str, **kw: Any) -> dict[str, Any]:
        self._check("info", path)
        return self.target.info(path, **kw)

    def exists(self, path: str, **kw: Any) -> bool:
        self._check("info", path)
        return bool(self.target.exists(path, **kw))

    def isdir(self, path: str) -> bool:
        self._check("info", path)
        return bool(self.target.isdir(path))

    def isfile(self, path: str) -> bool:
        self._check("info", path)
        return bool(self.target.isfile(path))

    def find(self, path: str, **kw: Any) -> Any:
        self._check("ls", path)
        return self.target.find(path, **kw)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kw: Any) -> bytes:
        self._check("cat", path)
        return bytes(self.target.cat_file(path, start=start, end=end, **kw))

    def pipe_file(self, path: str, value: bytes, **kw: Any) -> None:
        self._check("pipe", path)
        self.target.pipe_file(path, value, **kw)

    def open(self, path: str, mode: str = "rb", **kw: Any) -> Any:  # type: ignore[override]
        self._check("open", path, mode=mode)
        return _FaultFile(self, path, self.target.open(path, mode, **kw))

    def rm_file(self, path: str) -> None:
        self._check("rm", path)
        self.target.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._check("rm", str(path))
        self.target.rm(path, recursive=recursive, maxdepth=maxdepth)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kw: Any) -> None:
        self.target.mkdir(path, create_parents=create_parents, **kw)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.target.invalidate_cache(path)

    def _strip_protocol(self, path: str) -> str:  # type: ignore[override]
        if path.startswith("ekfault://"):
            path = path[len("ekfault://"):]
        return str(self.target._strip_protocol(path))
