"""``python -m elastic_kit ls|verify|prune``: output and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from elastic_kit.store import CheckpointStore
from elastic_kit.store._manifest import PAYLOAD_NAME
from elastic_kit.cli import EXIT_CORRUPT, EXIT_OK, EXIT_USAGE, main


@pytest.fixture
def store_url(tmp_path) -> str:
    url = str(tmp_path / "ck")
    store = CheckpointStore(url, keep_last=None)
    for step in (10, 20, 30):
        store.save({"w": torch.full((1000,), float(step))}, step=step, metadata={"epoch": step // 10})
    store.close()
    return url


def _corrupt(url: str, step: int) -> None:
    path = f"{url}/step-{step:012d}/{PAYLOAD_NAME}"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_ls_lists_steps_sizes_times_and_status(store_url, capsys):
    assert main(["ls", store_url]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["STEP", "SIZE", "EPOCH", "TIME", "STATUS"]
    rows = [line.split() for line in out[1:]]
    assert [r[0] for r in rows] == ["10", "20", "30"]
    assert all(r[-1] == "ok" and r[2] == "KB" and "UTC" in r for r in rows)
    assert [r[3] for r in rows] == ["1", "2", "3"]


def test_ls_json_flags_an_incomplete_checkpoint(store_url, capsys):
    import os

    os.remove(f"{store_url}/step-{20:012d}/manifest.json")
    assert main(["ls", store_url, "--json"]) == EXIT_OK
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    status = {r["step"]: r["status"] for r in rows}
    assert status[10] == "ok" and status[30] == "ok"
    assert status[20].startswith("INVALID") and "manifest.json is missing" in status[20]


def test_verify_exit_0_when_intact_and_1_when_a_checkpoint_is_corrupt(store_url, capsys):
    assert main(["verify", store_url]) == EXIT_OK
    assert "3 ok, 0 corrupt" in capsys.readouterr().out
    _corrupt(store_url, 20)
    assert main(["verify", store_url]) == EXIT_CORRUPT
    out = capsys.readouterr().out
    assert "CORRUPT  step 20" in out and "xxh3_128" in out and "2 ok, 1 corrupt" in out
    assert main(["verify", store_url, "--step", "30"]) == EXIT_OK
    assert main(["verify", store_url, "--step", "99"]) == EXIT_USAGE


def test_prune_keeps_newest_k(store_url, capsys):
    assert main(["prune", store_url, "--keep", "2", "--dry-run"]) == EXIT_OK
    assert "would delete step 10" in capsys.readouterr().out
    assert [i.step for i in CheckpointStore(store_url).list()] == [10, 20, 30]
    assert main(["prune", store_url, "--keep", "1"]) == EXIT_OK
    assert "kept 1 checkpoint(s)" in capsys.readouterr().out
    assert [i.step for i in CheckpointStore(store_url).list()] == [30]
    assert main(["prune", store_url, "--keep", "0"]) == EXIT_USAGE


def test_usage_and_url_errors_exit_2(capsys):
    assert main(["ls", "nope://bucket/run"]) == EXIT_USAGE
    assert "unknown protocol 'nope'" in capsys.readouterr().err
    assert main(["ls", "memory://x", "--storage-options", "[1]"]) == EXIT_USAGE
    with pytest.raises(SystemExit) as e:
        main(["frobnicate", "x"])
    assert e.value.code == EXIT_USAGE


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out and "1  verify found" in out and "2  usage error" in out


def test_python_m_elastic_kit_exits_1_on_a_corrupt_store(store_url):
    _corrupt(store_url, 30)
    run = subprocess.run([sys.executable, "-m", "elastic_kit", "verify", store_url],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == EXIT_CORRUPT, run.stdout + run.stderr
    assert "CORRUPT  step 30" in run.stdout
