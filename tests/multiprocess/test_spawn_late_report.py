"""``spawn_multi_process`` reports a survivor's error that comes after its grace for
the other ranks (a rank killed, the survivor's exit work slow on a loaded machine):
the error, not "exited without a result", which hid what the survivor said."""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic_kit.testing import MultiProcessError, spawn_multi_process


def _one_killed_one_late(delay: float) -> None:
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(delay)  # past the 3 s the harness waits once a rank died
    raise ValueError("the survivor's own error")


def test_a_survivors_error_that_comes_late_is_reported() -> None:
    with pytest.raises(MultiProcessError, match="the survivor's own error"):
        spawn_multi_process(2, _one_killed_one_late, 4.0, timeout=60)
