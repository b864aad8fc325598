"""A real S3-compatible server (moto) for tests, on 127.0.0.1, one per test session.

The server runs in a subprocess (``python -m moto.server``) on a free port, so the
code under test talks real HTTP through s3fs/botocore exactly as against AWS; no
boto call is patched in the test process. It is started at most once per pytest
session (lazily, by the first test that asks) and stopped at the end.

How to use it from another test module::

    # pytest puts tests/ on sys.path (rootdir-relative "prepend" import mode)
    from s3_server import s3_server, s3_bucket  # noqa: F401  (pytest fixtures)

    def test_something_on_s3(s3_bucket):
        url, storage_options = s3_bucket          # "s3://<fresh bucket>", s3fs options
        store = CheckpointStore(url + "/run", storage_options=storage_options)

``s3_server`` yields an :class:`S3Server` (``endpoint_url``, ``storage_options``,
``make_bucket()``); ``s3_bucket`` creates an empty bucket per test. Tests are skipped
(not failed) when moto or s3fs is not installed. Mark them ``@pytest.mark.s3``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest

from elastic_kit.testing import ReservedPort, reserve_port

__all__ = ["S3Server", "start_s3_server", "s3_server", "s3_bucket"]


@dataclass
class S3Server:
    """A running moto server: where it listens and the s3fs options to reach it."""

    endpoint_url: str
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    port: ReservedPort | None = field(default=None, repr=False)

    @property
    def storage_options(self) -> dict[str, Any]:
        """``storage_options`` for fsspec/s3fs (dummy credentials, this endpoint)."""
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            # every test gets a new bucket; never serve a listing cached earlier
            "use_listings_cache": False,
        }

    def make_bucket(self, prefix: str = "test") -> str:
        """Create a fresh bucket and return its name."""
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing",
                     ).create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        """Terminate the server process (idempotent)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.port is not None:
            self.port.close()
            self.port = None


def start_s3_server(timeout: float = 60.0) -> S3Server:
    """Start ``python -m moto.server`` on 127.0.0.1:<free port>; wait until it answers.

    The port is held until :meth:`S3Server.stop`: another test's server cannot take it
    while moto starts, nor answer in its place.
    """
    held = reserve_port()
    port = held.port
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    server = S3Server(f"http://127.0.0.1:{port}", proc, held)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"moto server exited with code {proc.returncode} before answering")
        try:
            urllib.request.urlopen(server.endpoint_url + "/moto-api/", timeout=1).close()
            return server
        except OSError:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"moto server on port {port} did not answer within {timeout}s")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the whole test session (skips if moto/s3fs are missing)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = start_s3_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> tuple[str, dict[str, Any]]:
    """``("s3://<new empty bucket>", storage_options)`` for one test."""
    return f"s3://{s3_server.make_bucket()}", s3_server.storage_options
