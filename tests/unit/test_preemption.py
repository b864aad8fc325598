"""Preemption notices: each cloud's metadata service (a real HTTP server on
127.0.0.1 answering like GCE's, AWS's and Azure's), the cloud detection that decides
whether any is asked, and the scheduler's signal."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from elastic_kit.health import (
    LEAVE_SIGNAL, PreemptionWatcher, detect_cloud, notice_from_metadata, preemption_signals,
)
from elastic_kit.health import _preemption
from elastic_kit.testing import FakeMetadataServer


@pytest.mark.parametrize("cloud, expected", [
    ("gce", "GCE: instance/preempted is TRUE"),
    ("aws", "AWS: spot/instance-action terminate at "),
    ("azure", "Azure: scheduled event Preempt at "),
])
def test_each_clouds_notice_is_read_with_the_headers_it_requires(cloud: str, expected: str) -> None:
    with FakeMetadataServer(cloud) as server:
        assert notice_from_metadata(cloud, server.url) is None
        server.announce(lead_s=30)
        notice = notice_from_metadata(cloud, server.url)
        assert notice is not None and notice.startswith(expected)
        assert server.refused == 0 and server.requests >= 2


def test_an_unanswering_metadata_service_raises_within_its_timeout() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(OSError):
        notice_from_metadata("gce", f"http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 5


def _dmi(where: Path, **files: str) -> str:
    where.mkdir()
    for name, text in files.items():
        (where / name).write_text(text + "\n")
    return str(where)


def test_the_cloud_is_told_by_the_dmi_strings_or_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_KIT_CLOUD", raising=False)
    assert detect_cloud(dmi_root=_dmi(tmp_path / "a", product_name="Google Compute Engine")) == "gce"
    assert detect_cloud(dmi_root=_dmi(tmp_path / "b", sys_vendor="Amazon EC2")) == "aws"
    assert detect_cloud(dmi_root=_dmi(
        tmp_path / "c", chassis_asset_tag="7783-7084-3265-9085-8269-3286-77")) == "azure"
    assert detect_cloud(dmi_root=_dmi(tmp_path / "d", product_name="Standard PC (Q35)")) is None
    monkeypatch.setenv("ELASTIC_KIT_CLOUD", "none")
    assert detect_cloud(dmi_root=str(tmp_path / "a")) is None
    monkeypatch.setenv("ELASTIC_KIT_CLOUD", "AWS")
    assert detect_cloud(dmi_root=str(tmp_path / "d")) == "aws"
    monkeypatch.setenv("ELASTIC_KIT_CLOUD", "ibm")
    with pytest.raises(ValueError, match="ELASTIC_KIT_CLOUD='ibm'"):
        detect_cloud()


def test_aws_is_told_on_its_xen_based_instance_types_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Xen-based EC2 types (m4, c4, t2...) say ``Xen`` as their system vendor; their BIOS
    version names Amazon."""
    monkeypatch.delenv("ELASTIC_KIT_CLOUD", raising=False)
    xen_aws = _dmi(tmp_path / "xen_aws", sys_vendor="Xen", product_name="HVM domU",
                   bios_version="4.11.amazon")
    assert detect_cloud(dmi_root=xen_aws) == "aws"
    monkeypatch.setattr(_preemption, "DMI_ROOT", xen_aws)  # the default root
    assert detect_cloud() == "aws"
    xen_elsewhere = _dmi(tmp_path / "xen", sys_vendor="Xen", product_name="HVM domU",
                         bios_version="4.2.5")
    assert detect_cloud(dmi_root=xen_elsewhere) is None


def test_the_watcher_reports_an_announcement_once_and_polls_nothing_off_cloud(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeMetadataServer("aws") as server:
        monkeypatch.setenv("ELASTIC_KIT_METADATA_URL", server.url)
        notices: list[str] = []
        got = threading.Event()
        watcher = PreemptionWatcher(lambda what: (notices.append(what), got.set()),
                                    cloud="aws", signals=(), poll_s=0.05).start()
        time.sleep(0.3)
        assert notices == [] and server.requests >= 2  # polled, nothing announced
        server.announce(lead_s=120)
        assert got.wait(10.0)
        watcher.close()
        assert len(notices) == 1 and notices[0].startswith("AWS: spot/instance-action terminate")
        asked = server.requests
        off_cloud = PreemptionWatcher(notices.append, cloud=None, signals=(), poll_s=0.05).start()
        time.sleep(0.2)
        off_cloud.close()
        assert server.requests == asked  # a host that is on no known cloud asks nobody


def test_the_schedulers_signal_is_a_notice_and_its_handler_is_restored() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    notices: list[str] = []
    watcher = PreemptionWatcher(notices.append, cloud=None, signals=(signal.SIGUSR1,)).start()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second notice changes nothing
        time.sleep(0.05)
    finally:
        watcher.close()
    assert notices == ["signal SIGUSR1"] and watcher.notice == "signal SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) == before


def test_the_notice_signals_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_KIT_PREEMPTION_SIGNALS", raising=False)
    assert preemption_signals() == (signal.SIGUSR1,)
    monkeypatch.setenv("ELASTIC_KIT_PREEMPTION_SIGNALS", "xcpu, SIGUSR1")
    assert preemption_signals() == (signal.SIGXCPU, signal.SIGUSR1)
    monkeypatch.setenv("ELASTIC_KIT_PREEMPTION_SIGNALS", "")
    assert preemption_signals() == ()
    monkeypatch.setenv("ELASTIC_KIT_PREEMPTION_SIGNALS", "TERM")
    with pytest.raises(ValueError, match="SIGTERM"):
        preemption_signals()
    monkeypatch.setenv("ELASTIC_KIT_PREEMPTION_SIGNALS", "BOGUS")
    with pytest.raises(ValueError, match="SIGBOGUS"):
        preemption_signals()


def test_the_launchers_leave_signal_is_refused_as_a_notice_signal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGUSR2 is the signal with which a leaving worker makes the launcher's agent
    leave the rendezvous: it cannot announce a departure too."""
    assert LEAVE_SIGNAL == signal.SIGUSR2
    for raw in ("USR1,USR2", "sigusr2", " usr2 "):
        monkeypatch.setenv("ELASTIC_KIT_PREEMPTION_SIGNALS", raw)
        with pytest.raises(ValueError) as refused:
            preemption_signals()
        assert f"ELASTIC_KIT_PREEMPTION_SIGNALS={raw!r}" in str(refused.value)
        assert "SIGUSR2" in str(refused.value) and "leave the rendezvous" in str(refused.value)


def test_a_signal_handled_while_the_notice_is_being_recorded_never_waits() -> None:
    """A second signal arriving while the first's handler records the notice (it holds
    the watcher's lock on the same thread) must return, not wait for that lock: the
    first notice is the one kept."""
    import signal as _signal
    import threading as _threading

    from elastic_kit.health._preemption import PreemptionWatcher

    seen: list[str] = []
    w = PreemptionWatcher(seen.append, poll_metadata=False, cloud=None, signals=())
    w._lock.acquire()                   # the first handler, mid-way
    try:
        second = _threading.Thread(target=w._on_signal, args=(_signal.SIGUSR1, None))
        second.start()
        second.join(timeout=10)
        assert not second.is_alive(), "the handler waited for the lock"
    finally:
        w._lock.release()
    assert seen == [] and w.notice is None
    w._on_signal(_signal.SIGTERM, None)
    w._on_signal(_signal.SIGUSR1, None)
    assert seen == ["signal SIGTERM"] and w.notice == "signal SIGTERM"
