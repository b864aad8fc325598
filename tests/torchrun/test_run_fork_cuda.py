"""Workers forked by ``python -m elastic_kit.run --start-method=fork --run-path`` can
initialise CUDA: the agent never asks the CUDA runtime anything before forking them.

torchrun's launch config calls ``torch.cuda.is_available()``; by default that is
``cudaGetDeviceCount``, after which torch marks every forked child as a bad fork
("Cannot re-initialize CUDA in forked subprocess" at the child's first CUDA call).
torch records that mark on any machine, GPU or not, so it is checked here on the CPU:
the agent runs with NVML made to report eight devices (what a GPU machine's NVML does;
this machine has no NVML; eight, not the two workers, so that torchrun applies no NUMA
binding), and each worker reports ``torch.cuda._is_in_bad_fork()``.
The real CUDA run is in ``tests/gpu/test_gpu_examples.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# The agent: NVML "sees" eight GPUs, then the launcher under test runs.
AGENT = """
import sys
import torch
torch.cuda._device_count_nvml = lambda: 8
launcher = sys.argv[1]
if launcher == "elastic_kit.run":
    from elastic_kit.run import main
else:
    from torch.distributed.run import main
main(sys.argv[2:])
"""

WORKER = """
import json, os, sys
import torch
out = {"bad_fork": torch.cuda._is_in_bad_fork(),
       "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
       "forked": "torch._dynamo" in sys.modules}
with open(os.path.join(os.path.dirname(__file__), f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
"""


def _forked_workers(tmp_path: Path, launcher: str, *, env_extra: dict[str, str] | None = None
                    ) -> list[dict[str, object]]:
    script = tmp_path / "report.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items()
           if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-c", AGENT, launcher, "--standalone", "--nproc-per-node=2",
         "--start-method=fork", "--run-path", str(script)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(300)
def test_elastic_kit_run_forks_workers_that_may_initialise_cuda(tmp_path: Path) -> None:
    out = _forked_workers(tmp_path, "elastic_kit.run")
    # forked from the agent (which imported torch._dynamo), and not marked as bad forks
    assert out == [{"bad_fork": False, "nvml_check": "1", "forked": True}] * 2


@pytest.mark.timeout(300)
def test_plain_torchrun_poisons_forked_workers_unless_nvml_check_is_set(tmp_path: Path) -> None:
    """What the launcher works around (if torch changes this, the workaround may go)."""
    plain = _forked_workers(tmp_path, "torch.distributed.run")
    assert [r["bad_fork"] for r in plain] == [True, True]
    nvml = _forked_workers(tmp_path, "torch.distributed.run",
                           env_extra={"PYTORCH_NVML_BASED_CUDA_CHECK": "1"})
    assert [r["bad_fork"] for r in nvml] == [False, False]
