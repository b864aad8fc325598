"""The unit tier starts no process: each test here fails if it starts one.

The tier is what a developer runs after every edit (``scripts/test tests/unit``), so it
must stay fast and free of the waits a process brings (interpreter start, torch
import, rendezvous). A test that needs a child process, a data-loader worker or a
server belongs in ``tests/multiprocess``, ``tests/torchrun`` or ``tests/tooling``.
Library lookups that run a helper binary (``ctypes.util.find_library`` runs
``ldconfig``) are not the test's own processes and are let through.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

#: Binaries a library may run for itself while a unit test runs.
_LIBRARY_HELPERS = frozenset({"ldconfig", "uname", "gcc", "cc", "ld", "objdump"})


@pytest.fixture(autouse=True)
def _no_process_starts(request: pytest.FixtureRequest,
                       monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    where = request.node.nodeid

    def refuse(what: str) -> None:
        raise AssertionError(f"{where} started a process ({what}): unit tests start none; "
                             f"move it to tests/multiprocess, tests/torchrun or tests/tooling")

    real_init = subprocess.Popen.__init__

    def popen_init(self: subprocess.Popen, args: Any, *a: Any, **k: Any) -> None:
        argv = args if isinstance(args, (list, tuple)) else str(args).split()
        if argv and os.path.basename(str(argv[0])) in _LIBRARY_HELPERS:
            real_init(self, args, *a, **k)
            return
        refuse(f"subprocess {argv[:3]}")

    def process_start(self: multiprocessing.process.BaseProcess) -> None:
        refuse(f"multiprocessing {type(self).__name__}")

    def fork() -> int:
        refuse("os.fork")
        return -1

    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", process_start)
    monkeypatch.setattr(os, "fork", fork)
    yield


@pytest.fixture()
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A snapshot root of the test's own (``$ELASTIC_KIT_SNAPSHOT_DIR``), this process
    one node (``node0``)."""
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_DIR", str(root))
    monkeypatch.setenv("ELASTIC_KIT_SNAPSHOT_NODE", "node0")
    return str(root)
