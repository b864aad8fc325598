"""Preemption notices: the cloud's metadata service and the scheduler's signal.

Most departures are announced: GCE Spot and preemptible VMs 30 s ahead (the
metadata server's ``instance/preempted`` turns ``TRUE``), AWS Spot 2 minutes ahead
(``spot/instance-action`` appears), Azure Spot 30 s ahead (a ``Preempt`` scheduled
event), SLURM ``--signal=USR1@60`` a chosen time ahead. A :class:`PreemptionWatcher`
turns any of these into one call of ``on_notice`` on this node, from which the
checkpointer makes a planned leave (see :mod:`elastic_kit.checkpointer`).

The metadata endpoints are read only where the host says it runs on that cloud (the
DMI strings the hypervisors set, or ``$ELASTIC_KIT_CLOUD``), from a daemon thread,
with a one-second timeout per request: training never waits for them, and a machine
elsewhere never sends a request to a link-local address. SIGTERM keeps its meaning
(save durably and exit: torchrun's restart notice, or a job being stopped for good).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any, Callable

__all__ = [
    "CLOUD_ENV", "CLOUDS", "METADATA_URL_ENV", "POLL_S", "PreemptionWatcher", "SIGNALS_ENV",
    "detect_cloud", "notice_from_metadata", "preemption_signals",
]

log = logging.getLogger(__name__)

#: ``gce``, ``aws``, ``azure`` or ``none``: which metadata service to poll (default:
#: what the DMI strings say).
CLOUD_ENV = "ELASTIC_KIT_CLOUD"
#: The metadata service's base URL (default: the cloud's own; tests point it at a
#: server on 127.0.0.1).
METADATA_URL_ENV = "ELASTIC_KIT_METADATA_URL"
#: Signals that announce a departure, comma-separated names (default ``USR1``,
#: SLURM's ``--signal``); empty: none.
SIGNALS_ENV = "ELASTIC_KIT_PREEMPTION_SIGNALS"
CLOUDS = ("gce", "aws", "azure")
#: Seconds between two reads of the metadata service (a 30 s notice leaves 28).
POLL_S = 2.0
_TIMEOUT_S = 1.0
_BASE = {"gce": "http://metadata.google.internal", "aws": "http://169.254.169.254",
         "azure": "http://169.254.169.254"}
_AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


def _dmi(name: str, root: str) -> str:
    try:
        return Path(root, name).read_text().strip()
    except OSError:
        return ""


def detect_cloud(*, dmi_root: str = "/sys/class/dmi/id") -> str | None:
    """The cloud this host runs on, from ``$ELASTIC_KIT_CLOUD`` or the DMI strings;
    None when it cannot tell (no metadata service is then ever asked)."""
    given = os.environ.get(CLOUD_ENV, "").strip().lower()
    if given:
        if given == "none":
            return None
        if given not in CLOUDS:
            raise ValueError(f"{CLOUD_ENV}={given!r}: expected one of {CLOUDS} or 'none'")
        return given
    if "Google Compute Engine" in _dmi("product_name", dmi_root):
        return "gce"
    if "Amazon EC2" in _dmi("sys_vendor", dmi_root) or "Amazon EC2" in _dmi("board_vendor", dmi_root):
        return "aws"
    if _dmi("chassis_asset_tag", dmi_root) == _AZURE_ASSET_TAG:
        return "azure"
    return None


def _get(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers, method=method)
    # never through a proxy: the metadata service is link-local
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=_TIMEOUT_S) as r:
            return r.status, r.read(1 << 16)
    except urllib.error.HTTPError as e:
        return e.code, b""


def notice_from_metadata(cloud: str, base: str | None = None) -> str | None:
    """Ask ``cloud``'s metadata service once; a description of the notice, or None.

    Raises OSError (and its subclasses) when the service does not answer.
    """
    base = (base or os.environ.get(METADATA_URL_ENV) or _BASE[cloud]).rstrip("/")
    if cloud == "gce":
        status, body = _get(f"{base}/computeMetadata/v1/instance/preempted",
                            {"Metadata-Flavor": "Google"})
        if status == 200 and body.strip().upper() == b"TRUE":
            return "GCE: instance/preempted is TRUE"
        return None
    if cloud == "aws":
        status, token = _get(f"{base}/latest/api/token",
                             {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, "PUT")
        headers = {"X-aws-ec2-metadata-token": token.decode()} if status == 200 else {}
        status, body = _get(f"{base}/latest/meta-data/spot/instance-action", headers)
        if status == 200:
            try:
                action = json.loads(body)
            except ValueError:
                action = {}
            return (f"AWS: spot/instance-action {action.get('action', '?')} at "
                    f"{action.get('time', '?')}")
        return None
    if cloud == "azure":
        status, body = _get(f"{base}/metadata/scheduledevents?api-version=2020-07-01",
                            {"Metadata": "true"})
        if status == 200:
            try:
                events = json.loads(body).get("Events", [])
            except (ValueError, AttributeError):
                events = []
            for ev in events if isinstance(events, list) else []:
                if isinstance(ev, dict) and ev.get("EventType") in ("Preempt", "Terminate"):
                    return (f"Azure: scheduled event {ev.get('EventType')} at "
                            f"{ev.get('NotBefore', '?')}")
        return None
    raise ValueError(f"cloud={cloud!r}: expected one of {CLOUDS}")


def preemption_signals() -> tuple[int, ...]:
    """The signals that announce a departure (``$ELASTIC_KIT_PREEMPTION_SIGNALS``)."""
    raw = os.environ.get(SIGNALS_ENV, "USR1")
    out = []
    for name in (n.strip().upper() for n in raw.split(",") if n.strip()):
        name = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal.Signals, name, None)
        if sig is None or sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{SIGNALS_ENV}={raw!r}: {name} is not a signal that can "
                             f"announce a departure (SIGTERM keeps its meaning)")
        out.append(int(sig))
    return tuple(out)


class PreemptionWatcher:
    """Calls ``on_notice(description)`` once, when this node is told it will go.

    Args:
        on_notice: called once, from the polling thread or a signal handler (so it
            should only set a flag).
        poll_metadata: poll the cloud's metadata service (one worker per node does).
        cloud: ``gce``, ``aws`` or ``azure`` (default :func:`detect_cloud`); nothing is
            polled when it is None.
        signals: the signals to catch (default :func:`preemption_signals`); handlers
            are installed only from the main thread and restored by :meth:`close`.
        poll_s: seconds between two reads of the metadata service.
    """

    def __init__(self, on_notice: Callable[[str], None], *, poll_metadata: bool = True,
                 cloud: Any = ..., signals: tuple[int, ...] | None = None,
                 poll_s: float = POLL_S) -> None:
        self._on_notice = on_notice
        self.cloud = detect_cloud() if cloud is ... else cloud
        self.signals = preemption_signals() if signals is None else tuple(signals)
        self.poll_s = poll_s
        self.notice: str | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._previous: dict[int, Any] = {}
        self._thread: threading.Thread | None = None
        self._failures = 0
        if poll_metadata and self.cloud is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True,
                                            name="ek-preemption-watch")

    def start(self) -> PreemptionWatcher:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if self._thread is not None:
            self._thread.start()
        return self

    def _notice(self, what: str) -> None:
        with self._lock:
            if self.notice is not None:
                return
            self.notice = what
        self._on_notice(what)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Never wait for the lock in a signal handler: a second signal arriving while
        # the first's handler holds it would wait forever on this very thread. Its
        # holder (that handler, or the metadata poll) is recording a notice already,
        # and the first notice is the one kept.
        if not self._lock.acquire(blocking=False):
            return
        what = f"signal {signal.Signals(signum).name}"
        try:
            if self.notice is not None:
                return
            self.notice = what
        finally:
            self._lock.release()
        self._on_notice(what)

    def _poll(self) -> None:
        assert self.cloud is not None
        while not self._closed.is_set():
            try:
                found = notice_from_metadata(self.cloud)
            except (OSError, ValueError) as e:
                self._failures += 1
                if self._failures in (1, 10, 100):
                    log.warning("the %s metadata service did not answer (%d times): %r",
                                self.cloud, self._failures, e)
            else:
                if found is not None:
                    self._notice(found)
                    return
            self._closed.wait(self.poll_s)

    def close(self) -> None:
        """Stop polling and restore the previous signal handlers. Safe to call twice."""
        self._closed.set()
        if threading.current_thread() is threading.main_thread():
            for sig, prev in self._previous.items():
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=2 * _TIMEOUT_S + 1)
