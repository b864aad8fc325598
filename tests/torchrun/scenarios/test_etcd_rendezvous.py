"""Scale up and scale down with torchrun's ``etcd-v2`` rendezvous on a real etcd.

Unlike c10d, the rendezvous lives outside the agents, so the *first* agent may die,
and with it global rank 0: the only rank that writes the (shared) CheckpointStore and
reads it on restore. The scenario runs ``tests/train_script.py`` (the library's ElasticLoop,
fixed_global sampler, CheckpointStore): the survivors must restore the newest
committed checkpoint under new ranks, keep the sample audit exact, and end where the
never-resized reference ends, up to float summation order.
"""

from __future__ import annotations

from typing import Callable

import pytest

from elastic_kit.testing import EtcdServer
from tests.torchrun.scenarios.conftest import EPOCHS, Reference
from tests.torchrun.scenarios.harness import (
    Hold, Job, assert_audit_ok, assert_params_match, segments_after_last, world_size_sequence,
)

pytestmark = pytest.mark.integration


def test_etcd_scale_up_then_lose_the_first_node(new_job: Callable[..., Job],
                                                reference_run: Reference,
                                                etcd_server: EtcdServer) -> None:
    """Scenario 5: 1 -> 3 nodes (two joins), then the first agent is SIGKILLed.

    Each join holds training still until torchrun restarts the group for it. The
    3-node group, once it has committed a checkpoint of its own (so the run summary,
    which travels in checkpoints, records it), waits at the hold point while the first
    agent (and its worker) is killed: the loss always happens at world size 3,
    mid-run. The survivors learn
    about it from a failed collective and re-rendezvous without it: 2 nodes, or 1 and
    then 2 when one survivor's agent is slower than the last call. Either way they
    restore a checkpoint at least as new as any committed before the kill, see every
    sample once, and end where the never-resized reference ends.
    """
    job = new_job(nnodes="1:3", max_restarts=3, rdzv_backend="etcd-v2",
                  rdzv_endpoint=etcd_server.endpoint,
                  hold=Hold(world_size=3, group_steps=3))
    first = job.cluster.add_agent()
    job.wait_for_start(1)
    job.cluster.add_agent_while_paused()
    job.wait_for_start(2)
    job.cluster.add_agent_while_paused()
    job.wait_until_held(3)
    job.wait_for_checkpoint(0, world_size=3)
    newest = max(job.committed_steps())
    job.cluster.kill_agent(first)
    job.release()

    summary = job.finish([None, 0, 0])
    seq = world_size_sequence(summary)
    assert seq[0] == 1 and 3 in seq, f"world sizes {summary['world_sizes']}"
    after = segments_after_last(summary, 3)
    assert after and all(w["world_size"] in (1, 2) for w in after), summary["world_sizes"]
    assert after[0]["restored_step"] is not None and after[0]["restored_step"] >= newest, after
    assert summary["steps"] == reference_run.summary["steps"]
    assert_audit_ok(summary, EPOCHS)
    assert_params_match(job.final_path, reference_run.final_path, rtol=1e-9,
                        what=f"(world sizes {seq})")
