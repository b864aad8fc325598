"""The Kubernetes manifests, the Dockerfile and the documented launch commands of the
ImageNet example only use torchrun options and script flags that really exist.

Each command is split the way torchrun splits it (torch's own argument parser), then
the script's part is parsed by ``build_parser()`` from examples/imagenet/main.py, so
renaming a flag in main.py without updating the manifests fails here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torchvision  # noqa: F401  (main.py needs it; part of the test extras)
import yaml
from torch.distributed.run import get_args_parser

from elastic_kit.run import parse_options

from test_example import load_main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "imagenet"
SCRIPT = "examples/imagenet/main.py"

# The fast-restart rendezvous settings every multi-node command documents, and the
# ones benchmarks/bench_recovery.py measures (tests/tooling/test_benchmarks_smoke.py checks
# the benchmark uses the README's string).
FAST_RDZV = {"join_timeout": "300", "last_call_timeout": "1", "keep_alive_interval": "1",
             "keep_alive_max_attempt": "3"}


def rdzv_conf(tr: argparse.Namespace) -> dict[str, str]:
    """torchrun's ``--rdzv-conf`` as a dict (its own format: ``k=v,k=v``)."""
    return dict(kv.split("=", 1) for kv in tr.rdzv_conf.split(",") if kv)


class _ParseError(Exception):
    pass


def strict_parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args that raises (instead of exiting) on any unknown flag or bad value."""

    def error(message: str) -> None:
        raise _ParseError(f"{parser.prog}: {message} in {argv}")

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(argv)


def split_launch(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(torchrun options, script options) of ``torchrun ... main.py ...`` (also
    ``python -m torch.distributed.run ...`` and ``python -m elastic_kit.run
    [--preload M] ...``, whose preloads must import)."""
    assert argv[0] in ("torchrun", "python"), argv
    rest = argv[1:]
    if argv[0] == "python":
        assert argv[1] == "-m" and argv[2] in ("torch.distributed.run", "elastic_kit.run"), argv
        rest = argv[3:]
        if argv[2] == "elastic_kit.run":
            opts = parse_options(rest)
            rest = opts.torchrun_argv
            for m in opts.preload:
                importlib.import_module(m)
    tr = strict_parse(get_args_parser(), rest)
    # --run-path needs an absolute path: the docs write it as $PWD/<script>
    script = SCRIPT if not tr.run_path else f"$PWD/{SCRIPT}"
    assert tr.training_script == script, f"launches {tr.training_script}, not {script}"
    return tr, strict_parse(load_main().build_parser(), tr.training_script_args)


