"""World-size changes under real torchrun with the c10d rendezvous: scale up, and
node-local checkpoints that a late node does not have. (Scale down is scenario 2 in
test_example_scenarios.py, on the real example; etcd in test_etcd_rendezvous.py.)

Both run ``_worker.py``, which trains with the library's ``ElasticLoop`` (fixed_global
policy: its ``ElasticDistributedSampler`` deals the same global batches to 1, 2 or 3
ranks, with micro-batch accumulation and a padded last step), ``CheckpointStore`` and
``TrainState``. Each join makes torchrun SIGTERM the workers: the loop's SIGTERM
checkpoint is what the larger group restores. Under the fixed-global-batch policy the
trajectory does not depend on the world size, so every run must end where the
never-resized reference ends up to float summation order (float64: observed ~1e-13
relative; the bound is 1e-9), and the loop's sample audit must show every
sample exactly once per epoch across the restarts.
"""

from __future__ import annotations

import re
from typing import Callable

import pytest

from tests.integration.conftest import EPOCHS, Reference
from tests.integration.harness import (
    Job, assert_audit_ok, assert_params_match, world_size_sequence,
)

pytestmark = pytest.mark.integration

#: float64 model; only the order of the gradient sums changes with the world size.
PARAM_RTOL = 1e-9


def assert_matches_reference(job: Job, summary: dict, reference: Reference) -> None:
    assert summary["steps"] == reference.summary["steps"], (summary["steps"], reference.summary)
    assert_audit_ok(summary, EPOCHS)
    assert_params_match(job.final_path, reference.final_path, rtol=PARAM_RTOL,
                        what=f"(world sizes {world_size_sequence(summary)})")


def sigterm_saves(logs: str) -> list[int]:
    """Steps the loop checkpointed on SIGTERM (the library's log line, rank 0)."""
    return [int(s) for s in re.findall(r"stop requested \(SIGTERM\): saved step (\d+)", logs)]


def test_scale_up_to_three_nodes_resumes_from_newest_state(new_job: Callable[..., Job],
                                                           reference_run: Reference) -> None:
    """Scenario 3: start with one node, add a second and a third while training.

    Each join makes torchrun SIGTERM the group; the loop checkpoints the current step
    and exits 143, and the larger group restores exactly that step.
    """
    job = new_job(nnodes="1:3", max_restarts=3)
    job.cluster.add_agent()
    job.wait_for_checkpoint(2)
    job.cluster.add_agent_while_paused()
    job.wait_for_world_size(2)
    job.wait_for_checkpoint(max(job.committed_steps()) + 1)
    job.cluster.add_agent_while_paused()
    job.wait_for_world_size(3)

    summary = job.finish([0, 0, 0])
    assert world_size_sequence(summary) == [1, 2, 3], f"world sizes {summary['world_sizes']}"
    restored = [w["restored_step"] for w in summary["world_sizes"][1:]]
    assert all(r is not None and r > 0 for r in restored), summary["world_sizes"]
    assert restored == sorted(restored), f"a restart went back in time: {restored}"
    # A scale-up loses no step: every resize resumes from the SIGTERM checkpoint.
    saved = sigterm_saves(job.all_logs())
    assert set(restored) <= set(saved), f"restored {restored}, SIGTERM checkpoints {saved}"
    assert_matches_reference(job, summary, reference_run)


def test_node_local_checkpoints_reach_a_late_node(new_job: Callable[..., Job],
                                                  reference_run: Reference) -> None:
    """Scenario 4: every node checkpoints to its own directory; a third node joins late.

    ``CheckpointStore(node_local=True)``: each agent's local rank 0 writes its own
    directory (``$EK_NODE_CHECKPOINT_DIR``, one per agent, as a local disk would be).
    After the rescale every rank restored the newest step (broadcast by the store from
    a node holding it) and the late node committed a local copy of it.
    """
    job = new_job(nnodes="1:3", max_restarts=3, extra=["--node-local-checkpoints"])
    node_dirs = [job.root / f"node-{i}" for i in range(3)]
    for d in node_dirs[:2]:
        job.cluster.add_agent(env={"EK_NODE_CHECKPOINT_DIR": str(d)})
    job.wait_for_world_size(2)
    job.wait_for_checkpoint(2, directory=node_dirs[0])
    job.cluster.add_agent_while_paused(env={"EK_NODE_CHECKPOINT_DIR": str(node_dirs[2])})
    job.wait_for_world_size(3)

    summary = job.finish([0, 0, 0])
    assert not job.committed_steps(), "node-local saves went to the shared --checkpoint-dir"
    resumed = summary["world_sizes"][-1]
    assert resumed["world_size"] == 3, summary["world_sizes"]
    step = resumed["restored_step"]
    assert step is not None and step > 0, resumed
    # The store's own report, in the late agent's log: it lacked the step, wrote a copy.
    late_log = job.cluster.agents[2].read_log()
    copied = re.findall(r"node \d+ lacked checkpoint step (\d+): local copy written to (\S+)",
                        late_log)
    assert any(int(s) == step and p.startswith(str(node_dirs[2])) for s, p in copied), (
        f"the late node did not copy step {step} into {node_dirs[2]}:\n{late_log[-5000:]}")
    restored = re.findall(r"EKW rank=(\d+) world_size=3 restored step=(\S+)", job.all_logs())
    assert {int(r) for r, s in restored if s == str(step)} == {0, 1, 2}, (
        f"not every rank of the 3-node group restored step {step}: {restored}")
    assert step in job.committed_steps(node_dirs[2]), (
        f"late node holds {job.committed_steps(node_dirs[2])}, not step {step}")
    for d in node_dirs:
        assert summary["steps"] in job.committed_steps(d), f"{d} lacks the final step"
    assert_matches_reference(job, summary, reference_run)
