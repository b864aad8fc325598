"""Helpers shared by the torchrun integration scenarios.

A scenario starts a :class:`~elastic_kit.testing.LocalCluster` running a
training script, waits for *observable* events (a checkpoint manifest appearing, a
torchrun rendezvous line in an agent log) before it injects a fault, then asserts on
the summary JSON that rank 0 writes at the end and on the logs. Nothing here sleeps
for a guessed duration: every wait polls an event with a bounded timeout and gives up
early when every agent has exited.

The training script is abstracted by :class:`TrainingScript` so the same scenarios
run on ``tests/integration/_worker.py`` (a tiny float64 MLP trained with the library's
``ElasticLoop``, ``CheckpointStore`` and sampler: seconds per run) or on the ImageNet
example; both are built on the library and write the same summary keys.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pytest

from elastic_kit.testing import Agent, LocalCluster, wait_for

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "_worker.py"

#: torchrun's agent log line (LOGLEVEL=INFO) announcing a completed rendezvous.
_GROUP_WORLD = re.compile(r"group_world_size=(\d+)")
#: A committed-or-not checkpoint directory of the library's store (``step-000000000012``);
#: anchored, so the store's ``.tmp-step-...`` staging directories never match.
_STEP_DIR = re.compile(r"^step-(\d+)$")

#: Generous but bounded: 2 cores shared by several jobs, a worker start is 2-8 s.
EVENT_TIMEOUT = 90.0
RUN_TIMEOUT = 240.0


@dataclass(frozen=True)
class TrainingScript:
    """How to launch the script under test with a given checkpoint dir and summary path.

    Attributes:
        name: ``"worker"`` or ``"example"`` (shown in test ids and reports).
        base: the script and the arguments every run shares (model, data, schedule).
    """

    name: str
    base: tuple[str, ...]
    supports_save_final: bool = True

    def argv(self, *, checkpoint_dir: str, summary_json: Path, save_final: Path | None = None,
             checkpoint_every: int = 2, extra: Sequence[str] = ()) -> list[str]:
        args = [*self.base, "--checkpoint-dir", checkpoint_dir,
                "--checkpoint-every", str(checkpoint_every), "--summary-json", str(summary_json)]
        if save_final is not None and self.supports_save_final:
            args += ["--save-final", str(save_final)]
        return [*args, *extra]


def worker_script(*, epochs: int = 4, step_delay: float = 0.1) -> TrainingScript:
    """The library-based worker: 50 samples, global batch 6 (divisible by 1, 2 and 3)
    in micro-batches of at most 2, so 9 steps per epoch of which the last has 2 real
    samples and zero-weighted padding, and 1 to 3 accumulation steps per rank."""
    return TrainingScript("worker", (str(WORKER), "--epochs", str(epochs), "--dataset-size", "50",
                                     "--global-batch-size", "6", "--micro-batch-size", "2",
                                     "--step-delay", str(step_delay)))


EXAMPLE = REPO / "examples" / "imagenet" / "main.py"


def example_script(data_dir: Path, *, epochs: int = 3) -> TrainingScript:
    """The ImageNet example on a tiny image folder: tinycnn (no batch norm), 32 px,
    no data-loader processes, a global batch of 24 (divisible by 1, 2 and 3 ranks)."""
    return TrainingScript("example", (str(EXAMPLE), str(data_dir), "-a", "tinycnn",
                                      "--image-size", "32", "-j", "0", "--epochs", str(epochs),
                                      "-b", "12", "--global-batch-size", "24", "--seed", "0",
                                      "-p", "1"),
                          supports_save_final=False)


def final_model_state(checkpoint_url: str) -> dict[str, Any]:
    """The model tensors of the newest committed checkpoint in ``checkpoint_url``.

    For scripts without ``--save-final``: the example checkpoints at every epoch end,
    so the newest checkpoint of a finished run holds its final parameters.
    """
    from elastic_kit.checkpoint import CheckpointStore

    with CheckpointStore(checkpoint_url) as store:
        loaded = store.load(map_location="cpu")
    assert loaded is not None, f"no committed checkpoint in {checkpoint_url}"
    model = loaded.state["model"]
    return {k: v for k, v in model.items() if hasattr(v, "dtype")}


@dataclass
class Job:
    """One scenario's cluster plus where its script writes (checkpoints, summary, params)."""

    cluster: LocalCluster
    root: Path
    checkpoint_dir: Path
    summary_path: Path
    final_path: Path
    started: float = field(default_factory=time.monotonic)

    # -- observing -------------------------------------------------------------------

    def committed_steps(self, directory: Path | None = None) -> list[int]:
        """Steps whose ``step-*/manifest.json`` exists under ``directory``."""
        return committed_steps(directory or self.checkpoint_dir)

    def _gone(self) -> bool:
        return self.cluster.all_exited()

    def wait_for_checkpoint(self, min_step: int, *, directory: Path | None = None,
                            timeout: float = EVENT_TIMEOUT) -> int:
        """Wait until a checkpoint of step >= ``min_step`` is committed; return its step."""
        def newest() -> int | None:
            steps = [s for s in self.committed_steps(directory) if s >= min_step]
            return max(steps) if steps else None
        return int(self._wait(newest, timeout, f"a checkpoint of step >= {min_step}"))

    def wait_for_world_size(self, world_size: int, *, more_than: int = 0,
                            timeout: float = EVENT_TIMEOUT) -> int:
        """Wait until more than ``more_than`` rendezvous of ``world_size`` nodes are logged.

        Every agent of a round logs it, so a round of N nodes counts N times; pass the
        previous return value to wait for the *next* such round. Returns the count.
        """
        def seen() -> int | None:
            n = self.rendezvous_sizes().count(world_size)
            return n if n > more_than else None
        return int(self._wait(seen, timeout, f"a rendezvous of {world_size} nodes"))

    def rendezvous_sizes(self) -> list[int]:
        """Group sizes of every completed rendezvous, as logged by each agent taking part
        (agent by agent, so not in time order across agents)."""
        out: list[int] = []
        for agent in self.cluster.agents:
            out += [int(m) for m in _GROUP_WORLD.findall(agent.read_log())]
        return out

    def wait_for_log(self, pattern: str, *, agent: Agent | None = None,
                     timeout: float = EVENT_TIMEOUT) -> re.Match[str]:
        """Wait until ``pattern`` (a regex) appears in one agent's log or any agent's."""
        rx = re.compile(pattern)

        def found() -> re.Match[str] | None:
            agents = [agent] if agent is not None else self.cluster.agents
            for a in agents:
                m = rx.search(a.read_log())
                if m:
                    return m
            return None
        return self._wait(found, timeout, f"log pattern {pattern!r}")

    def _wait(self, predicate: Any, timeout: float, what: str) -> Any:
        try:
            return wait_for(predicate, timeout, interval=0.05, what=what, abort_if=self._gone)
        except (TimeoutError, RuntimeError) as e:
            pytest.fail(f"{e}\n{self.cluster.logs()[-20000:]}")

    # -- finishing -------------------------------------------------------------------

    def finish(self, expect: Sequence[int | None], *, timeout: float = RUN_TIMEOUT) -> dict[str, Any]:
        """Wait for every agent; check the exit codes; return the summary JSON.

        ``expect`` gives the expected exit code per agent (None: do not check, e.g. a
        killed agent's negative signal code).
        """
        codes = self.cluster.wait(timeout)
        if len(expect) != len(codes) or not all(e is None or c == e for c, e in zip(codes, expect)):
            pytest.fail(f"agent exit codes {codes}, expected {list(expect)} "
                        f"after {time.monotonic() - self.started:.0f} s\n"
                        f"{self.cluster.logs()[-30000:]}")
        if not self.summary_path.exists():
            pytest.fail(f"no summary at {self.summary_path}\n{self.cluster.logs()[-20000:]}")
        return json.loads(self.summary_path.read_text())

    def all_logs(self) -> str:
        return self.cluster.logs()


