"""The fork launch for the torchrun tests whose subject is not how a worker starts.

``python -m elastic_kit.run --start-method=fork --run-path script.py`` forks each
worker from its agent, which imported torch and ``torch._dynamo`` already (see
docs/launching.md): a worker then starts without importing them again. On the 2-core
CI machine, where the suite is CPU-bound on worker starts, that halves the CPU of a
test that restarts its group a few times (measured with every run of the module
forked: 77 -> 49 CPU-seconds for the own-loop example's module, 90 -> 46 for the
snapshot redo module, 40 -> 21 for the resumed-augmentation one).

The default start (a new interpreter per worker, what ``torchrun script.py`` does)
keeps its coverage: the scenarios (tests/torchrun/scenarios), the ImageNet example's
torchrun tests, and the reference runs of the modules that use this, which stay on
plain torchrun. The fork launch's own behaviour is tested in test_run_launcher.py.

Not for a job of 1:N nodes that must start with two: ``elastic_kit.run``'s agent takes
longer to start (it imports ``torch._dynamo`` before torchrun runs), so under the
suite's load the first agent's round may close alone before the second agent arrives
(seen in CI: the FSDP example's 1:3 and 1:2 jobs began at world size 1).
"""

from __future__ import annotations

from typing import Any

__all__ = ["FORK_LAUNCH"]

#: ``LocalCluster(..., **FORK_LAUNCH)``
FORK_LAUNCH: dict[str, Any] = {
    "launcher": "elastic_kit.run",
    "torchrun_args": ("--start-method=fork", "--run-path"),
}
