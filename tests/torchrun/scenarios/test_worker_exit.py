"""A worker that exits while a background thread still runs torch code exits with its own
status, not SIGABRT ("terminate called without an active exception").

Besides the two cases below, the exit handler that ``init_distributed`` registers waits
(boundedly) until no other thread is running, so that a backend thread the scheduler
has not yet run (a loaded machine) releases its work before shutdown begins.

Two such threads exist in a worker: the checkpoint store's background save, and the
process-group backend's own worker thread, which releases a collective's tensors a
moment after the caller saw the collective finish or fail (a peer died).

When a peer dies, the survivors' next collective raises and the exception ends the
worker; a script with its own loop does not necessarily reach ``store.close()``. If
the store's background save were still running torch code on a *daemon* thread when
the interpreter shuts down, that thread would be ended with ``pthread_exit`` as soon
as it tries to take the GIL again, and the forced unwind through torch's C++ frames
(the GIL release guard of ``torch.save``'s record writer is a noexcept destructor)
calls ``std::terminate``: the worker dies with "terminate called without an active
exception" (SIGABRT) instead of its own error, and the save it had started is lost.
The store must finish (or at least outlive) its in-flight write before interpreter
shutdown begins.

The child process makes interpreter shutdown take a second (an object whose
finalizer sleeps) so that the background write is certainly still going on then;
without that the window is a few milliseconds and the abort only happens under load.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

_REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def master_port():
    """A loopback port held for rank 0's store (bound in a child) until the test ends."""
    from elastic_kit.testing import reserve_port

    with reserve_port() as port:
        yield port.port

_CHILD = textwrap.dedent("""
    import sys, time
    import torch
    from elastic_kit import CheckpointStore

    class SlowShutdown:
        # Finalized during interpreter shutdown: keeps it going while the save writes.
        def __del__(self):
            time.sleep(1.0)

    _slow = SlowShutdown()
    store = CheckpointStore(sys.argv[1], keep_last=None)
    store.save({f"t{i}": torch.randn(2**20) for i in range(64)}, step=1, blocking=False)
    raise RuntimeError("collective failed: the peer is gone")  # store.close() never runs
""")


def test_error_with_a_background_save_in_flight_exits_with_the_error(tmp_path: Path) -> None:
    from elastic_kit import CheckpointStore

    url = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", _CHILD, url], capture_output=True, text=True,
                          timeout=300, cwd=_REPO, env={**_env(), "PYTHONFAULTHANDLER": "1"})
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "RuntimeError: collective failed: the peer is gone" in proc.stderr
    # Whatever was committed is complete: a save cut short never leaves a bad checkpoint.
    with CheckpointStore(url) as store:
        problems = [(s, p) for s, _, p in store.verify(deep=True) if p is not None]
    assert not problems, problems


_GLOO_CHILD = textwrap.dedent("""
    import atexit, os, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import elastic_kit as ek

    rank, d = int(os.environ["RANK"]), Path(sys.argv[1])
    ek.init_distributed(backend="gloo", timeout=timedelta(seconds=120))
    x = torch.ones(1000)
    dist.all_reduce(x)  # both ranks are up
    if rank == 0:
        while not (d / "rank1-exiting").exists():
            time.sleep(0.01)
        os._exit(0)  # the peer dies mid-collective, without a goodbye
    # Rank 1: a collective in flight that fails only once rank 0 is gone; Python drops
    # the tensor, so the backend thread holds the last reference to it. Then it exits.
    dist.all_reduce(x, async_op=True)
    del x

    def announce_and_keep_the_gil():
        # Runs first (atexit is last in, first out): rank 0 exits now, and the backend
        # thread, failing the collective, waits for the GIL to release the tensor
        # until interpreter shutdown has begun (a busy loop never hands the GIL over).
        (d / "rank1-exiting").touch()
        sys.setswitchinterval(600.0)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            pass

    atexit.register(announce_and_keep_the_gil)

    class SlowShutdown:
        # Finalized during interpreter shutdown: hands the GIL over there.
        def __del__(self, sleep=time.sleep):
            sleep(2.0)

    _slow = SlowShutdown()
    sys.exit(143)  # as after a SIGTERM checkpoint
""")


def test_exit_with_a_collective_in_flight_on_a_dead_peer_keeps_the_exit_status(
        tmp_path: Path, master_port: int) -> None:
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
           "WORLD_SIZE": "2", "PYTHONFAULTHANDLER": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_CHILD, str(tmp_path)], cwd=_REPO,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    err1 = outs[1][1]
    assert "terminate called" not in err1, err1[-3000:]
    assert procs[1].returncode == 143, (procs[1].returncode, err1[-3000:])
    assert procs[0].returncode == 0, outs[0][1][-3000:]


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(_REPO)}


_BUSY_CHILD = textwrap.dedent("""
    import hashlib, sys, threading
    from pathlib import Path
    import elastic_kit as ek

    ek.init_distributed(backend="gloo")
    marker = Path(sys.argv[1])
    data = bytes(32 * 2**20)  # about 0.1 s of hashing: inside the exit handler's bound

    def work():
        # Native work without the GIL (as a backend thread releasing a collective's
        # tensors), then a step that needs the GIL again.
        for _ in range(3):
            hashlib.sha256(data).digest()
        marker.write_text("done")

    threading.Thread(target=work, daemon=True).start()
    sys.exit(3)  # at once: the thread is still hashing when the interpreter exits
""")


def test_exit_lets_a_thread_busy_outside_the_gil_finish_first(tmp_path: Path,
                                                             master_port: int) -> None:
    """The exit handler waits (boundedly) until no other thread is running: a thread
    in native code at exit would otherwise be ended as soon as it asks for the GIL
    during interpreter shutdown, in the middle of whatever it was doing."""
    marker = tmp_path / "marker"
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
           "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", _BUSY_CHILD, str(marker)], cwd=_REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert marker.read_text() == "done"


def test_settle_waits_for_a_running_thread_and_is_bounded() -> None:
    import hashlib
    import threading
    import time

    from elastic_kit.distributed import _let_threads_settle

    data = bytes(64 * 2**20)
    finished: list[float] = []

    def work() -> None:
        for _ in range(4):
            hashlib.sha256(data).digest()
        finished.append(time.monotonic())

    t = threading.Thread(target=work)
    t.start()
    assert _let_threads_settle(30.0) is True
    settled = time.monotonic()
    assert finished and finished[0] <= settled
    t.join()

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            hashlib.sha256(data).digest()

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert _let_threads_settle(0.2) is False  # still running: gives up
    finally:
        stop.set()
        t.join()