def committed_steps(directory: Path) -> list[int]:
    """Steps ``N`` of every ``step-N/manifest.json`` directly under ``directory``."""
    if not directory.is_dir():
        return []
    out = []
    for d in directory.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / "manifest.json").is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def make_job(root: Path, script: TrainingScript, *, nnodes: str, max_restarts: int = 3,
             rdzv_backend: str = "c10d", rdzv_endpoint: str | None = None,
             checkpoint_dir: str | None = None, checkpoint_every: int = 2,
             extra: Sequence[str] = (), env: dict[str, str] | None = None,
             monitor_interval: float = 0.2) -> Job:
    """A :class:`Job` (not started: call ``job.cluster.add_agent()``) writing under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / "ckpt"
    summary, final = root / "summary.json", root / "final.pt"
    argv = script.argv(checkpoint_dir=checkpoint_dir or str(ckpt), summary_json=summary,
                       save_final=final, checkpoint_every=checkpoint_every, extra=extra)
    cluster = LocalCluster(argv, nnodes=nnodes, max_restarts=max_restarts,
                           rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint,
                           env={"PYTHONPATH": str(REPO), **(env or {})},
                           log_dir=root / "logs", monitor_interval=monitor_interval,
                           python=sys.executable)
    return Job(cluster, root, ckpt, summary, final)


def run_fault_free(root: Path, script: TrainingScript, *, epochs: int) -> tuple[Job, dict[str, Any]]:
    """Two nodes, no fault: the trajectory a fault scenario must reproduce.

    Checks that the run never restarted and audited every epoch, and returns the
    finished job (its agents closed) and its summary.
    """
    job = make_job(root, script, nnodes="2", max_restarts=0)
    try:
        job.cluster.add_agent()
        job.cluster.add_agent()
        summary = job.finish([0, 0])
    finally:
        job.cluster.close()
    assert world_size_sequence(summary) == [2], summary["world_sizes"]
    assert summary["restarts"] == 0, summary
    assert_audit_ok(summary, epochs)
    return job, summary


def load_params(path: Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def max_param_diff(a: Path, b: Path) -> float:
    """Largest absolute difference between two saved parameter dicts (same keys)."""
    pa, pb = load_params(a), load_params(b)
    assert sorted(pa) == sorted(pb), f"parameter names differ: {sorted(pa)} vs {sorted(pb)}"
    return max(float((pa[k].double() - pb[k].double()).abs().max()) for k in pa)


def max_param_rel_diff(a: Path, b: Path) -> float:
    """Largest ``|a - b| / max(|b|, 1e-3)`` over every element of two parameter dicts."""
    pa, pb = load_params(a), load_params(b)
    assert sorted(pa) == sorted(pb), f"parameter names differ: {sorted(pa)} vs {sorted(pb)}"
    return max(float(((pa[k].double() - pb[k].double()).abs()
                      / pb[k].double().abs().clamp_min(1e-3)).max()) for k in pa)


def assert_params_match(a: Path, b: Path, *, rtol: float, what: str = "") -> None:
    """The final parameters in ``a`` equal those in ``b`` within ``rtol`` (relative)."""
    rel = max_param_rel_diff(a, b)
    assert rel < rtol, (f"final parameters differ from the reference by {rel:.3g} (relative, "
                        f"max abs {max_param_diff(a, b):.3g}) {what}")


def assert_audit_ok(summary: dict[str, Any], epochs: int) -> None:
    """Every epoch saw every sample exactly once (the summary's sample audit)."""
    audit = summary["audit"]
    assert [a["epoch"] for a in audit] == list(range(epochs)), f"audited epochs: {audit}"
    bad = [a for a in audit if not a["ok"] or a["count"] != a["expected"]]
    assert not bad, f"sample audit failed: {bad}"


def world_size_sequence(summary: dict[str, Any]) -> list[int]:
    """World sizes the job ran at, consecutive duplicates collapsed."""
    seq: list[int] = []
    for entry in summary["world_sizes"]:
        if not seq or seq[-1] != entry["world_size"]:
            seq.append(entry["world_size"])
    return seq
