"""torchrun stops a worker with ``killpg``: its DataLoader workers get the signal too.
They died of it (torch's C-level SIGTERM handler), and the training process's SIGCHLD
handler raised "DataLoader worker ... is killed by signal" before the step at which
the checkpointer saves and exits: the stop's checkpoint was lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elastic_kit.store import CheckpointStore

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)

_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from torch.utils.data import DataLoader, TensorDataset
    import elastic_kit as ek

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4000, 8), torch.randn(4000))
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = ek.ElasticDistributedSampler(data)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    state = ek.TrainState(model, opt, sampler=sampler)
    ckpt = ek.Checkpointer(state, sys.argv[1], every_steps=1000, snapshot_every=0)
    for epoch in range(ckpt.restore(), 1):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = ((model(x).squeeze(-1) - y) ** 2 * ckpt.sample_weights(len(x))).sum()
            opt.zero_grad(); loss.backward(); opt.step()
            time.sleep(0.05)
            ckpt.step(len(x))
            print("step", state.step, flush=True)
        ckpt.end_epoch()
    ckpt.close()
""")


@pytest.mark.parametrize("sig,each", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                      (signal.SIGTERM, True)],
                         ids=["SIGTERM-killpg", "SIGINT-killpg", "SIGTERM-every-process"])
def test_a_stop_signal_to_the_process_group_saves_with_loader_workers(
        tmp_path: Path, sig: signal.Signals, each: bool) -> None:
    """``killpg`` is torchrun's way; a signal to every process of the job (SLURM's
    ``--signal`` without ``B:``) reaches the loader workers one by one."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCHELASTIC_RUN_ID": "job"}  # under torchrun: SIGINT saves too
    proc = subprocess.Popen([sys.executable, str(script), str(ckpt)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # as torchrun starts its workers
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "step 15":
                break
        else:
            pytest.fail(f"no step 15: {proc.wait(60)} {proc.stderr.read()[-3000:]}")
        if each:
            import psutil

            for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children()]:
                p.send_signal(sig)
        else:
            os.killpg(proc.pid, sig)  # what torchrun's agent does
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert "killed by signal" not in err
    steps = [i.step for i in CheckpointStore(str(ckpt)).list()]
    assert len(steps) == 1 and steps[0] >= 15, (steps, err[-3000:])


_FAILING = textwrap.dedent("""
    import sys, tempfile, torch
    from torch.utils.data import DataLoader, TensorDataset
    import elastic_kit as ek

    def main():
        data = TensorDataset(torch.randn(400, 8), torch.randn(400))
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = ek.ElasticDistributedSampler(data)
        loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2,
                            persistent_workers=True)
        state = ek.TrainState(model, opt, sampler=sampler)
        ckpt = ek.Checkpointer(state, sys.argv[1], every_steps=1000, snapshot_every=0)
        for epoch in range(ckpt.restore(), 1):
            sampler.set_epoch(epoch)
            for x, y in loader:
                model(x).sum().backward(); opt.step(); opt.zero_grad()
                ckpt.step(len(x))
                if state.step == 5:
                    raise RuntimeError("a bug in the training step")

    main()
""")


def test_a_failing_script_with_persistent_loader_workers_exits(tmp_path: Path) -> None:
    """At exit, multiprocessing ends its daemon children with SIGTERM and joins them:
    loader workers that ignored SIGTERM (to survive torchrun's killpg) were never
    ended, and the failed worker never exited, so torchrun never restarted the job."""
    script = tmp_path / "train.py"
    script.write_text(_FAILING)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], env=env,
                              capture_output=True, text=True, timeout=120,
                              start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the failing script did not exit: {e.stderr!r:.3000}")
    assert done.returncode == 1 and "a bug in the training step" in done.stderr


def _run_script(tmp_path: Path, source: str, *, timeout: float) -> subprocess.CompletedProcess:
    """Run ``source`` as a training script (its checkpoint store under ``tmp_path``)."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=timeout)


_PDEATHSIG = textwrap.dedent("""
    import ctypes, sys, torch
    from torch.utils.data import DataLoader, Dataset
    import elastic_kit as ek

    class DeathSignal(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            got = ctypes.c_int(-1)
            ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)  # PR_GET_PDEATHSIG
            return got.value

    model = torch.nn.Linear(1, 1)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = ek.Checkpointer(state, sys.argv[1], snapshot_every=0)
    ckpt.restore()
    print(sorted(set(DataLoader(DeathSignal(), batch_size=1, num_workers=2).__iter__()
                     .__next__().tolist() + [x for b in DataLoader(
                         DeathSignal(), batch_size=2, num_workers=2) for x in b.tolist()])))
    ckpt.close()
""")


def test_a_loader_worker_dies_with_the_training_process(tmp_path: Path) -> None:
    """A loader worker that no longer dies of torchrun's signal with its parent held
    copies of the parent's process-group sockets: a killed rank's connections stayed
    open, and its peers waited in their collective, until torch's watchdog noticed
    the parent gone (up to 5 s). The kernel now kills it with its parent."""
    import signal as signals

    done = _run_script(tmp_path, _PDEATHSIG, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"[{int(signals.SIGKILL)}]"


_HELPERS = textwrap.dedent("""
    import os, subprocess, sys, threading, time, torch
    from torch.utils.data import DataLoader, Dataset
    import elastic_kit as ek

    def blocked(pid):
        with open(f"/proc/{pid}/status") as f:
            line = next(l for l in f if l.startswith("SigBlk:"))
        return int(line.split()[1], 16) & ((1 << 14) | (1 << 1) | (1 << 0))  # TERM INT HUP

    class Helpers(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            # a helper process, as a dataset decoding through ffmpeg starts one
            p = subprocess.Popen(["sleep", "30"])
            forked = os.fork()
            if forked == 0:
                os._exit(3 if blocked(os.getpid()) else 0)
            _, status = os.waitpid(forked, 0)
            seen = blocked(p.pid)
            p.terminate()
            p.wait(timeout=20)
            return torch.tensor([bool(blocked(os.getpid())), seen, os.waitstatus_to_exitcode(
                status), p.returncode])

    model = torch.nn.Linear(1, 1)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = ek.Checkpointer(state, sys.argv[1], snapshot_every=0)
    ckpt.restore()
    print("main", [b.tolist() for b in DataLoader(Helpers(), batch_size=None, num_workers=1)])
    # an iterator made on a thread that then ends: its workers must outlive the thread
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("it", iter(DataLoader(
        list(range(64)), batch_size=4, num_workers=2))))
    t.start(); t.join(); time.sleep(1)
    print("thread", sum(int(b.sum()) for b in box["it"]))
    ckpt.close()
""")


def test_processes_a_loader_worker_starts_take_the_stop_signals(tmp_path: Path) -> None:
    """The worker blocks SIGTERM, SIGINT and SIGHUP, and a blocked mask survives fork
    and exec: a helper process it started could not be stopped by SIGTERM (torchrun's
    ``killpg`` included) and outlived the job. And the kernel's parent-death signal is
    tied to the thread that forked: workers of an iterator made on a thread that then
    ended were killed with it."""
    done = _run_script(tmp_path, _HELPERS, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    # the worker blocks them; neither its subprocess nor its fork does; terminate() works
    assert lines[-2] == f"main {[[1, 0, 0, -int(signal.SIGTERM)]] * 2}", done.stdout
    assert lines[-1] == f"thread {sum(range(64))}", done.stdout + done.stderr[-3000:]
