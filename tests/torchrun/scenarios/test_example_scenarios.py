"""The headline scenarios again, on the real ImageNet example (``examples/imagenet/main.py``).

The other integration modules run the rest of the scenarios on ``tests/train_script.py``, a
tiny training script built on the same library pieces (seconds of training per run);
these two check that the shipped example, built on the library's loop, sampler and
checkpoint store (run through ``_hold.py``, so the fault is injected while every rank
waits at a chosen step), does the same under real torchrun:
a SIGKILLed worker is invisible in the final weights (bitwise), and losing a node
changes the final weights only by float summation order. Final weights come from
the newest committed checkpoint (the example checkpoints at every epoch end).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.torchrun.scenarios.conftest import Reference
from tests.torchrun.scenarios.harness import (
    EXAMPLE, Hold, Job, TrainingScript, assert_audit_ok, example_script, final_model_state,
    run_fault_free, segments_after_last,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not EXAMPLE.exists(), reason=f"{EXAMPLE} is missing"),
]

EPOCHS = 3
#: float32 tinycnn; only the order of the gradient sums changes with the world size.
PARAM_ATOL = 1e-4


@pytest.fixture(scope="session")
def tiny_imagefolder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 classes x 24 training images of 32 px: 4 optimizer steps per epoch at batch 24."""
    pytest.importorskip("torchvision")
    out = tmp_path_factory.mktemp("data") / "imagefolder"
    subprocess.run([sys.executable, "-m", "elastic_kit.testing.make_imagefolder", str(out),
                    "--classes", "4", "--per-class", "24", "--size", "32", "--seed", "0"],
                   check=True, timeout=120, capture_output=True)
    return out


@pytest.fixture(scope="session")
def example(tiny_imagefolder: Path) -> TrainingScript:
    return example_script(tiny_imagefolder, epochs=EPOCHS)


@pytest.fixture(scope="session")
def example_reference(tmp_path_factory: pytest.TempPathFactory,
                      example: TrainingScript) -> Iterator[Reference]:
    root = tmp_path_factory.mktemp("example-reference")
    job, summary = run_fault_free(root, example, epochs=EPOCHS)
    yield Reference(summary, job.checkpoint_dir, root)


def test_example_worker_sigkill_is_bitwise_invisible(new_job: Callable[..., Job],
                                                     example: TrainingScript,
                                                     example_reference: Reference) -> None:
    """Scenario 1 on the example: SIGKILL a worker at a random step of a 2-node run.

    Both ranks wait at the end of that step (the test's hold point) while the worker
    is killed, so the kill always lands mid-run, with nothing saved after the newest
    committed checkpoint: the restarted group must redo the lost steps exactly.
    """
    kill_at = random.Random(os.environ.get("EK_TEST_SEED", "1")).randint(2, 8)
    job = new_job("example-kill", script=example, nnodes="2", max_restarts=3,
                  hold=Hold(at_step=kill_at, world_size=2))
    job.cluster.add_agent()
    victim = job.cluster.add_agent()
    held_at = job.wait_until_held(2)
    newest = max(job.committed_steps(), default=0)
    job.cluster.kill_worker(victim, sig=signal.SIGKILL)
    job.release()

    summary = job.finish([0, 0])
    assert len(summary["world_sizes"]) >= 2, f"no restart after the kill at step {held_at}"
    assert summary["restored_steps"] and summary["restored_steps"][0] >= newest, summary
    assert_audit_ok(summary, EPOCHS)
    assert summary["steps"] == example_reference.summary["steps"]
    assert summary["param_sha256"] == example_reference.summary["param_sha256"], (
        f"worker killed after step {held_at}: final weights differ from the uninterrupted run")


def test_example_scale_down_matches_never_resized_run(new_job: Callable[..., Job],
                                                      example: TrainingScript,
                                                      example_reference: Reference) -> None:
    """Scenario 2 on the example: 3 nodes, lose a non-host node, finish without it.

    Every group waits at the hold point after its third step: a smaller group (the
    first agent may start alone on a slow machine) until the next agent's join makes
    torchrun stop it, the 3-node group, which has committed a checkpoint of its own by
    then (the run summary travels in checkpoints), until the node is killed. So the
    loss always happens at world size 3, mid-run; the survivors restore a checkpoint
    at least as new as any committed before, and end where the never-resized run ends
    up to float summation order.
    """
    job = new_job("example-scale-down", script=example, nnodes="1:3", max_restarts=3,
                  hold=Hold(group_steps=3))
    for _ in range(3):
        job.cluster.add_agent()
    job.wait_until_held(3)
    job.wait_for_checkpoint(0, world_size=3)
    newest = max(job.committed_steps(), default=0)
    job.cluster.kill_agent(job.cluster.agents[2])  # not the c10d store's host
    job.release()

    summary = job.finish([0, 0, None])
    after = segments_after_last(summary, 3)
    assert after and all(w["world_size"] in (1, 2) for w in after), summary["world_sizes"]
    assert after[0]["restored_step"] is not None and after[0]["restored_step"] >= newest, after
    assert_audit_ok(summary, EPOCHS)
    assert summary["steps"] == example_reference.summary["steps"]
    mine = final_model_state(str(job.checkpoint_dir))
    ref = final_model_state(str(example_reference.final_path))
    diff = max(float((mine[k].double() - ref[k].double()).abs().max()) for k in ref)
    assert diff < PARAM_ATOL, f"final weights differ from the never-resized run by {diff:.3g}"
