"""Run a training script with a test-controlled hold after one optimizer step.

``python _gpu_hold.py SCRIPT ARGS...`` runs SCRIPT as ``__main__``. A GPU trains the
examples' small runs in seconds, so a test that must SIGKILL a worker in the middle of
an epoch cannot race it: with ``EK_GPU_HOLD_DIR`` set, the worker stops after its first
step ``>= EK_GPU_HOLD_AT_STEP``, writes ``held`` (the step) into that directory and
waits until the test creates ``release`` there. With ``release`` present nobody holds,
so the group torchrun restarts afterwards trains freely.

It hooks the two public ways a script reports a step: ``Checkpointer.step`` (a script
with its own loop) and ``ElasticLoop``'s ``on_step_end``. For one rank only (a hold on
several ranks would have to agree on the step).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import elastic_kit as ek


def _hold(step: int) -> None:
    root = os.environ.get("EK_GPU_HOLD_DIR")
    if not root or step < int(os.environ.get("EK_GPU_HOLD_AT_STEP", "1")):
        return
    d = Path(root)
    if (d / "release").exists():
        return
    (d / "held").write_text(str(step))
    while not (d / "release").exists():
        time.sleep(0.05)


def _install() -> None:
    checkpointer_step = ek.Checkpointer.step

    def step(self: Any, n: int) -> None:
        checkpointer_step(self, n)
        _hold(self.state.step)

    ek.Checkpointer.step = step  # type: ignore[method-assign]

    loop_init = ek.ElasticLoop.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        loop_init(self, *args, **kwargs)
        own = self.on_step_end

        def on_step_end(state: Any, info: Any) -> None:
            if own is not None:
                own(state, info)
            _hold(state.step)

        self.on_step_end = on_step_end

    ek.ElasticLoop.__init__ = init  # type: ignore[method-assign]


if __name__ == "__main__":
    _install()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
