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

pytestmark = pytest.mark.timeout(120)  # a harness that hangs fails here, not the suite


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


def _killed_half_way_through_its_report() -> str:
    """Rank 1 dies having sent half its report (holding the queue's write lock, as a
    rank killed inside ``put()`` does); rank 0's report then cannot be sent at all."""
    import gc
    import struct
    from multiprocessing.queues import SimpleQueue

    if int(os.environ["RANK"]) == 1:
        q = next(o for o in gc.get_objects() if isinstance(o, SimpleQueue))
        fd = q._writer.fileno()

        def half(buf: bytes) -> None:  # called with the write lock held, as put() does
            os.write(fd, struct.pack("!i", len(buf)) + bytes(buf[:10]))
            os.kill(os.getpid(), signal.SIGKILL)

        q._writer.send_bytes = half
    return "x" * 100


def test_a_rank_killed_half_way_through_its_report_does_not_hang_the_caller() -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[(0, )?1\] exited without a result"):
        spawn_multi_process(2, _killed_half_way_through_its_report, timeout=30)
    assert time.monotonic() - started < 30
