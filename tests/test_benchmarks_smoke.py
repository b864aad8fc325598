"""Keep the benchmark scripts from rotting: run one at a tiny size, parse the others.

The benchmarks themselves never run in the test suite (they take minutes and need
a quiet machine); ``--smoke`` runs them in seconds with meaningless numbers, and
these tests check only that ``bench_checkpoint.py --smoke`` finishes with the
expected keys and sane values in the JSON object on its last line (the conventions of
``benchmarks/_common.py``), and that every other script imports and offers ``--quick``.
``--smoke`` of the multi-process scripts (loop overhead, elastic curve) takes
15-45 s on a 2-core machine, too slow for this file; run them by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str, timeout: float = 120) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(BENCH / script), "--smoke", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last)


def test_bench_checkpoint_smoke(tmp_path: Path) -> None:
    res = _run("bench_checkpoint.py", "--dir", str(tmp_path))
    assert res["claim"] == "checkpoint_save"
    assert res["sizes_mb"] == [20]
    size = res["per_size"]["20"]
    for key in ("raw_write_fsync", "torch_save_fsync", "dcp_save", "ours_sync",
                "ours_sync_crc32", "ours_sync_sha256", "hash_only"):
        assert size["seconds"][key] > 0, key
    for key in ("ratio_ours_vs_raw", "ratio_ours_vs_torch_save", "ratio_ours_vs_dcp",
                "ratio_nonblocking_blocked_vs_sync", "ratio_copy_in_save_blocked_vs_sync"):
        assert 0 < res[key]["20"] < 100, key
    assert isinstance(res["load_avg_1m_end"], float)
    assert list(tmp_path.iterdir()) == []  # cleaned up


@pytest.mark.parametrize("script", ["bench_loop_overhead.py", "bench_elastic_curve.py",
                                    "bench_recovery.py", "bench_restore_broadcast.py",
                                    "bench_sampler.py"])
def test_other_benchmarks_parse_their_options(script: str) -> None:
    """The heavier scripts at least import and accept ``--quick`` (``--help`` exits 0)."""
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "--quick" in proc.stdout