def pytorchjobs() -> list[tuple[Path, dict[str, Any]]]:
    jobs = []
    for path in sorted((EXAMPLE / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "PyTorchJob":
                jobs.append((path, doc))
    return jobs


def test_there_is_a_c10d_and_an_etcd_elastic_pytorchjob() -> None:
    backends = {doc["spec"]["elasticPolicy"]["rdzvBackend"] for _, doc in pytorchjobs()}
    assert "c10d" in backends and backends & {"etcd", "etcd-v2"}


@pytest.mark.parametrize("path,job", pytorchjobs(), ids=lambda v: getattr(v, "name", ""))
def test_pytorchjob_is_elastic_and_its_command_matches_the_script(
        path: Path, job: dict[str, Any]) -> None:
    assert job["apiVersion"] == "kubeflow.org/v1"
    policy = job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    lo, hi = policy["minReplicas"], policy["maxReplicas"]
    assert 1 <= lo <= worker["replicas"] <= hi and lo < hi, "not elastic"
    assert policy["maxRestarts"] >= 1
    if policy["rdzvBackend"] != "c10d":
        assert policy["rdzvHost"] and int(policy["rdzvPort"]) > 0
    (container,) = worker["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"  # scale-up needs it
    tr, args = split_launch([str(a) for a in container["command"]])
    assert rdzv_conf(tr) == FAST_RDZV, "the fast-restart --rdzv-conf is missing"
    assert args.checkpoint_dir.startswith("s3://"), "pods need shared object storage"
    nproc = int(policy.get("nProcPerNode", tr.nproc_per_node))
    _check_batch_divides(args, lo, hi, nproc)


def _check_batch_divides(args: Any, lo: int, hi: int, nproc: int) -> None:
    """A fixed global batch divides by every world size the job can run at."""
    if args.batch_policy == "fixed_global":
        bad = [w for w in range(lo * nproc, hi * nproc + 1, nproc)
               if args.global_batch_size % w]
        assert not bad, f"--global-batch-size={args.global_batch_size} fails at world sizes {bad}"


def _node_range(nnodes: str) -> tuple[int, int]:
    lo, _, hi = nnodes.partition(":")
    return int(lo), int(hi or lo)


def _dockerfile_instruction(text: str, name: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return json.loads(line[len(name) + 1:])


def test_dockerfile_runs_torchrun_on_the_script_with_valid_flags() -> None:
    text = (EXAMPLE / "Dockerfile").read_text()
    assert _dockerfile_instruction(text, "ENTRYPOINT") == ["torchrun"]
    tr, args = split_launch(["torchrun"] + _dockerfile_instruction(text, "CMD"))
    assert tr.max_restarts >= 1 and args.arch == "tinycnn"
    for line in text.splitlines():  # every COPY source exists in the repository
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"


def _documented_commands(text: str) -> list[list[str]]:
    """Every ``torchrun ...`` (or ``python -m elastic_kit.run ...``) command in a
    docstring or markdown (with \\ continuations)."""
    joined = re.sub(r"\\\\?\n\s*", " ", text)  # main.py's docstring has "\\\n"
    cmds = []
    for line in joined.splitlines():
        for start in ("torchrun ", "python -m elastic_kit.run "):
            if start in line and SCRIPT in line:
                cmds.append(shlex.split(line[line.index(start):]))
                break
    return cmds


@pytest.mark.parametrize("doc", ["main.py", "README.md"])
def test_documented_torchrun_commands_parse(doc: str) -> None:
    cmds = _documented_commands((EXAMPLE / doc).read_text())
    assert len(cmds) >= 4, f"{doc}: expected single-node, fault-tolerant, elastic and etcd commands"
    seen = set()
    forked = False
    for cmd in cmds:
        tr, _ = split_launch(cmd)
        seen.add((tr.nnodes, tr.rdzv_backend))
        forked |= tr.start_method == "fork" and bool(tr.run_path)
    assert ("1:4", "etcd-v2") in seen and any(n == "2" for n, _ in seen)
    if doc == "README.md":
        assert forked, "the fast-restart command (--start-method=fork --run-path) is missing"
    for cmd in cmds:  # every multi-node command restarts fast
        tr, args = split_launch(cmd)
        if not tr.standalone:
            assert rdzv_conf(tr) == FAST_RDZV, f"--rdzv-conf={tr.rdzv_conf} in {cmd}"
        _check_batch_divides(args, *_node_range(tr.nnodes), int(tr.nproc_per_node))


def test_top_level_readme_commands_parse_and_restart_fast() -> None:
    cmds = _documented_commands((ROOT / "README.md").read_text())
    assert len(cmds) >= 2, "expected the fixed-size and the elastic command"
    nnodes = set()
    for cmd in cmds:
        tr, args = split_launch(cmd)
        nnodes.add(tr.nnodes)
        if not tr.standalone:  # a single-node run has no rendezvous to tune
            assert rdzv_conf(tr) == FAST_RDZV, f"--rdzv-conf={tr.rdzv_conf} in {cmd}"
        _check_batch_divides(args, *_node_range(tr.nnodes), int(tr.nproc_per_node))
    assert "1:4" in nnodes, "the elastic command is missing"


def test_fast_rdzv_keys_are_read_by_torchs_dynamic_rendezvous() -> None:
    """The keys exist: torch's handler turns them into its own settings."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class _Backend:  # only what create_handler reads before any network access
        name = "test"

        def get_state(self) -> None:
            return None

    params = RendezvousParameters("c10d", "127.0.0.1:1", "run", 1, 2, **FAST_RDZV)
    handler = create_handler(object(), _Backend(), params)  # type: ignore[arg-type]
    settings = handler.settings
    assert settings.timeout.join.total_seconds() == 300
    assert settings.timeout.last_call.total_seconds() == 1
    assert settings.keep_alive_interval.total_seconds() == 1
    assert settings.keep_alive_max_attempt == 3


def test_a_renamed_flag_is_caught() -> None:
    with pytest.raises(_ParseError, match="--checkpoint-directory"):
        split_launch(["torchrun", "--nproc-per-node=1", SCRIPT, "--checkpoint-directory=x", "d"])
    with pytest.raises(_ParseError):
        split_launch(["torchrun", "--nprocs-per-node=1", SCRIPT, "d"])
