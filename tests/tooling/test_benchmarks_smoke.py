"""Keep the benchmark scripts from rotting: run every one with ``--smoke``.

Every ``benchmarks/bench_*.py`` (the glob, so a new script is covered without editing
this file) runs with ``--smoke``: tiny sizes, seconds, meaningless numbers, but the
same code path and the same JSON keys as a real run. The test checks the conventions
of ``benchmarks/_common.py``: exit status 0, and a last line that is a JSON object
naming its claim and holding at least one ``ratio_*`` figure against the baseline
measured in the same run, plus the headline ratio keys listed below for each known
script. Numbers are not checked against thresholds (no clocks in tests).

Scripts that launch real torchrun agents are marked ``integration`` (they take a
few minutes on a 2-core machine: the baseline waits its 30 s last call).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.snapshot_tree import left_in

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))

# Scripts that start torchrun agents (LocalCluster): slow, marked integration.
TORCHRUN = {"bench_recovery.py", "bench_goodput.py"}

# Headline ratio keys each known script must print, also under --smoke.
HEADLINE: dict[str, tuple[str, ...]] = {
    "bench_checkpoint.py": (
        "ratio_ours_vs_o_direct", "ratio_ours_vs_o_direct_beside_copy_hash",
        "ratio_o_direct_beside_copy_hash_vs_o_direct", "ratio_ours_vs_buffered_writeback",
        "ratio_ours_vs_raw",
        "ratio_ours_vs_torch_save", "ratio_ours_vs_torch_save_nocrc",
        "ratio_torch_save_crc_cost", "ratio_ours_vs_dcp",
        "ratio_nonblocking_blocked_vs_sync"),
    "bench_loop_overhead.py": (
        "ratio_ek_vs_plain", "ratio_ek_ckpt_vs_plain", "ratio_ek_ckpt_vs_plain_ckpt",
        "ckpt_lost_s_per_save", "ckpt_blocked_s_per_save", "ckpt_lost_fraction_of_cost_period"),
    "bench_recovery.py": (
        "ratio_total_baseline_vs_ours", "ratio_regain_baseline_vs_ours"),
    "bench_elastic_curve.py": (
        "ratio_param_drift_ours_vs_naive", "ratio_loss_drift_ours_vs_naive"),
    "bench_restore_broadcast.py": ("ratio_time_ours_vs_blob", "ratio_peak_rss_vs_state_ours"),
    "bench_sampler.py": ("ratio_time_ours_vs_torch", "ratio_mem_ours_vs_torch"),
    "bench_sharded.py": ("ratio_save_ours_vs_dcp", "ratio_load_ours_vs_dcp",
                         "ratio_written_per_rank_ours_vs_dcp",
                         "ratio_background_blocked_vs_dcp_save",
                         "ratio_save_peak_rss_vs_shard_ours", "ratio_load_peak_rss_vs_shard_ours"),
    "bench_sharded_snapshot.py": ("ratio_taken_vs_memory_copy", "ratio_restore_memory_vs_dcp",
                                  "ratio_restore_memory_vs_ours_disk"),
    "bench_snapshot.py": (
        "ratio_ek_vs_plain", "ratio_blocked_vs_copy", "ratio_max_blocked_vs_two_copies",
        "ratio_dcp_vs_plain", "ratio_restore_vs_h2d", "restart"),
    "bench_slot_reuse.py": ("ratio_reused_vs_new", "ratio_reused_vs_copy"),
    "bench_small_tensors.py": ("ratio_ours_vs_torch_save", "ratio_ours_vs_torch_save_cpu",
                               "ratio_nonblocking_blocked_vs_torch_save",
                               "ratio_ours_load_vs_torch_load"),
    "bench_snapshot_take.py": ("ratio_ek_vs_state_dict", "ratio_ek_vs_copy",
                               "ratio_ek_with_slowdown_vs_copy", "step_slowdown_ms"),
    "bench_wrap_ddp.py": ("ratio_wrap_vs_plain_ddp",),
    "bench_goodput.py": (
        "ratio_goodput_snapshots_vs_pytorch_elastic", "ratio_goodput_snapshots_vs_durable",
        "ratio_goodput_durable_vs_pytorch_elastic"),
}


def _params() -> list[Any]:
    return [pytest.param(s, marks=[pytest.mark.integration] if s in TORCHRUN else [], id=s)
            for s in SCRIPTS]


def _numbers(value: Any) -> list[float]:
    """The numbers in a ratio value: a number, or a dict of them (per size, per event)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    return []


