"""A fake cloud metadata service on 127.0.0.1 that announces a preemption on cue.

It answers the three endpoints :mod:`elastic_kit.health` reads, as the real services
do, headers included (GCE's ``Metadata-Flavor: Google``, AWS's IMDSv2 session token,
Azure's ``Metadata: true``; a request without them gets the real service's refusal).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeMetadataServer"]


class FakeMetadataServer:
    """A metadata service for ``cloud`` (``gce``, ``aws`` or ``azure``) on 127.0.0.1.

    Point the code under test at :attr:`url` (``ELASTIC_KIT_METADATA_URL``, with
    ``ELASTIC_KIT_CLOUD=<cloud>``); :meth:`announce` makes it report a preemption.
    :attr:`requests` counts the requests it answered, :attr:`refused` those it
    refused for a missing header or token.
    """

    def __init__(self, cloud: str) -> None:
        if cloud not in ("gce", "aws", "azure"):
            raise ValueError(f"cloud={cloud!r}: expected 'gce', 'aws' or 'azure'")
        self.cloud = cloud
        self.requests = 0
        self.refused = 0
        self._announced_at: float | None = None
        self._lead_s = 30.0
        self._tokens: set[str] = set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_PUT(self) -> None:
                server._answer(self, "PUT")

            def do_GET(self) -> None:
                server._answer(self, "GET")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="fake-metadata")

    def start(self) -> FakeMetadataServer:
        self._thread.start()
        return self

    def announce(self, lead_s: float = 30.0) -> None:
        """Report, from now on, that this instance goes away in ``lead_s`` seconds."""
        self._lead_s, self._announced_at = lead_s, time.time()

    def _reply(self, h: BaseHTTPRequestHandler, status: int, body: bytes = b"",
               refused: bool = False) -> None:
        if refused:
            self.refused += 1
        else:
            self.requests += 1
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _answer(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path, announced = h.path, self._announced_at is not None
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                             time.gmtime((self._announced_at or 0) + self._lead_s))
        if self.cloud == "gce" and method == "GET" and path.startswith(
                "/computeMetadata/v1/instance/preempted"):
            if h.headers.get("Metadata-Flavor") != "Google":
                return self._reply(h, 403, refused=True)
            return self._reply(h, 200, b"TRUE" if announced else b"FALSE")
        if self.cloud == "aws" and method == "PUT" and path == "/latest/api/token":
            if not h.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self._reply(h, 400, refused=True)
            token = secrets.token_hex(16)
            self._tokens.add(token)
            return self._reply(h, 200, token.encode())
        if self.cloud == "aws" and method == "GET" and path.startswith("/latest/meta-data/"):
            if h.headers.get("X-aws-ec2-metadata-token") not in self._tokens:
                return self._reply(h, 401, refused=True)
            if path == "/latest/meta-data/spot/instance-action" and announced:
                return self._reply(h, 200, json.dumps({"action": "terminate",
                                                       "time": when}).encode())
            return self._reply(h, 404)
        if self.cloud == "azure" and method == "GET" and path.startswith(
                "/metadata/instance/compute/name"):
            if h.headers.get("Metadata") != "true":
                return self._reply(h, 400, refused=True)
            return self._reply(h, 200, b"vm0")  # the VM the events below name
        if self.cloud == "azure" and method == "GET" and path.startswith(
                "/metadata/scheduledevents"):
            if h.headers.get("Metadata") != "true":
                return self._reply(h, 400, refused=True)
            events = [{"EventId": "e1", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                       "Resources": ["vm0"], "EventStatus": "Scheduled",
                       "NotBefore": when}] if announced else []
            return self._reply(h, 200, json.dumps({"DocumentIncarnation": 1,
                                                   "Events": events}).encode())
        return self._reply(h, 404)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeMetadataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
