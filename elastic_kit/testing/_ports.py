"""Loopback ports held for a server that another process starts later.

A port chosen by binding port 0 and closing the socket (:func:`free_port`) is free
only at that moment. A server started in another process binds it seconds later (a
torchrun agent imports torch first): in between, any socket of the machine may take
it (another test's store, an outgoing connection), and torchrun's c10d backend then
*joins the store it finds there* as a client instead of failing. A test would run
inside a stranger's rendezvous.

:func:`reserve_port` closes that window: it keeps a socket bound to the port, with
``SO_REUSEADDR`` and never listening, until :meth:`ReservedPort.close`. Linux then

- refuses the port to every bind without ``SO_REUSEADDR`` and to every ``bind(0)``
  and ``connect()`` that picks a port for itself;
- lets a server that sets ``SO_REUSEADDR`` (torch's ``TCPStore``, etcd and every Go
  listener, Python's ``http.server``) bind and listen on it, because the held socket
  never listens; and once it listens, nobody else can bind there either.

So the port stays ours from the moment it is chosen until the test ends, across a
server that dies and is started again on the same port (a killed host agent).

This guards against accidents, not against another local user: Linux does not compare
owners for ``SO_REUSEADDR``, so a process that sets it and binds this exact port could
still listen there first (as it could take a :func:`free_port` port, with less effort).
"""

from __future__ import annotations

import socket
from types import TracebackType

__all__ = ["ReservedPort", "reserve_port"]


class ReservedPort:
    """A loopback port held for a server that binds it later (see :func:`reserve_port`).

    Attributes:
        host: the address the port is held on.
        port: the port number.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, 0))
        except OSError:
            self._sock.close()
            raise
        self.port: int = int(self._sock.getsockname()[1])

    @property
    def endpoint(self) -> str:
        """``HOST:PORT``, as torchrun's ``--rdzv-endpoint`` takes it."""
        return f"{self.host}:{self.port}"

    @property
    def held(self) -> bool:
        """True until :meth:`close`."""
        return self._sock is not None

    def close(self) -> None:
        """Stop holding the port (idempotent); a server already listening keeps it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> ReservedPort:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReservedPort({self.endpoint!r}, held={self.held})"


def reserve_port(host: str = "127.0.0.1") -> ReservedPort:
    """Hold a free TCP port on ``host`` until the returned object is closed.

    Use it for a server that another process starts later and that binds with
    ``SO_REUSEADDR`` (torch's ``TCPStore``, etcd, ``http.server``): nothing else on
    the machine can take the port in between. :func:`free_port` is enough only for a
    server this process starts at once.

    Example::

        with reserve_port() as port:
            cluster = LocalCluster([...], rdzv_endpoint=port.endpoint, log_dir=...)
    """
    return ReservedPort(host)