def run_smoke(script: str, *args: str, timeout: float = 600,
              env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script --smoke``; the JSON object on its last line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    proc = subprocess.run([sys.executable, str(BENCH / script), "--smoke", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{script} --smoke failed:\n{proc.stderr[-6000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing"
    result = json.loads(lines[-1])
    assert isinstance(result, dict), f"{script}: the last line is not a JSON object"
    return result


def test_the_glob_finds_every_known_benchmark() -> None:
    assert set(HEADLINE) <= set(SCRIPTS)


@pytest.mark.parametrize("script", _params())
def test_benchmark_smoke_prints_a_ratio_against_its_baseline(script: str, tmp_path: Path) -> None:
    extra = ("--dir", str(tmp_path)) if script == "bench_checkpoint.py" else ()
    shm = tmp_path / "shm"  # where the torchrun jobs' snapshots would go by default
    shm.mkdir()
    res = run_smoke(script, *extra, env_extra={"ELASTIC_KIT_SNAPSHOT_DIR": str(shm)})
    assert isinstance(res.get("claim"), str) and res["claim"], "no claim named"
    ratios = {k: v for k, v in res.items() if k.startswith("ratio")}
    assert ratios, f"{script}: no ratio_* key in {sorted(res)}"
    numbers = [x for v in ratios.values() for x in _numbers(v)]
    assert numbers, f"{script}: no ratio holds a number: {ratios}"
    assert all(math.isfinite(x) and x >= 0 for x in numbers), ratios
    for key in HEADLINE.get(script, ()):
        assert key in res, f"{script}: headline key {key!r} missing"
    assert isinstance(res["load_avg_1m_start"], float)  # every script, as documented
    assert isinstance(res["load_avg_1m_end"], float)
    # jobs stopped mid-run do not remove their snapshots: the script must
    leftovers = left_in(shm)
    assert leftovers == [], leftovers
    if script == "bench_checkpoint.py":
        assert list(tmp_path.iterdir()) == [shm]  # cleaned up
        size = res["per_size"]["20"]
        for method, seconds in size["seconds"].items():
            assert seconds is None or seconds > 0, method
        # the device ceiling is measured where the file system allows O_DIRECT
        assert (size["seconds"]["o_direct"] is None) == (not size["o_direct_supported"])
        assert ((size["seconds"]["o_direct_beside_copy_hash"] is None)
                == (not size["o_direct_supported"]))
    if script == "bench_loop_overhead.py":
        # without --cost-period the lost seconds are a share of one save period
        assert res["cost_period_steps"] == res["ckpt_every_steps"]
        assert res["ckpt_lost_fraction_of_cost_period"] == pytest.approx(
            res["ckpt_lost_s_per_save"] / res["cost_period_s"], rel=0.02, abs=1e-3)


def test_recovery_benchmark_uses_the_documented_rdzv_conf() -> None:
    """bench_recovery.py measures ``ours`` with exactly the README's --rdzv-conf."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_recovery
    finally:
        sys.path.remove(str(BENCH))
    readme = (ROOT / "README.md").read_text()
    assert f"--rdzv-conf={bench_recovery.RDZV_CONF}" in readme
    assert bench_recovery.VARIANTS["ours"]["rdzv_conf"] == bench_recovery.RDZV_CONF
    assert bench_recovery.VARIANTS["baseline"]["rdzv_conf"] == ""  # torchrun's defaults


def _common_module() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import _common
    finally:
        sys.path.remove(str(BENCH))
    return _common


def test_o_direct_baseline_writes_exactly_the_given_bytes(tmp_path: Path) -> None:
    common = _common_module()
    data = os.urandom(3 * 4096 + 100)
    buf = common.aligned_buffer(len(data))
    assert len(buf) == 4 * 4096  # rounded up to whole pages
    buf[:len(data)] = data
    path = str(tmp_path / "direct.bin")
    if common.write_o_direct(path, buf):
        written = Path(path).read_bytes()
        assert written[:len(data)] == data and written[len(data):] == bytes(len(buf) - len(data))
    else:  # the file system refuses O_DIRECT (older kernels' tmpfs): nothing is left behind
        assert not Path(path).exists() or Path(path).stat().st_size == 0
    buf.close()


def test_writeback_hint_is_accepted_on_linux(tmp_path: Path) -> None:
    common = _common_module()
    with open(tmp_path / "f.bin", "wb", buffering=0) as f:
        f.write(b"x" * (1 << 20))
        started = common.start_writeback(f.fileno(), 0, 1 << 20)
    assert started is sys.platform.startswith("linux")
