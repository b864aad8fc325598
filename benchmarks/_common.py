"""Conventions shared by the benchmark scripts (not part of the library).

Every ``benchmarks/bench_*.py``:

- runs with one command from the repository root, e.g.
  ``.venv/bin/python benchmarks/bench_checkpoint.py``;
- measures its baseline in the same run, interleaved with the candidate;
- accepts ``--quick`` (a reduced run, < 2 minutes) and ``--smoke`` (a tiny run in
  seconds, numbers meaningless, the same JSON keys: ``tests/tooling/test_benchmarks_smoke.py``
  runs every ``bench_*.py`` with it);
- prints as its LAST line one JSON object with the figures, ``baseline`` (what the
  candidate is compared with) and at least one ``ratio_*`` key (candidate against
  that baseline, measured in the same run), including ``load_avg_1m_start`` (taken
  before the measurement; :func:`emit` adds ``load_avg_1m_end``: the machine is often
  shared, say how busy it was);
- with ``--results FILE.md``, appends a section with the command, machine and that
  JSON to a results file (``benchmarks/results/<theme>_<machine>_<yyyymm>.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent


def parser(doc: str | None, *, smoke: bool = True) -> argparse.ArgumentParser:
    """An ArgumentParser with the common ``--quick`` / ``--smoke`` / ``--results`` options.

    ``--smoke`` is always offered (every script must support it); ``smoke`` is kept
    only so that callers written when it was optional still work.
    """
    del smoke
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    p.add_argument("--quick", action="store_true", help="reduced run, under two minutes")
    p.add_argument("--smoke", action="store_true",
                   help="tiny run for the smoke test (seconds; numbers meaningless, same keys)")
    p.add_argument("--results", default=None, metavar="FILE.md",
                   help="append the command, machine and JSON result to this markdown file")
    return p


def machine() -> dict[str, Any]:
    """What the numbers depend on, for the JSON line."""
    import torch

    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "mem_gib": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def load_avg() -> float:
    """1-minute load average (2 cores here: above ~2 means other jobs were running)."""
    return round(os.getloadavg()[0], 2)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> dict[str, float]:
    """min / median / max, rounded, for the JSON line."""
    return {"min": round(min(xs), 4), "median": round(statistics.median(xs), 4),
            "max": round(max(xs), 4)}


def mean_ci95(xs: Sequence[float]) -> dict[str, float | int] | None:
    """Mean of ``xs`` with a 95% confidence interval (normal approximation,
    1.96 standard errors): how far a figure made of noisy blocks can be trusted.
    None for fewer than two values."""
    if len(xs) < 2:
        return None
    m = statistics.fmean(xs)
    half = 1.96 * statistics.stdev(xs) / len(xs) ** 0.5
    return {"mean": round(m, 4), "low": round(m - half, 4), "high": round(m + half, 4),
            "n": len(xs)}


def emit(result: dict[str, Any], results_file: str | None = None) -> None:
    """Print ``result`` as the last line (JSON); optionally append it to a results file."""
    result = dict(result)
    result.setdefault("load_avg_1m_end", load_avg())
    line = json.dumps(result, sort_keys=False)
    if results_file:
        path = Path(results_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        cmd = " ".join(shlex.quote(a) for a in [".venv/bin/python",
                                                 os.path.relpath(sys.argv[0], ROOT),
                                                 *sys.argv[1:]])
        with open(path, "a") as f:
            f.write(f"\n### Run {time.strftime('%Y-%m-%d %H:%M')}\n\n    {cmd}\n\n"
                    f"```json\n{line}\n```\n")
    sys.stdout.flush()
    print(line, flush=True)


def plot_path(name: str) -> Path:
    """``benchmarks/results/<name>``, created if missing."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / name


def save_plot(fig: Any, name: str) -> str:
    """Save ``fig`` as ``benchmarks/results/<name>``; its path from the repository root."""
    out = plot_path(name)
    fig.savefig(out, dpi=110)
    return str(out.relative_to(ROOT))


def pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --- writing files the way the baselines need ----------------------------------------

# The store's own writeback call, so the same-strategy baseline cannot drift from it.
from elastic_kit.store._fs import start_writeback  # noqa: E402,F401


def aligned_buffer(nbytes: int, align: int = 1 << 12) -> Any:
    """A page-aligned, zero-filled anonymous mapping of ``nbytes`` rounded up to
    ``align`` (what ``O_DIRECT`` writes need: aligned address, length and offset)."""
    import mmap

    return mmap.mmap(-1, -(-nbytes // align) * align)


def write_o_direct(path: str, buf: Any, *, chunk: int = 8 << 20) -> bool:
    """Write all of ``buf`` (from :func:`aligned_buffer`) to a new file at ``path``
    with ``O_DIRECT`` in ``chunk``-byte pieces, then fsync; the page cache is
    bypassed, so this is what the device itself sustains (``dd oflag=direct
    conv=fsync bs=8M`` from Python, without dd's read of its input file).

    Returns False, writing nothing, where the filesystem refuses ``O_DIRECT`` at
    open or at the first write (some overlay filesystems, tmpfs on older kernels;
    recent kernels' tmpfs accepts it, and the "ceiling" is then a memory copy).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    if not getattr(os, "O_DIRECT", 0):
        return False
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        return False
    try:
        mv = memoryview(buf)
        try:
            for off in range(0, len(mv), chunk):
                piece = mv[off:off + chunk]
                done = 0
                while done < len(piece):
                    done += os.write(fd, piece[done:])
        except OSError:  # EINVAL: O_DIRECT accepted at open, refused at write
            return False
        os.fsync(fd)
        return True
    finally:
        os.close(fd)
