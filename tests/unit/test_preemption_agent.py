"""The agent's side of the notice signals: a scheduler's SIGUSR1 reaches the torchrun
agent too (SLURM's ``--signal`` signals every process of the step), whose default
action is to die; ``python -m elastic_kit.run`` ignores the notice signals in its agent
before any worker starts, and its workers inherit that until their watcher catches
them. No process is started: the dispositions are this one's, restored after."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator

import pytest

from elastic_kit.health import PreemptionWatcher
from elastic_kit.run import _ignore_notice_signals

_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGXCPU)


@pytest.fixture(autouse=True)
def _dispositions_restored() -> Iterator[None]:
    before = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_the_notice_signals_are_ignored_and_what_they_replaced_is_returned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_KIT_PREEMPTION_SIGNALS", raising=False)
    assert _ignore_notice_signals() == {signal.SIGUSR1: signal.SIG_DFL}
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # the leave signal's own
    monkeypatch.setenv("ELASTIC_KIT_PREEMPTION_SIGNALS", "USR1,XCPU")
    assert _ignore_notice_signals() == {signal.SIGUSR1: signal.SIG_IGN,
                                       signal.SIGXCPU: signal.SIG_DFL}
    assert signal.getsignal(signal.SIGXCPU) == signal.SIG_IGN
    monkeypatch.setenv("ELASTIC_KIT_PREEMPTION_SIGNALS", "USR2")
    with pytest.raises(ValueError, match="SIGUSR2"):
        _ignore_notice_signals()


def test_a_worker_that_starts_ignoring_the_signal_catches_it_then_ignores_it_again() -> None:
    """What a worker of the launcher inherits: the watcher installs its handler over an
    ignored disposition, and its close gives the ignored one back (the worker is
    leaving or exiting: a late notice must not kill it mid-write)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    notices: list[str] = []
    watcher = PreemptionWatcher(notices.append, cloud=None, signals=(signal.SIGUSR1,)).start()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
    finally:
        watcher.close()
    assert notices == ["signal SIGUSR1"]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGUSR1)  # ignored: this process lives on
    time.sleep(0.05)
    assert notices == ["signal SIGUSR1"]


@pytest.mark.parametrize("setting, ignored", [(None, True), ("USR1,BOGUS", False)])
def test_the_launchers_agent_ignores_the_notice_signal_before_torchrun_starts(
        setting: str | None, ignored: bool, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.run

    import elastic_kit.run as launcher

    if setting is None:
        monkeypatch.delenv("ELASTIC_KIT_PREEMPTION_SIGNALS", raising=False)
    else:
        monkeypatch.setenv("ELASTIC_KIT_PREEMPTION_SIGNALS", setting)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    seen: dict[str, Any] = {}

    def torchrun_main(argv: list[str]) -> None:
        seen["argv"] = argv
        seen["SIGUSR1"] = signal.getsignal(signal.SIGUSR1)
        seen["SIGUSR2"] = signal.getsignal(signal.SIGUSR2)

    monkeypatch.setattr(torch.distributed.run, "main", torchrun_main)
    monkeypatch.setattr(launcher, "DEFAULT_PRELOAD", ())
    for name in ("_worker_start", "install_agent_leave", "install_rendezvous_poll",
                 "install_rendezvous_close"):
        monkeypatch.setattr(launcher, name, lambda *a: None)  # the agent's other set-up
    launcher.main(["--nnodes=1", "train.py"])
    assert seen["argv"] == ["--nnodes=1", "train.py"]
    assert seen["SIGUSR1"] == (signal.SIG_IGN if ignored else signal.SIG_DFL)
    assert seen["SIGUSR2"] == signal.SIG_DFL
    err = capsys.readouterr().err
    assert ("SIGBOGUS" in err) == (not ignored)
