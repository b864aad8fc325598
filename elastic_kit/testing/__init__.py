"""Test helpers for distributed training code: for this library's tests and for users'.

Everything here is for tests, demos and benchmarks, never for a training run, and its
extra dependencies (psutil to walk process trees, Pillow for the image folder) come
with ``pip install elastic_kit[testing]``; ``import elastic_kit`` needs none of them.

- :func:`spawn_multi_process` runs a function on N gloo ranks on the CPU and returns
  each rank's result (:func:`free_port`, :func:`torchrun_env`, :class:`MultiProcessError`);
  :func:`reserve_port` holds a port for a server another process starts later.
- :class:`LocalCluster` / :class:`Agent`: several torchrun agents on one machine, each one
  "node"; :class:`EtcdServer`: a throw-away etcd for the ``etcd-v2`` rendezvous.
- :class:`FakeMetadataServer`: a GCE, AWS or Azure metadata service on 127.0.0.1 that
  announces a preemption on cue.
- :func:`make_imagefolder`: a small deterministic ImageNet-style folder of real JPEGs
  (``python -m elastic_kit.testing.make_imagefolder OUT --classes 10 --per-class 64``).

Several torchrun agents on one machine, each one "node":

A real elastic job is one ``torchrun`` agent per host, all pointing at the same
rendezvous. :class:`LocalCluster` starts such agents on ``127.0.0.1`` so that failures,
preemptions, scale-down and scale-up can be produced on purpose and observed:

- :meth:`LocalCluster.add_agent` starts one more agent (a node joins);
- :meth:`LocalCluster.kill_agent` SIGKILLs an agent *and every process below it* (a
  node is lost). torchrun starts its workers in their own sessions, so killing the
  agent's process group would leave the workers running: the tree is walked with
  psutil *before* anything is killed, because an orphan is re-parented and cannot be
  found from the agent afterwards;
- :meth:`LocalCluster.terminate_agent` sends SIGTERM to the agent only, which torchrun
  forwards to its workers (a preemption notice);
- :meth:`LocalCluster.close` kills whatever is still alive. Every process a cluster
  starts carries a private marker in its environment, so even a worker orphaned by an
  agent that died on its own is found and stopped.

:class:`EtcdServer` runs a throw-away ``etcd`` (v2 API enabled) on free loopback
ports for the ``etcd-v2`` rendezvous backend, where unlike c10d any agent may die.

:func:`wait_for` polls a condition with a bounded timeout, so a test can act "after
step N" on an observable event (a checkpoint manifest appearing, a log line) instead
of sleeping.

Example::

    with LocalCluster(["train.py", "--epochs", "2"], nnodes="1:3",
                      log_dir=tmp_path / "logs") as cluster:
        for _ in range(3):
            cluster.add_agent()
        wait_for(lambda: any(tmp_path.glob("ckpt/step-*/manifest.json")), 120)
        cluster.kill_agent(cluster.agents[2])      # a non-host agent: c10d survives
        assert cluster.wait(300)[:2] == [0, 0]

.. warning::
    With ``rdzv_backend="c10d"`` the first agent hosts the rendezvous store; if it
    dies every agent fails. Kill only later agents there, or use :class:`EtcdServer`
    with ``rdzv_backend="etcd-v2"``.
"""

from __future__ import annotations

from elastic_kit.testing._spawn import (
    MultiProcessError, free_port, spawn_multi_process, torchrun_env,
)
from elastic_kit.testing._ports import ReservedPort, reserve_port
from elastic_kit.testing._proc import MARKER_ENV, kill_process_tree, wait_for
from elastic_kit.testing._cluster import Agent, LocalCluster
from elastic_kit.testing._etcd import EtcdServer
from elastic_kit.testing._imagefolder import make_imagefolder
from elastic_kit.testing._faultfs import FaultFileSystem
from elastic_kit.testing._metadata import FakeMetadataServer

__all__ = [
    "spawn_multi_process", "MultiProcessError", "free_port", "torchrun_env",
    "reserve_port", "ReservedPort",
    "Agent", "LocalCluster", "EtcdServer", "wait_for", "kill_process_tree", "MARKER_ENV",
    "make_imagefolder", "FaultFileSystem", "FakeMetadataServer",
]
