"""World-size changes under real torchrun with the c10d rendezvous: scale up, and
node-local checkpoints that a late node does not have. (Scale down is scenario 2 in
test_example_scenarios.py, on the real example; etcd in test_etcd_rendezvous.py.)

Under the fixed-global-batch policy the trajectory does not depend on the world size,
so every run must end where the never-resized reference ends, up to float summation
order; and the sample audit must show every sample once per epoch.
"""

from __future__ import annotations

import re
from typing import Callable

import pytest

from tests.integration.conftest import EPOCHS, Reference
from tests.integration.harness import Job, assert_audit_ok, max_param_diff, world_size_sequence

pytestmark = pytest.mark.integration

#: float64 model; only the order of the gradient sum changes with the world size.
PARAM_ATOL = 1e-8


def assert_matches_reference(job: Job, summary: dict, reference: Reference) -> None:
    assert summary["steps"] == reference.summary["steps"], (summary["steps"], reference.summary)
    assert_audit_ok(summary, EPOCHS)
    diff = max_param_diff(job.final_path, reference.final_path)
    assert diff < PARAM_ATOL, (f"final parameters differ from the never-resized run by {diff:.3g} "
                               f"(world sizes {world_size_sequence(summary)})")


def test_scale_up_to_three_nodes_resumes_from_newest_state(new_job: Callable[..., Job],
                                                           reference_run: Reference) -> None:
    """Scenario 3: start with one node, add a second and a third while training.

    Each join restarts the group larger; each restart resumes from the newest state.
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
    assert_matches_reference(job, summary, reference_run)


def test_node_local_checkpoints_reach_a_late_node(new_job: Callable[..., Job],
                                                  reference_run: Reference) -> None:
    """Scenario 4: every node checkpoints to its own directory; a third node joins late.

    After the rescale every rank restored the newest step (broadcast from a holder) and
    the late node holds a local copy of it.
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
    resumed = summary["world_sizes"][-1]
    assert resumed["world_size"] == 3, summary["world_sizes"]
    step = resumed["restored_step"]
    assert step is not None and step > 0, resumed
    late_log = job.cluster.agents[2].read_log()
    copied = re.findall(r"EKW rank=(\d+) copied step (\d+) from rank (\d+)", late_log)
    assert any(int(s) == step for _, s, _ in copied), (
        f"the late node did not copy step {step}:\n{late_log[-5000:]}")
    restored = re.findall(rf"EKW rank=(\d+) restored step {step} from", job.all_logs())
    assert {int(r) for r in restored} == {0, 1, 2}, (
        f"not every rank restored step {step}: {restored}")
    assert step in job.committed_steps(node_dirs[2]), (
        f"late node holds {job.committed_steps(node_dirs[2])}, not step {step}")
    for d in node_dirs:
        assert summary["steps"] in job.committed_steps(d), f"{d} lacks the final step"
    assert_matches_reference(job, summary, reference_run)
