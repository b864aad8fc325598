"""World-size changes under real torchrun with the c10d rendezvous: scale up, and
node-local checkpoints that a late node does not have. (Scale down is scenario 2 in
test_example_scenarios.py, on the real example; etcd in test_etcd_rendezvous.py.)

Both run ``tests/train_script.py``, which trains with the library's ``ElasticLoop`` (fixed_global
policy: its ``ElasticDistributedSampler`` deals the same global batches to 1, 2 or 3
ranks, with micro-batch accumulation and a padded last step), ``CheckpointStore`` and
``TrainState``. Each join makes torchrun SIGTERM the workers: the loop's SIGTERM
checkpoint is what the larger group restores. Training is held still (SIGSTOP) from
before a new agent starts until torchrun has sent that SIGTERM, so the larger group
always forms mid-run, and the checks use the run summary, the checkpoints' manifests
and the steps and exit codes the workers report. Under the fixed-global-batch policy the
trajectory does not depend on the world size, so every run must end where the
never-resized reference ends up to float summation order (float64: observed ~1e-13
relative; the bound is 1e-9), and the loop's sample audit must show every
sample exactly once per epoch across the restarts.
"""

from __future__ import annotations

from typing import Callable

import pytest

from tests.torchrun.scenarios.conftest import EPOCHS, Reference
from tests.torchrun.scenarios.harness import (
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


def assert_each_restart_resumed_where_the_group_stopped(job: Job, summary: dict) -> None:
    """Every group but the last left ``ElasticLoop.run`` on SIGTERM (exit code 143) after
    saving its step, and the next group restored exactly that step: no step lost."""
    groups = job.groups(rank=0)
    assert len(groups) >= 2 and groups[-1]["exit"]["code"] == 0, groups
    assert groups[-1]["exit"]["step"] == summary["steps"], groups[-1]
    for before, after in zip(groups, groups[1:]):
        assert before.get("exit", {}).get("code") == 143, before
        assert after["start"]["restored_step"] == before["exit"]["step"], (
            f"a group stopped at step {before['exit']['step']}, the next restored "
            f"{after['start']['restored_step']}")


def test_scale_up_to_three_nodes_resumes_from_newest_state(new_job: Callable[..., Job],
                                                           reference_run: Reference) -> None:
    """Scenario 3: start with one node, add a second and a third while training.

    Each join holds training still until torchrun restarts the group for it (so the run
    cannot finish first on a slow machine); the loop checkpoints the current step on the
    SIGTERM and exits 143, and the larger group restores exactly that step.
    """
    job = new_job(nnodes="1:3", max_restarts=3)
    job.cluster.add_agent()
    job.wait_for_start(1)
    job.cluster.add_agent_while_paused()
    job.wait_for_start(2)
    job.cluster.add_agent_while_paused()

    summary = job.finish([0, 0, 0])
    seq = world_size_sequence(summary)
    assert seq[0] == 1 and 2 in seq and seq[-1] == 3, f"world sizes {summary['world_sizes']}"
    assert summary["world_sizes"][0]["restored_step"] is None, summary["world_sizes"]
    assert_each_restart_resumed_where_the_group_stopped(job, summary)
    for w in summary["world_sizes"][1:]:  # each SIGTERM checkpoint names the group that wrote it
        assert job.manifest(w["restored_step"])["world_size"] in (1, 2), w
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
    job.wait_for_start(2)
    job.cluster.add_agent_while_paused(env={"EK_NODE_CHECKPOINT_DIR": str(node_dirs[2])})

    summary = job.finish([0, 0, 0])
    assert not job.committed_steps(), "node-local saves went to the shared --checkpoint-dir"
    resumed = summary["world_sizes"][-1]
    assert resumed["world_size"] == 3, summary["world_sizes"]
    step = resumed["restored_step"]
    assert step is not None and step > 0, resumed
    # Every rank of the 3-node group restored that step, the late node included ...
    starts = [e for e in job.events() if e["event"] == "start" and e["world_size"] == 3]
    assert sorted(e["rank"] for e in starts) == [0, 1, 2], starts
    assert {e["restored_step"] for e in starts} == {step}, starts
    # ... which never saved it itself (it joined after) but now holds a committed copy.
    assert step in job.committed_steps(node_dirs[2]), (
        f"late node holds {job.committed_steps(node_dirs[2])}, not step {step}")
    assert job.manifest(step, node_dirs[2])["step"] == step
    assert step in job.committed_steps(node_dirs[0])
    for d in node_dirs:
        assert summary["steps"] in job.committed_steps(d), f"{d} lacks the final step"
    assert_matches_reference(job, summary, reference_run)
