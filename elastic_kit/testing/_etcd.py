"""A throw-away etcd (v2 API) for torchrun's ``etcd-v2`` rendezvous in tests and demos."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO

from elastic_kit.testing._proc import die_with_this_process, wait_for
from elastic_kit.testing._ports import ReservedPort, reserve_port

__all__ = ["EtcdServer"]

log = logging.getLogger(__name__)


class EtcdServer:
    """A throw-away etcd with the v2 API, on free loopback ports and a temporary data dir.

    For torchrun's ``etcd-v2`` rendezvous backend, where the rendezvous does not live
    inside an agent, so that any agent (the first one too) may die.

    Both ports are held (:func:`reserve_port`) from before etcd starts until
    :meth:`stop`, so no other socket can take them while etcd starts, and its health
    check cannot be answered by another test's etcd.

    Args:
        binary: the etcd executable (looked up on PATH).
        data_dir: where etcd keeps its data; a temporary directory (removed on stop)
            when None.
        log_path: file for etcd's output; inside the data dir's parent when None.
        start_timeout: seconds to wait for etcd to answer ``/health``.

    Example::

        with EtcdServer() as etcd:
            cluster = LocalCluster([...], rdzv_backend="etcd-v2",
                                   rdzv_endpoint=etcd.endpoint, log_dir=...)
    """

    def __init__(self, *, binary: str = "etcd", data_dir: str | Path | None = None,
                 log_path: str | Path | None = None, start_timeout: float = 30.0) -> None:
        self.binary = binary
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.log_path = Path(log_path) if log_path is not None else None
        self.start_timeout = start_timeout
        self.client_port = 0
        self.peer_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._tmp: str | None = None
        self._ports: list[ReservedPort] = []

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT`` of the client API (torchrun's ``--rdzv-endpoint``)."""
        if self.proc is None:
            raise RuntimeError("EtcdServer is not started; call start() first")
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> EtcdServer:
        """Start etcd and wait until it reports healthy."""
        if self.proc is not None:
            raise RuntimeError(f"EtcdServer already running on {self.endpoint}")
        exe = shutil.which(self.binary)
        if exe is None:
            raise FileNotFoundError(
                f"etcd binary {self.binary!r} not found on PATH; install it with "
                "`apt-get install etcd-server` (Debian/Ubuntu) or from "
                "https://github.com/etcd-io/etcd/releases"
            )
        if self.data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="elastic_kit_etcd_")
            self.data_dir = Path(self._tmp) / "data"
        log_path = self.log_path or self.data_dir.parent / "etcd.log"
        self._ports = [reserve_port(), reserve_port()]  # two held ports always differ
        self.client_port, self.peer_port = (p.port for p in self._ports)
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            exe, "--enable-v2=true",
            "--name", "elastic-kit-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"elastic-kit-test={peer}",
        ]
        self._log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(die_with_this_process(cmd), stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(self._healthy, self.start_timeout, interval=0.2,
                     what=f"etcd on {client} to be healthy",
                     abort_if=lambda: self.proc is not None and self.proc.poll() is not None)
        except (TimeoutError, RuntimeError) as e:
            self.stop()
            raise RuntimeError(f"etcd did not start ({e}); see {log_path}") from e
        log.info("etcd running on %s (pid %d)", client, self.proc.pid)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_port}/health",
                                        timeout=1) as r:
                return b"true" in r.read()
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """Kill etcd and remove its temporary data directory (idempotent)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        for port in self._ports:
            port.close()
        self._ports = []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            self.data_dir = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
