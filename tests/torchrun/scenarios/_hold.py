"""A test-controlled hold point at the end of a training step, for the torchrun scenarios.

A scenario that injects a fault "while the job runs at world size W, after step N"
must not race the training: on a loaded machine the run can reach its end between
the test seeing an event and acting on it. With a hold configured, every rank stops
at the end of the same step (``on_step_end`` runs on every rank after each optimizer
step, so no rank is left waiting in a collective) until the test releases it:

- ``EK_TEST_HOLD_DIR``: the hold's directory (no hold when unset). Each held rank
  writes ``held-rank<R>`` (JSON: step, world_size, pid) there; the test creates
  ``release`` to let every rank go on. A directory holds once: with ``release``
  present nobody holds, so the groups torchrun restarts afterwards train freely.
- ``EK_TEST_HOLD_AT_STEP``: hold at the first step end with ``step >=`` this (default 1).
- ``EK_TEST_HOLD_GROUP_STEPS``: ... and once this process (this worker group) has done
  at least this many steps (default 1): with ``--checkpoint-every 2``, 3 steps mean
  the group has started a checkpoint of its own, which commits during the hold.
- ``EK_TEST_HOLD_WORLD_SIZE``: hold only in a group of this many ranks.

A SIGTERM (torchrun stopping the group), or a SIGINT (torchrun interrupted, passing
Ctrl-C on), ends a rank's hold at once: the rank writes ``sigterm-rank<R>`` (with the
signal's number) and passes the signal on to the handler that was installed (the
library's), which then stops training as it would without the hold.

``tests/train_script.py`` calls :func:`hold_point` from its ``on_step_end``. Any other script built
on ``elastic_kit.ElasticLoop`` (the ImageNet example) is run through this file,
``python _hold.py SCRIPT ARGS...``: it chains :func:`hold_point` after the script's own
``on_step_end`` and runs SCRIPT as ``__main__``.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any


_steps_done = 0  # steps this process (one worker group) has finished


def hold_point(step: int, world_size: int, rank: int | None = None) -> None:
    """Block at the end of ``step`` while the configured hold applies (see the module doc)."""
    global _steps_done
    _steps_done += 1
    root = os.environ.get("EK_TEST_HOLD_DIR")
    if not root:
        return
    d = Path(root)
    release = d / "release"
    want_world = os.environ.get("EK_TEST_HOLD_WORLD_SIZE")
    if (release.exists() or step < int(os.environ.get("EK_TEST_HOLD_AT_STEP", "1"))
            or _steps_done < int(os.environ.get("EK_TEST_HOLD_GROUP_STEPS", "1"))
            or (want_world is not None and world_size != int(want_world))):
        return
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    terminated = threading.Event()
    watched = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in watched}
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        terminated.set()
        received.append(signum)
        handler = previous[signal.Signals(signum)]
        if callable(handler):
            handler(signum, frame)

    for sig in watched:
        signal.signal(sig, on_signal)
    try:
        _write_json(d / f"held-rank{rank}", {"step": step, "world_size": world_size,
                                             "pid": os.getpid()})
        while not release.exists() and not terminated.is_set():
            time.sleep(0.02)
        if terminated.is_set():
            _write_json(d / f"sigterm-rank{rank}", {"step": step, "world_size": world_size,
                                                    "signal": received[0]})
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if terminated.is_set() and previous[signal.Signals(received[0])] in (signal.SIG_DFL, None):
        os.kill(os.getpid(), received[0])  # nobody handles it: its default action


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _chain_into_elastic_loop() -> None:
    import elastic_kit

    cls = elastic_kit.ElasticLoop
    original = cls.__init__

    def __init__(self: Any, *args: Any, on_step_end: Any = None, **kwargs: Any) -> None:
        def chained(state: Any, info: Any) -> None:
            if on_step_end is not None:
                on_step_end(state, info)
            hold_point(info.step, info.world_size)

        original(self, *args, on_step_end=chained, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: _hold.py SCRIPT [ARGS...]")
    script = sys.argv[1]
    if os.environ.get("EK_TEST_HOLD_DIR"):
        _chain_into_elastic_loop()
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")
