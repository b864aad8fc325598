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

Azure delivers the scheduled events of every VM of an availability set or a scale
set's placement group to all of them: only an event whose ``Resources`` name this VM
(its instance metadata's ``compute/name``) is a notice for this node.

A scheduler's signal reaches every process of a job step, the torchrun agent
included, whose default action for SIGUSR1 is to die; ``python -m elastic_kit.run``
ignores the notice signals in its agent, and the workers inherit that until their
watcher catches them (and again after its :meth:`~PreemptionWatcher.close`, which
restores what it found).
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

from elastic_kit.health._agent_leave import LEAVE_SIGNAL

__all__ = [
    "CLOUD_ENV", "CLOUDS", "DMI_ROOT", "METADATA_URL_ENV", "POLL_S", "PreemptionWatcher",
    "SIGNALS_ENV", "azure_vm_name", "detect_cloud", "notice_from_metadata",
    "preemption_signals",
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
#: Where the kernel shows the DMI strings the hypervisor set.
DMI_ROOT = "/sys/class/dmi/id"
_TIMEOUT_S = 1.0
#: Seconds :meth:`PreemptionWatcher.close` waits for the polling thread (which may be
#: inside a request to a metadata service that hangs); it is a daemon, and a closed
#: watcher delivers no notice, so it is left to end by itself.
_CLOSE_WAIT_S = 0.1
_BASE = {"gce": "http://metadata.google.internal", "aws": "http://169.254.169.254",
         "azure": "http://169.254.169.254"}
_AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


def _dmi(name: str, root: str) -> str:
    try:
        return Path(root, name).read_text().strip()
    except OSError:
        return ""


def detect_cloud(*, dmi_root: str | None = None) -> str | None:
    """The cloud this host runs on, from ``$ELASTIC_KIT_CLOUD`` or the DMI strings
    under ``dmi_root`` (default :data:`DMI_ROOT`); None when it cannot tell (no
    metadata service is then ever asked).

    AWS's Nitro hosts say ``Amazon EC2`` in ``sys_vendor`` (or ``board_vendor``); its
    Xen-based instance types say ``Xen`` there, which is not checked: their ``amazon``
    BIOS version (``4.11.amazon``) is what tells them.
    """
    dmi_root = DMI_ROOT if dmi_root is None else dmi_root
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
    if "amazon" in _dmi("bios_version", dmi_root).lower():
        return "aws"  # a Xen-based instance type
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


def _base_url(cloud: str, base: str | None) -> str:
    return (base or os.environ.get(METADATA_URL_ENV) or _BASE[cloud]).rstrip("/")


def azure_vm_name(base: str | None = None) -> str | None:
    """This Azure VM's name, as its scheduled events name it (the instance metadata's
    ``compute/name``); None, with a warning, where the service does not tell it.

    Raises OSError (and its subclasses) when the service does not answer.
    """
    status, body = _get(f"{_base_url('azure', base)}/metadata/instance/compute/name"
                        "?api-version=2021-02-01&format=text", {"Metadata": "true"})
    name = body.decode(errors="replace").strip() if status == 200 else ""
    if not name:
        log.warning("the Azure instance metadata did not tell this VM's name (status %d, "
                    "%d bytes): every Preempt or Terminate event of its availability set "
                    "or placement group is taken for a notice to this node", status, len(body))
        return None
    return name


def _names(event: dict[str, Any], vm_name: str | None) -> bool:
    """Whether a scheduled event is this VM's: its ``Resources`` name it (any event,
    where this VM's name or the event's resources are unknown)."""
    resources = event.get("Resources")
    if vm_name is None or not isinstance(resources, list):
        return True
    # Azure's resource names are case-insensitive
    return any(isinstance(r, str) and r.strip().lower() == vm_name.lower() for r in resources)


def notice_from_metadata(cloud: str, base: str | None = None, *,
                         vm_name: Any = ...) -> str | None:
    """Ask ``cloud``'s metadata service once; a description of the notice, or None.

    ``vm_name`` (Azure only): the events of which VM are notices; by default
    :func:`azure_vm_name` asks the service; None: any VM's.

    Raises OSError (and its subclasses) when the service does not answer, and
    ``http.client.HTTPException`` when it answers something that is not HTTP.
    """
    base = _base_url(cloud, base)
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
        if vm_name is ...:
            vm_name = azure_vm_name(base)
        status, body = _get(f"{base}/metadata/scheduledevents?api-version=2020-07-01",
                            {"Metadata": "true"})
        if status == 200:
            try:
                events = json.loads(body).get("Events", [])
            except (ValueError, AttributeError):
                events = []
            for ev in events if isinstance(events, list) else []:
                if (isinstance(ev, dict) and ev.get("EventType") in ("Preempt", "Terminate")
                        and _names(ev, vm_name)):
                    return (f"Azure: scheduled event {ev.get('EventType')} at "
                            f"{ev.get('NotBefore', '?')}")
        return None
    raise ValueError(f"cloud={cloud!r}: expected one of {CLOUDS}")


def preemption_signals() -> tuple[int, ...]:
    """The signals that announce a departure (``$ELASTIC_KIT_PREEMPTION_SIGNALS``).

    Raises:
        ValueError: a name that is no signal, SIGTERM, SIGKILL, SIGSTOP, or the
            launcher's leave signal (:data:`~elastic_kit.health.LEAVE_SIGNAL`).
    """
    raw = os.environ.get(SIGNALS_ENV, "USR1")
    out = []
    for name in (n.strip().upper() for n in raw.split(",") if n.strip()):
        name = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal.Signals, name, None)
        if sig is None or sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{SIGNALS_ENV}={raw!r}: {name} is not a signal that can "
                             f"announce a departure (SIGTERM keeps its meaning)")
        if sig == LEAVE_SIGNAL:
            raise ValueError(f"{SIGNALS_ENV}={raw!r}: {name} is the signal that makes the "
                             f"agent of python -m elastic_kit.run leave the rendezvous; "
                             f"expected another signal")
        out.append(int(sig))
    return tuple(out)


