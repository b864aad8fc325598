"""Faults under real torchrun: preemption (SIGTERM) and a crash in the middle of a save.

(A SIGKILLed worker at a fixed world size is scenario 1 in test_example_scenarios.py,
on the real example.)

Both run ``tests/train_script.py``, a training script built on the library's ``ElasticLoop``,
``CheckpointStore`` and sampler, so what is tested is the library's behaviour: the
loop's SIGTERM handling (agree across ranks, blocking checkpoint, exit 143) and the
store's commit protocol (the manifest is written last; a step directory without one
is skipped on load). The preemption is sent while every rank waits at the test's hold
point, so it lands mid-run however loaded the machine is; the assertions are on the
run's summary, the committed checkpoints and the steps and exit codes the workers
report, not on log wording.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.torchrun.scenarios.conftest import EPOCHS, Reference
from tests.torchrun.scenarios.harness import Hold, Job, assert_audit_ok, world_size_sequence
from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.integration


def test_sigterm_preemption_saves_current_step_and_loses_none(new_job: Callable[..., Job],
                                                             reference_run: Reference) -> None:
    """Scenario 6: SIGTERM to one agent of two (a preemption notice).

    Periodic and epoch-end checkpoints are off (every 1000 steps, --no-epoch-checkpoints),
    so the only mid-run checkpoints are the ones the loop writes on SIGTERM. Both ranks
    of the 2-node group wait at the end of step 3 (the test's hold point) while the
    preempted agent is sent SIGTERM, which torchrun forwards to its worker: every rank
    agrees to stop after the current step, the store saves it, every worker leaves
    ``ElasticLoop.run`` with the loop's exit code 143, and the survivor resumes alone
    exactly from that checkpoint (no step lost).
    """
    job = new_job(nnodes="1:2", max_restarts=3, checkpoint_every=1000,
                  extra=["--no-epoch-checkpoints"], hold=Hold(at_step=3, world_size=2))
    job.cluster.add_agent()
    preempted = job.cluster.add_agent()
    held_at = job.wait_until_held(2)
    # A late joiner may have caused a scale-up restart (and its SIGTERM save) already.
    steps_before = set(job.committed_steps())
    job.cluster.terminate_agent(preempted)
    job.wait_for_sigterm_at_hold()  # the preempted worker has the signal: training may go on
    job.release()

    summary = job.finish([0, None])
    # Every rank of the preempted group stopped at the same step, with the loop's code.
    stops = [e for e in job.events()
             if e["event"] == "exit" and e["world_size"] == 2 and e["step"] >= held_at]
    assert sorted(e["rank"] for e in stops) == [0, 1], stops
    assert {e["code"] for e in stops} == {143}, stops
    assert len({e["step"] for e in stops}) == 1, stops
    stopped_at = stops[0]["step"]
    assert stopped_at > held_at, f"stopped at {stopped_at}, before the SIGTERM at {held_at}"
    # That step is the one new mid-run checkpoint, written by the 2-rank group ...
    new_mid_run = [s for s in job.committed_steps()
                   if s not in steps_before and 0 < s < summary["steps"]]
    assert new_mid_run == [stopped_at], (job.committed_steps(), stops)
    assert job.manifest(stopped_at)["world_size"] == 2
    # ... and the survivor, alone, resumed exactly from it.
    last = summary["world_sizes"][-1]
    assert last["world_size"] == 1 and last["restored_step"] == stopped_at, (
        f"resumed as {last}, the preemption stopped at step {stopped_at}: steps were lost")
    assert world_size_sequence(summary)[-2:] == [2, 1]
    assert_audit_ok(summary, EPOCHS)
    assert summary["steps"] == reference_run.summary["steps"]


def test_ctrl_c_to_torchrun_saves_the_current_step_for_a_relaunch(
        new_job: Callable[..., Job]) -> None:
    """Ctrl-C on a torchrun job: the agent passes SIGINT on to its workers and ends the
    job. The workers save the current step durably (as on SIGTERM) instead of dying
    of KeyboardInterrupt with only a memory snapshot that a relaunch under a new run
    id never reads, and the relaunch resumes from that step."""
    import signal

    job = new_job("interrupted", nnodes="1", max_restarts=3, checkpoint_every=1000,
                  extra=["--no-epoch-checkpoints"], hold=Hold(at_step=3))
    agent = job.cluster.add_agent()
    held_at = job.wait_until_held(1)
    agent.proc.send_signal(signal.SIGINT)
    job.wait_for_sigterm_at_hold()
    job.release()
    assert job.cluster.wait(120)[0] not in (0, None)  # interrupted: torchrun does not restart
    (stop,) = [e for e in job.events() if e["event"] == "exit"]
    assert stop["code"] == 143 and stop["step"] >= held_at, stop
    assert job.committed_steps() == [stop["step"]], job.all_logs()[-5000:]

    again = new_job("relaunched", nnodes="1", max_restarts=0,
                    checkpoint_dir=str(job.checkpoint_dir))
    again.cluster.add_agent()
    summary = again.finish([0])
    assert summary["restored_steps"][0] == stop["step"], summary["restored_steps"]


@pytest.mark.s3
def test_crash_during_s3_checkpoint_write_resumes_from_previous(
        new_job: Callable[..., Job], reference_run: Reference, s3_bucket: tuple[str, dict[str, Any]],
        tmp_path: Path) -> None:
    """Scenario 7: rank 0 dies inside the store's S3 write of step 6, after the payload
    is uploaded and before the manifest (the worker's store writes through a
    ``FaultFileSystem`` whose rule ends the process on the PUT of step 6's manifest).

    The half-written checkpoint must be skipped on load: the group resumes from the
    previous committed one (step 4), later commits step 6 for real, and at a fixed
    world size ends bitwise where the reference does. In-memory snapshots are off: this
    is about the durable store (with them, the restart resumes from a newer snapshot).
    """
    import json

    from elastic_kit.store import CheckpointStore

    url, options = s3_bucket
    run_url = f"{url}/run"
    job = new_job(nnodes="2", max_restarts=3, checkpoint_dir=run_url,
                  extra=["--storage-options", json.dumps(options),
                         "--crash-in-save-at-step", "6",
                         "--crash-marker", str(tmp_path / "crashed"),
                         "--snapshot-every", "0"])
    job.cluster.add_agent()
    job.cluster.add_agent()

    summary = job.finish([0, 0])
    # The writer died inside the save of step 6 (the marker is written right before),
    # leaving its payload without a manifest; the restore skipped it for step 4.
    assert (tmp_path / "crashed").exists(), job.all_logs()[-5000:]
    assert len(summary["world_sizes"]) >= 2, summary["world_sizes"]
    assert summary["restored_steps"][0] == 4, (
        f"after the crash in the save of step 6 the job resumed from {summary['restored_steps']}")
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    objects = fs.find(run_url)
    # step 6 was saved again later, for real: committed (a step-<n> directory with a manifest)
    assert any(re.search(r"/step-0*6/manifest\.json$", o) for o in objects), objects
    # Afterwards every step directory is a complete, verifying checkpoint.
    with CheckpointStore(run_url, storage_options=options) as store:
        problems = [(s, p) for s, _, p in store.verify(deep=True) if p is not None]
        steps = [i.step for i in store.list()]
    assert not problems, problems
    assert 6 in steps and summary["steps"] in steps, steps
    assert_audit_ok(summary, EPOCHS)
    assert summary["steps"] == reference_run.summary["steps"]
    assert summary["param_sha256"] == reference_run.summary["param_sha256"]
