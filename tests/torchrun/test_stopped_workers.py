"""The launcher's agent resumes a stopped worker before it ends it: torch's agent sent
its death signal to a SIGSTOPped worker, which could not act on it, and waited its
fixed 30 s before SIGKILL (a multi-node job's next round waited with it)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.api import PContext

from elastic_kit.health import install_resume_stopped, resume_stopped_workers

pytestmark = pytest.mark.timeout(120)


def _stopped_worker(start_method: str, log_dir: str) -> PContext:
    if start_method == "subprocess":
        entrypoint: Any = sys.executable
        args: dict[int, tuple[Any, ...]] = {0: ("-c", "import time; time.sleep(60)")}
    else:
        entrypoint, args = time.sleep, {0: (60,)}
    pc = start_processes("stopped", entrypoint, args, envs={0: {}},
                         logs_specs=DefaultLogsSpecs(log_dir=log_dir),
                         start_method="spawn")
    (pid,) = pc.pids().values()
    os.kill(pid, signal.SIGSTOP)
    for _ in range(200):  # until the kernel says it is stopped
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.01)
    else:
        raise AssertionError(f"worker {pid} did not stop")
    return pc


def _exit_signal(pc: PContext) -> int:
    if hasattr(pc, "subprocess_handlers"):
        return -pc.subprocess_handlers[0].proc.returncode
    return -pc._pc.processes[0].exitcode  # type: ignore[attr-defined]


@pytest.mark.parametrize("start_method", ["subprocess", "multiprocessing"])
def test_a_stopped_worker_takes_the_agents_death_signal(start_method: str) -> None:
    assert install_resume_stopped() and install_resume_stopped()  # idempotent
    with tempfile.TemporaryDirectory() as log_dir:
        pc = _stopped_worker(start_method, log_dir)
        pc.close(death_sig=signal.SIGTERM, timeout=30)
        # ended by the SIGTERM it was sent, not by the SIGKILL after the grace
        assert _exit_signal(pc) == signal.SIGTERM


def test_resume_reaches_a_worker_gone_already_without_error() -> None:
    with tempfile.TemporaryDirectory() as log_dir:
        pc = _stopped_worker("subprocess", log_dir)
        (pid,) = pc.pids().values()
        assert resume_stopped_workers(pc) == [pid]
        pc.close(death_sig=signal.SIGKILL, timeout=5)
        assert resume_stopped_workers(pc) == []
