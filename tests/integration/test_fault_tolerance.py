"""Faults under real torchrun: preemption (SIGTERM) and a crash in the middle of a save.

(A SIGKILLed worker at a fixed world size is scenario 1 in test_example_scenarios.py,
on the real example.)

Each scenario waits for an observable event (a committed checkpoint, a rendezvous
line) before injecting the fault, then asserts on the run's summary and logs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.integration.conftest import EPOCHS, Reference
from tests.integration.harness import Job, assert_audit_ok, world_size_sequence
from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.integration


def test_sigterm_preemption_saves_current_step_and_loses_none(new_job: Callable[..., Job],
                                                             reference_run: Reference) -> None:
    """Scenario 6: SIGTERM to one agent of two (a preemption notice).

    Periodic checkpoints are off (every 1000 steps), so the only mid-run checkpoint is
    the one the workers write when SIGTERM arrives; the survivor must resume exactly
    from it (no step lost) and finish alone.
    """
    job = new_job(nnodes="1:2", max_restarts=3, checkpoint_every=1000)
    job.cluster.add_agent()
    preempted = job.cluster.add_agent()
    job.wait_for_world_size(2)
    job.wait_for_log(r"EKW step=3 world_size=2")
    # A late joiner may have caused a scale-up restart (and its save) already.
    saved_before = len(re.findall(r"EKW preempted: saved step", job.all_logs()))
    steps_before = set(job.committed_steps())
    job.cluster.terminate_agent(preempted)

    summary = job.finish([0, None])
    saved = [int(m) for m in re.findall(r"EKW preempted: saved step (\d+)", job.all_logs())]
    assert len(saved) > saved_before, f"no preemption save in the logs\n{job.all_logs()[-5000:]}"
    new_mid_run = [s for s in job.committed_steps()
                   if s not in steps_before and 0 < s < summary["steps"]]
    assert new_mid_run == [saved[-1]], (
        f"checkpoints {job.committed_steps()}, preemption saved {saved[saved_before:]}")
    last = summary["world_sizes"][-1]
    assert last["world_size"] == 1 and last["restored_step"] == saved[-1], (
        f"resumed as {last}, the preemption saved step {saved[-1]}: steps were lost")
    assert world_size_sequence(summary)[-2:] == [2, 1]
    assert_audit_ok(summary, EPOCHS)
    assert summary["steps"] == reference_run.summary["steps"]


@pytest.mark.s3
def test_crash_during_s3_checkpoint_write_resumes_from_previous(
        new_job: Callable[..., Job], reference_run: Reference, s3_bucket: tuple[str, dict[str, Any]],
        tmp_path: Path) -> None:
    """Scenario 7: rank 0 dies after writing a checkpoint's payload to S3, before its manifest.

    The half-written checkpoint must be ignored: the group resumes from the previous
    committed one, and at a fixed world size ends bitwise where the reference does.
    """
    url, options = s3_bucket
    endpoint = options["client_kwargs"]["endpoint_url"]
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
           "FSSPEC_S3_ENDPOINT_URL": endpoint}
    job = new_job(nnodes="2", max_restarts=3, checkpoint_dir=f"{url}/run", env=env,
                  extra=["--crash-in-save-at-step", "6",
                         "--crash-marker", str(tmp_path / "crashed")])
    job.cluster.add_agent()
    job.cluster.add_agent()

    summary = job.finish([0, 0])
    logs = job.all_logs()
    assert "EKW crash injected in save of step 6" in logs, logs[-5000:]
    assert len(summary["world_sizes"]) >= 2, summary["world_sizes"]
    assert summary["restored_steps"][0] == 4, (
        f"after the crash in the save of step 6 the job resumed from {summary['restored_steps']}")
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    objects = fs.find(f"{url}/run")
    assert any(o.endswith("step-00000006/manifest.json") for o in objects), objects
    assert_audit_ok(summary, EPOCHS)
    assert summary["param_sha256"] == reference_run.summary["param_sha256"]