class PreemptionWatcher:
    """Calls ``on_notice(description)`` once, when this node is told it will go.

    Args:
        on_notice: called once, from the polling thread or a signal handler (so it
            should only set a flag), and never once :meth:`close` returned.
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
        self._vm_name: Any = ...  # Azure: this VM's name, once read (None: unknown)
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

    def _notice(self, what: str, *, wait: bool = True) -> None:
        # on_notice is called under the lock that close() takes once it set _closed:
        # a notice is delivered before close() returns, or never.
        if not self._lock.acquire(blocking=wait):
            return
        try:
            if self.notice is not None or self._closed.is_set():
                return
            self.notice = what
            self._on_notice(what)
        finally:
            self._lock.release()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._closed.is_set():
            self._pass_on(signum, frame)
            return
        # Never wait for the lock in a signal handler: a second signal arriving while
        # the first's handler holds it would wait forever on this very thread. Its
        # holder (that handler, or the metadata poll) is recording a notice already,
        # and the first notice is the one kept.
        self._notice(f"signal {signal.Signals(signum).name}", wait=False)

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        """A signal caught after a :meth:`close` from another thread, which could not
        restore the handlers: restore them now (this runs in the main thread) and give
        the signal what the previous handler would have done."""
        if signum not in self._previous:
            return  # restored already
        if signal.getsignal(signum) != self._on_signal:
            # the script's handler, set since and kept at close, chained to this one:
            # what a chain to the handler this one replaced does
            previous = self._previous[signum]
            if callable(previous):
                previous(signum, frame)
            return
        previous = self._previous.pop(signum)
        previous = signal.SIG_DFL if previous is None else previous
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # its default action, now that it is restored

    def _poll(self) -> None:
        assert self.cloud is not None
        while not self._closed.is_set():
            try:
                if self.cloud == "azure" and self._vm_name is ...:
                    self._vm_name = azure_vm_name()  # once: it never changes
                found = notice_from_metadata(self.cloud, vm_name=self._vm_name)
            except Exception as e:  # no reply, a malformed one (not HTTP): ask again
                self._failures += 1
                if self._failures in (1, 10, 100):
                    log.warning("the %s metadata service did not answer or answered "
                                "something unreadable (%d times): %r", self.cloud,
                                self._failures, e)
            else:
                if found is not None:
                    self._notice(found)
                    return
            self._closed.wait(self.poll_s)

    def close(self) -> None:
        """Stop polling and restore the previous signal handlers. Safe to call twice.

        No notice is delivered once it returned. Called from another thread than the
        main one, which alone can set handlers, it leaves them installed: a later
        close from the main thread restores them, and a signal caught meanwhile
        restores its own and gets what the previous handler would have done.
        It waits at most a tenth of a second for the polling thread, which may be
        inside a request to a metadata service that hangs: a daemon, it ends by itself.
        """
        self._closed.set()
        # whoever holds the lock is delivering a notice: let it finish before returning
        # (bounded: on the main thread, a signal handler may have interrupted it)
        if self._lock.acquire(timeout=1.0):
            self._lock.release()
        if threading.current_thread() is threading.main_thread():
            # one at a time: a signal arriving meanwhile restores its own (_pass_on)
            for sig, prev in list(self._previous.items()):
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
                    self._previous.pop(sig, None)
                # else the script's, set since: kept, and if it chains here the signal
                # is passed on to what this watcher replaced (see _pass_on)
        elif self._previous:
            log.warning("the preemption watcher was closed off the main thread: the "
                        "handlers of %s stay installed until a signal arrives or it is "
                        "closed from the main thread",
                        ", ".join(signal.Signals(s).name for s in list(self._previous)))
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=_CLOSE_WAIT_S)
