"""Faults under real torchrun: preemption (SIGTERM) and a crash in the middle of a save.

(A SIGKILLed worker at a fixed world size is scenario 1 in test_example_scenarios.py,
on the real example.)

Both run ``_worker.py``, a training script built on the library's ``ElasticLoop``,
``CheckpointStore`` and sampler, so what is tested is the library's behaviour: the
loop's SIGTERM handling (agree across ranks, blocking checkpoint, exit 143) and the
store's commit protocol (the manifest is written last; a step directory without one
is skipped on load). Each scenario waits for an observable event (a committed
checkpoint, a log line) before injecting the fault, then asserts on the run's summary
and logs.
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

#: The loop's log line (rank 0) after its SIGTERM checkpoint is committed.
SIGTERM_SAVED = r"stop requested \(SIGTERM\): saved step (\d+)"


def test_sigterm_preemption_saves_current_step_and_loses_none(new_job: Callable[..., Job],
                                                             reference_run: Reference) -> None:
    """Scenario 6: SIGTERM to one agent of two (a preemption notice).

    Periodic and epoch-end checkpoints are off (every 1000 steps, --no-epoch-checkpoints),
    so the only mid-run checkpoint is the one the loop writes when the SIGTERM that
    torchrun forwards to the preempted node's worker arrives: every rank agrees to
    stop after the current step, the store saves it (blocking), every worker exits
    143, and the survivor must resume exactly from it (no step lost) and finish alone.
    """
    job = new_job(nnodes="1:2", max_restarts=3, checkpoint_every=1000,
                  extra=["--no-epoch-checkpoints"])
    job.cluster.add_agent()
    preempted = job.cluster.add_agent()
    job.wait_for_world_size(2)
    job.wait_for_log(r"EKW step=3 world_size=2")
    # A late joiner may have caused a scale-up restart (and its SIGTERM save) already.
    saved_before = len(re.findall(SIGTERM_SAVED, job.all_logs()))
    steps_before = set(job.committed_steps())
    job.cluster.terminate_agent(preempted)

    summary = job.finish([0, None])
    saved = [int(m) for m in re.findall(SIGTERM_SAVED, job.all_logs())]
    assert len(saved) > saved_before, f"no preemption save in the logs\n{job.all_logs()[-5000:]}"
    assert saved[-1] > 3, f"the preemption checkpoint is of step {saved[-1]}, before the SIGTERM"
    new_mid_run = [s for s in job.committed_steps()
                   if s not in steps_before and 0 < s < summary["steps"]]
    assert new_mid_run == [saved[-1]], (
        f"checkpoints {job.committed_steps()}, preemption saved {saved[saved_before:]}")
    last = summary["world_sizes"][-1]
    assert last["world_size"] == 1 and last["restored_step"] == saved[-1], (
        f"resumed as {last}, the preemption saved step {saved[-1]}: steps were lost")
    assert world_size_sequence(summary)[-2:] == [2, 1]
    # The survivor's worker, never signalled itself, also stopped after the save and
    # exited with the loop's sigterm_exit_code, so its agent restarted the group.
    survivor_log = job.cluster.agents[0].read_log()
    assert re.search(r"failed \(exitcode: 143\)", survivor_log), survivor_log[-5000:]
    assert_audit_ok(summary, EPOCHS)
    assert summary["steps"] == reference_run.summary["steps"]


@pytest.mark.s3
def test_crash_during_s3_checkpoint_write_resumes_from_previous(
        new_job: Callable[..., Job], reference_run: Reference, s3_bucket: tuple[str, dict[str, Any]],
        tmp_path: Path) -> None:
    """Scenario 7: rank 0 dies inside the store's S3 write of step 6, after the payload
    is uploaded and before the manifest (the worker wraps ``Manifest.to_json``, which
    the real writer calls right before committing).

    The half-written checkpoint must be skipped on load: the group resumes from the
    previous committed one (step 4), later commits step 6 for real, and at a fixed
    world size ends bitwise where the reference does.
    """
    import json

    from elastic_kit.checkpoint import CheckpointStore, step_dir_name

    url, options = s3_bucket
    run_url = f"{url}/run"
    job = new_job(nnodes="2", max_restarts=3, checkpoint_dir=run_url,
                  extra=["--storage-options", json.dumps(options),
                         "--crash-in-save-at-step", "6",
                         "--crash-marker", str(tmp_path / "crashed")])
    job.cluster.add_agent()
    job.cluster.add_agent()

    summary = job.finish([0, 0])
    logs = job.all_logs()
    assert "EKW crash injected in save of step 6" in logs, logs[-5000:]
    assert (tmp_path / "crashed").exists()
    assert len(summary["world_sizes"]) >= 2, summary["world_sizes"]
    assert summary["restored_steps"][0] == 4, (
        f"after the crash in the save of step 6 the job resumed from {summary['restored_steps']}")
    # The store saw the uncommitted step-6 directory on restore and skipped it.
    partial = step_dir_name(6)
    assert re.search(rf"skipping checkpoint \S*{partial}", logs), (
        f"the restore did not report skipping the half-written {partial}\n{logs[-5000:]}")
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    objects = fs.find(run_url)
    assert any(o.endswith(f"{partial}/manifest.json") for o in objects), objects
    # Afterwards every step directory is a complete, verifying checkpoint.
    with CheckpointStore(run_url, storage_options=options) as store:
        problems = [(s, p) for s, _, p in store.verify(deep=True) if p is not None]
        steps = [i.step for i in store.list()]
    assert not problems, problems
    assert 6 in steps and summary["steps"] in steps, steps
    assert_audit_ok(summary, EPOCHS)
    assert summary["steps"] == reference_run.summary["steps"]
    assert summary["param_sha256"] == reference_run.summary["param_sha256"]
