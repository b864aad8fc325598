"""Helpers shared by the torchrun integration scenarios.

A scenario starts a :class:`~elastic_kit.testing.LocalCluster` running a
training script and acts only on *observable* events: a committed checkpoint (its
manifest, which also names the world size that wrote it), a line of the worker's
``--events`` file, or every rank waiting at the test's hold point (``_hold.py``), where
training cannot run ahead of the test however loaded the machine is. It then asserts
on what the library guarantees: the summary JSON rank 0 writes at the end (world
sizes, restored steps, sample audit, final parameters), the committed checkpoints
and the steps and exit codes the workers report, never on torchrun's log wording or
on timing. Nothing here sleeps for a guessed duration: every wait polls an event with
a generous but bounded timeout and gives up early when every agent has exited.

The training script is abstracted by :class:`TrainingScript` so the same scenarios
run on ``tests/train_script.py`` (a tiny float64 MLP trained with the library's
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

from elastic_kit.testing import LocalCluster, wait_for

REPO = Path(__file__).resolve().parents[3]
WORKER = REPO / "tests" / "train_script.py"

HOLD = Path(__file__).resolve().parent / "_hold.py"
#: A committed-or-not checkpoint directory of the library's store (``step-000000000012``);
#: anchored, so the store's ``.tmp-step-...`` staging directories never match.
_STEP_DIR = re.compile(r"^step-(\d+)$")

#: Generous but bounded: 2 cores shared by several jobs, a worker start is 2-8 s.
EVENT_TIMEOUT = 180.0
RUN_TIMEOUT = 420.0


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
    supports_events: bool = True

    def argv(self, *, checkpoint_dir: str, summary_json: Path, save_final: Path | None = None,
             events: Path | None = None, checkpoint_every: int = 2,
             extra: Sequence[str] = ()) -> list[str]:
        args = [*self.base, "--checkpoint-dir", checkpoint_dir,
                "--checkpoint-every", str(checkpoint_every), "--summary-json", str(summary_json)]
        if save_final is not None and self.supports_save_final:
            args += ["--save-final", str(save_final)]
        if events is not None and self.supports_events:
            args += ["--events", str(events)]
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
    no data-loader processes, a global batch of 24 (divisible by 1, 2 and 3 ranks).

    Run through ``_hold.py`` so that a scenario can hold it at a step like the worker."""
    return TrainingScript("example", (str(HOLD), str(EXAMPLE), str(data_dir), "-a", "tinycnn",
                                      "--image-size", "32", "-j", "0", "--epochs", str(epochs),
                                      "-b", "12", "--global-batch-size", "24", "--seed", "0",
                                      "-p", "1"),
                          supports_save_final=False, supports_events=False)


@dataclass(frozen=True)
class Hold:
    """Where every rank of a job waits for the test (see ``_hold.py``): at the end of
    the first step ``>= at_step`` that is at least the ``group_steps``-th step of its
    worker group, in a group of ``world_size`` ranks (any size if None)."""

    at_step: int = 1
    world_size: int | None = None
    group_steps: int = 1

    def env(self, directory: Path) -> dict[str, str]:
        env = {"EK_TEST_HOLD_DIR": str(directory), "EK_TEST_HOLD_AT_STEP": str(self.at_step),
               "EK_TEST_HOLD_GROUP_STEPS": str(self.group_steps)}
        if self.world_size is not None:
            env["EK_TEST_HOLD_WORLD_SIZE"] = str(self.world_size)
        return env


