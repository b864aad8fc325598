"""Conventions shared by the benchmark scripts (not part of the library).

Every ``benchmarks/bench_*.py``:

- runs with one command from the repository root, e.g.
  ``.venv/bin/python benchmarks/bench_checkpoint.py``;
- measures its baseline in the same run, interleaved with the candidate;
- accepts ``--quick`` (a reduced run, < 2 minutes) and, where a smoke test uses it,
  ``--smoke`` (a tiny run, < 20 s, numbers meaningless);
- prints as its LAST line one JSON object with the figures and ratios, including
  ``load_avg_1m`` (the machine is often shared: say how busy it was);
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


def parser(doc: str | None, *, smoke: bool = False) -> argparse.ArgumentParser:
    """An ArgumentParser with the common ``--quick`` / ``--smoke`` / ``--results`` options."""
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    p.add_argument("--quick", action="store_true", help="reduced run, under two minutes")
    if smoke:
        p.add_argument("--smoke", action="store_true",
                       help="tiny run for the smoke test (seconds; numbers meaningless)")
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
