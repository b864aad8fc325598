"""``python -m elastic_kit.run``: torchrun, with slow imports done once in the agent.

Usage: ``python -m elastic_kit.run [--preload MODULE[,MODULE...]] <torchrun options> script ...``

Every torchrun option works as with ``torchrun``. Before the agent starts, this imports
``torch._dynamo`` and the ``--preload`` modules into the agent process. Why it pays
with ``--start-method=fork --run-path`` (workers forked from the agent):

- A worker's first ``optimizer.step()`` imports ``torch._dynamo`` (torch's optimizers
  check whether they are being compiled), about 1.5-3 s on a 2-core machine, after
  every restart. A forked worker inherits the agent's modules, so the import is done.
- When a forked worker dies, the agent logs the failure with its traceback, and torch's
  log formatter imports ``torch._dynamo`` to format it: 2-3 s between the failure and
  the restart, measured in the recovery benchmark, on plain ``torchrun``.
- ``--preload torchvision`` (or the script's other heavy imports) saves each forked
  worker that import too.

With torchrun's default start method (new worker processes) the agent's imports are
not inherited; the launcher then only spares the agent the failure-log import.

A node that leaves on purpose (a preemption notice) has its agent leave the
rendezvous at once, so the nodes that stay restart without waiting for its
keep-alives to lapse (see :mod:`elastic_kit.health._agent_leave`).

Forked workers can use CUDA only if the agent never asked the CUDA runtime anything
before forking them: torchrun's launch config probes ``torch.cuda.is_available()``
(to decide on its default NUMA binding; through ``torch.accelerator`` on torch 2.14),
which calls ``cudaGetDeviceCount``; torch then marks every process forked afterwards
as a bad fork ("Cannot re-initialize CUDA in forked subprocess"), and the driver could
not be used there anyway. This launcher sets
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (unless already set): torch's documented switch
that answers availability and device counts from NVML, which leaves the process
fork-safe. The workers inherit it; where NVML cannot count the devices (no GPU, or MIG
device names), torch falls back to the CUDA runtime, and CUDA in forked workers stays
unavailable.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

__all__ = ["main", "split_preload"]

#: Imported into the agent whatever ``--preload`` says.
DEFAULT_PRELOAD = ("torch._dynamo",)

#: torch's switch for CUDA checks through NVML, which do not poison forks.
FORK_SAFE_CUDA_CHECK = ("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def split_preload(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(modules, torchrun argv)``: the leading ``--preload`` options taken off.

    Only options before the first torchrun option count, so a script's own
    ``--preload`` argument is left alone.

    Raises:
        ValueError: ``--preload`` without a value, or an empty module name.
    """
    argv = list(argv)
    modules: list[str] = []
    while argv and (argv[0] == "--preload" or argv[0].startswith("--preload=")):
        opt = argv.pop(0)
        if opt == "--preload":
            if not argv:
                raise ValueError("--preload needs a value: --preload MODULE[,MODULE...]")
            value = argv.pop(0)
        else:
            value = opt.split("=", 1)[1]
        names = [n.strip() for n in value.split(",")]
        if not all(names):
            raise ValueError(f"--preload {value!r}: expected MODULE[,MODULE...] (no empty names)")
        modules += names
    return modules, argv


def main(argv: Sequence[str] | None = None) -> None:
    """Import the preloads, then run torchrun's ``main`` with the remaining arguments."""
    os.environ.setdefault(*FORK_SAFE_CUDA_CHECK)
    try:
        modules, rest = split_preload(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"python -m elastic_kit.run: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for name in (*DEFAULT_PRELOAD, *modules):
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"python -m elastic_kit.run: --preload: cannot import {name!r}: {e}",
                  file=sys.stderr)
            raise SystemExit(2) from None
    from torch.distributed.run import main as torchrun_main

    from elastic_kit.health import install_agent_leave

    install_agent_leave()  # a planned leave takes this node out of the rendezvous at once
    torchrun_main(rest)


if __name__ == "__main__":
    main()