def final_model_state(checkpoint_url: str) -> dict[str, Any]:
    """The model tensors of the newest committed checkpoint in ``checkpoint_url``.

    For scripts without ``--save-final``: the example checkpoints at every epoch end,
    so the newest checkpoint of a finished run holds its final parameters.
    """
    from elastic_kit.store import CheckpointStore

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
    events_path: Path
    hold_dir: Path
    started: float = field(default_factory=time.monotonic)

    # -- observing -------------------------------------------------------------------

    def committed_steps(self, directory: Path | None = None) -> list[int]:
        """Steps whose ``step-*/manifest.json`` exists under ``directory``."""
        return committed_steps(directory or self.checkpoint_dir)

    def manifest(self, step: int, directory: Path | None = None) -> dict[str, Any]:
        """The parsed ``manifest.json`` of committed checkpoint ``step``."""
        return read_manifest(directory or self.checkpoint_dir, step)

    def _gone(self) -> bool:
        return self.cluster.all_exited()

    def wait_for_checkpoint(self, min_step: int, *, directory: Path | None = None,
                            world_size: int | None = None,
                            timeout: float = EVENT_TIMEOUT) -> int:
        """Wait until a checkpoint of step >= ``min_step`` is committed (by a group of
        ``world_size`` ranks, when given, as its manifest says); return its step."""
        where = directory or self.checkpoint_dir

        def newest() -> int | None:
            steps = [s for s in committed_steps(where) if s >= min_step and (
                world_size is None or read_manifest(where, s).get("world_size") == world_size)]
            return max(steps) if steps else None
        what = f"a checkpoint of step >= {min_step}" + (
            f" saved at world size {world_size}" if world_size is not None else "")
        return int(self._wait(newest, timeout, what))

    def events(self) -> list[dict[str, Any]]:
        """The worker's ``--events`` lines so far (start and exit of every rank), in order."""
        if not self.events_path.exists():
            return []
        lines = self.events_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def groups(self, rank: int = 0) -> list[dict[str, dict[str, Any]]]:
        """``{"start": event, "exit": event}`` of each process that had ``rank``, in order:
        one per worker group that trained at least one step (a worker stopped before
        that reports nothing; one killed reports no exit)."""
        by_pid: dict[int, dict[str, dict[str, Any]]] = {}
        for e in self.events():
            if e["rank"] == rank:
                by_pid.setdefault(e["pid"], {})[e["event"]] = e
        return list(by_pid.values())

    def wait_for_start(self, world_size: int, *, timeout: float = EVENT_TIMEOUT) -> None:
        """Wait until every rank of a group of ``world_size`` ranks has started training
        (finished its first step, so its SIGTERM handling is installed)."""
        def started() -> bool:
            ranks = {e["rank"] for e in self.events()
                     if e["event"] == "start" and e["world_size"] == world_size}
            return ranks >= set(range(world_size))
        self._wait(started, timeout, f"a group of {world_size} ranks to start training")

    def wait_until_held(self, world_size: int, *, timeout: float = EVENT_TIMEOUT) -> int:
        """Wait until every rank of a group of ``world_size`` waits at the hold point;
        return the step they hold at (the job needs a :class:`Hold`)."""
        def held() -> int | None:
            seen = [json.loads(p.read_text()) for p in self.hold_dir.glob("held-rank*")]
            seen = [h for h in seen if h["world_size"] == world_size]
            steps = {h["step"] for h in seen}
            if len(seen) == world_size and len(steps) == 1:
                return steps.pop()
            return None
        return int(self._wait(held, timeout, f"{world_size} ranks to reach the hold point"))

    def wait_for_sigterm_at_hold(self, *, timeout: float = EVENT_TIMEOUT) -> None:
        """Wait until some held rank has received torchrun's SIGTERM."""
        self._wait(lambda: any(self.hold_dir.glob("sigterm-rank*")), timeout,
                   "a held rank to receive SIGTERM")

    def release(self) -> None:
        """Let every held rank go on; nobody holds again in this job."""
        (self.hold_dir / "release").touch()

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


def read_manifest(directory: Path, step: int) -> dict[str, Any]:
    """The parsed ``manifest.json`` of committed checkpoint ``step`` under ``directory``."""
    for d in directory.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and int(m.group(1)) == step:
            return json.loads((d / "manifest.json").read_text())
    raise FileNotFoundError(f"no checkpoint of step {step} in {directory}")


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
             hold: Hold | None = None, monitor_interval: float = 0.2) -> Job:
    """A :class:`Job` (not started: call ``job.cluster.add_agent()``) writing under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    ckpt = root / "ckpt"
    summary, final, events = root / "summary.json", root / "final.pt", root / "events.jsonl"
    hold_dir = root / "hold"
    hold_dir.mkdir(exist_ok=True)
    argv = script.argv(checkpoint_dir=checkpoint_dir or str(ckpt), summary_json=summary,
                       save_final=final, events=events, checkpoint_every=checkpoint_every,
                       extra=extra)
    cluster = LocalCluster(argv, nnodes=nnodes, max_restarts=max_restarts,
                           rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint,
                           env={"PYTHONPATH": str(REPO), **(hold.env(hold_dir) if hold else {}),
                                **(env or {})},
                           log_dir=root / "logs", monitor_interval=monitor_interval,
                           python=sys.executable)
    return Job(cluster, root, ckpt, summary, final, events, hold_dir)


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


def segments_after_last(summary: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """The worker-group starts after the last one at ``world_size`` (run summary)."""
    sizes = [w["world_size"] for w in summary["world_sizes"]]
    assert world_size in sizes, f"the job never ran at world size {world_size}: {sizes}"
    last = len(sizes) - 1 - sizes[::-1].index(world_size)
    return summary["world_sizes"][last + 1:]


def world_size_sequence(summary: dict[str, Any]) -> list[int]:
    """World sizes the job ran at, consecutive duplicates collapsed."""
    seq: list[int] = []
    for entry in summary["world_sizes"]:
        if not seq or seq[-1] != entry["world_size"]:
            seq.append(entry["world_size"])
    return seq
