"""Fixtures for the real-torchrun integration scenarios.

Every cluster a test creates is closed by a finalizer (agents, workers and orphans are
killed) even when the test fails, and every test gets fresh rendezvous ids and ports.
The uninterrupted reference run (``tests/train_script.py`` on two nodes: the library's loop,
sampler and checkpoint store, no fault, no resize) is computed once per session and
shared.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

# The scenarios import ``tests.torchrun.scenarios.harness`` and ``tests.s3_server``: make the
# repository root importable also under a bare ``pytest`` (which, unlike
# ``python -m pytest``, does not put the working directory on sys.path).
_REPO = str(Path(__file__).resolve().parents[3])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from elastic_kit.testing import EtcdServer  # noqa: E402
from tests.torchrun.scenarios.harness import (  # noqa: E402
    Job, TrainingScript, make_job, run_fault_free, worker_script,
)

EPOCHS = 4


@dataclass(frozen=True)
class Reference:
    """The never-interrupted, never-resized run every scenario compares against."""

    summary: dict[str, Any]
    final_path: Path
    root: Path


@pytest.fixture(scope="session")
def training_script() -> TrainingScript:
    """The script every scenario launches."""
    return worker_script(epochs=EPOCHS)


@pytest.fixture
def new_job(tmp_path: Path, training_script: TrainingScript) -> Iterator[Callable[..., Job]]:
    """``new_job(name, nnodes=..., ...)`` -> a :class:`Job` that is always cleaned up."""
    jobs: list[Job] = []

    def factory(name: str = "job", **kwargs: Any) -> Job:
        script = kwargs.pop("script", training_script)
        job = make_job(tmp_path / name, script, **kwargs)
        jobs.append(job)
        return job

    yield factory
    for job in jobs:
        job.cluster.close()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory,
                  training_script: TrainingScript) -> Iterator[Reference]:
    """Two nodes, no fault: the trajectory the fault scenarios must reproduce."""
    root = tmp_path_factory.mktemp("reference")
    job, summary = run_fault_free(root, training_script, epochs=EPOCHS)
    yield Reference(summary, job.final_path, root)


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd (v2 API) on free loopback ports; skipped when etcd is not installed."""
    import shutil

    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    server = EtcdServer(log_path=tmp_path / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
