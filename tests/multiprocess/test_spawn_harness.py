"""The test harness's own reporting: a rank's report is not lost when it comes after
the grace :func:`spawn_multi_process` gives the survivors of a killed rank.

Regression: a survivor that reported its error more than 3 s after a peer was
SIGKILLed (a loaded machine) was reported as "exited without a result", hiding the
error the test expected.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic_kit.testing import MultiProcessError, spawn_multi_process


def _one_killed_one_late(late_s: float, fail: bool) -> str:
    rank = int(os.environ["RANK"])
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(late_s)  # past the grace after rank 1's death, well within the joins
    if fail:
        raise ValueError("rank 0 reports late")
    return "late result"


def test_a_survivors_late_error_is_reported_as_that_error() -> None:
    with pytest.raises(MultiProcessError) as exc:
        spawn_multi_process(2, _one_killed_one_late, 4.5, True, timeout=60)
    assert exc.value.first_rank == 0
    assert list(exc.value.failures) == [0]
    assert exc.value.failures[0].strip().splitlines()[-1] == "ValueError: rank 0 reports late"


def test_a_survivors_late_result_still_names_only_the_killed_rank() -> None:
    with pytest.raises(RuntimeError, match=r"ranks \[1\] exited without a result "
                                           r"\(exit codes \{1: -9\}\)"):
        spawn_multi_process(2, _one_killed_one_late, 4.5, False, timeout=60)
