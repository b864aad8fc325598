"""Azure's scheduled events: every VM of an availability set or a scale set's placement
group sees the events of all of them, so only an event naming this VM is its notice (a
real HTTP server on 127.0.0.1 answering like Azure's instance metadata service)."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

from elastic_kit.health import PreemptionWatcher, notice_from_metadata


class _AzureMetadata:
    """Azure's instance metadata for the VM ``name`` (None: it does not tell the name),
    whose scheduled events are :attr:`events`."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.events: list[dict[str, Any]] = []
        self.name_reads = 0
        self.refused = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server._answer(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        status, body = 404, b""
        if h.headers.get("Metadata") != "true":
            self.refused += 1
            status = 400
        elif h.path.startswith("/metadata/instance/compute/name?") and "format=text" in h.path:
            self.name_reads += 1
            if self.name is not None:
                status, body = 200, self.name.encode()
        elif h.path.startswith("/metadata/scheduledevents?"):
            status, body = 200, json.dumps({"DocumentIncarnation": 2,
                                            "Events": self.events}).encode()
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def schedule(self, event_type: str, *vms: str) -> None:
        self.events.append({"EventId": f"e{len(self.events)}", "EventType": event_type,
                            "ResourceType": "VirtualMachine", "Resources": list(vms),
                            "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2026 18:29:47 GMT"})

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def azure(request: pytest.FixtureRequest) -> Iterator[_AzureMetadata]:
    server = _AzureMetadata(getattr(request, "param", "vm-b"))
    yield server
    server.close()


def test_another_vms_scheduled_preemption_is_no_notice_for_this_one(
        azure: _AzureMetadata) -> None:
    azure.schedule("Preempt", "vm-a")                # a neighbour in the placement group
    azure.schedule("Terminate", "vm-c", "VM-D")
    assert notice_from_metadata("azure", azure.url) is None
    azure.schedule("Freeze", "vm-b")                 # this VM's, but no departure
    assert notice_from_metadata("azure", azure.url) is None
    azure.schedule("Preempt", "vm-a", "VM-B")        # this VM's (names ignore case)
    assert notice_from_metadata("azure", azure.url) == (
        "Azure: scheduled event Preempt at Mon, 19 Sep 2026 18:29:47 GMT")
    assert notice_from_metadata("azure", azure.url, vm_name="vm-z") is None  # given
    assert notice_from_metadata("azure", azure.url, vm_name="vm-c") == (
        "Azure: scheduled event Terminate at Mon, 19 Sep 2026 18:29:47 GMT")
    assert azure.refused == 0


def test_the_watcher_reads_the_vm_name_once_and_waits_for_its_own_event(
        azure: _AzureMetadata, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_KIT_METADATA_URL", azure.url)
    notices: list[str] = []
    got = threading.Event()
    azure.schedule("Preempt", "vm-a")
    watcher = PreemptionWatcher(lambda what: (notices.append(what), got.set()),
                                cloud="azure", signals=(), poll_s=0.02).start()
    try:
        time.sleep(0.3)
        assert notices == []                         # polled: only vm-a's event
        azure.schedule("Terminate", "vm-b")
        assert got.wait(10.0)
    finally:
        watcher.close()
    assert notices == ["Azure: scheduled event Terminate at Mon, 19 Sep 2026 18:29:47 GMT"]
    assert azure.name_reads == 1


@pytest.mark.parametrize("azure", [None], indirect=True)
def test_without_the_vm_name_every_departure_event_is_a_notice_with_a_warning(
        azure: _AzureMetadata, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_KIT_METADATA_URL", azure.url)
    notices: list[str] = []
    got = threading.Event()
    azure.schedule("Freeze", "vm-a")
    with caplog.at_level(logging.WARNING, logger="elastic_kit.health._preemption"):
        watcher = PreemptionWatcher(lambda what: (notices.append(what), got.set()),
                                    cloud="azure", signals=(), poll_s=0.02).start()
        try:
            time.sleep(0.3)
            assert notices == []
            azure.schedule("Preempt", "vm-a")
            assert got.wait(10.0)
        finally:
            watcher.close()
    assert notices == ["Azure: scheduled event Preempt at Mon, 19 Sep 2026 18:29:47 GMT"]
    said = [r.getMessage() for r in caplog.records if "did not tell this VM's name" in r.getMessage()]
    assert len(said) == 1 and "status 404" in said[0]
    assert azure.name_reads == 1
