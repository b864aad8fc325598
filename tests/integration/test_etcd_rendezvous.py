"""Scale up and scale down with torchrun's ``etcd-v2`` rendezvous on a real etcd.

Unlike c10d, the rendezvous lives outside the agents, so the *first* agent may die.
"""

from __future__ import annotations

from typing import Callable

import pytest

from elastic_kit.local_cluster import EtcdServer
from tests.integration.conftest import EPOCHS, Reference
from tests.integration.harness import Job, assert_audit_ok, max_param_diff, world_size_sequence

pytestmark = pytest.mark.integration


def test_etcd_scale_up_then_lose_the_first_node(new_job: Callable[..., Job],
                                                reference_run: Reference,
                                                etcd_server: EtcdServer) -> None:
    """Scenario 5: 1 -> 3 nodes (two joins), then the first agent is SIGKILLed -> 2 nodes."""
    job = new_job(nnodes="1:3", max_restarts=3, rdzv_backend="etcd-v2",
                  rdzv_endpoint=etcd_server.endpoint)
    first = job.cluster.add_agent()
    job.wait_for_checkpoint(2)
    job.cluster.add_agent_while_paused()
    job.cluster.add_agent_while_paused()
    job.wait_for_world_size(3)
    newest = job.wait_for_checkpoint(max(job.committed_steps(), default=0) + 1)
    job.cluster.kill_agent(first)

    summary = job.finish([None, 0, 0])
    seq = world_size_sequence(summary)
    assert seq[0] == 1 and seq[-2:] == [3, 2], f"world sizes {summary['world_sizes']}"
    resumed = summary["world_sizes"][-1]
    assert resumed["restored_step"] is not None and resumed["restored_step"] >= newest, resumed
    assert summary["steps"] == reference_run.summary["steps"]
    assert_audit_ok(summary, EPOCHS)
    diff = max_param_diff(job.final_path, reference_run.final_path)
    assert diff < 1e-8, f"final parameters differ from the never-resized run by {diff:.3g}"
