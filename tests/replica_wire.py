"""The replica channel's handshake, spoken by hand: for tests that send a stream's
header (and bytes) themselves, as a peer of the group (knowing the token) or as a
stranger."""

from __future__ import annotations

import socket
from typing import Any

from elastic_kit.snapshot._replica import ReplicaReceiver, signed_header


def read_line(conn: socket.socket) -> bytes:
    """One line from ``conn``, without its newline (b"" if the peer hung up first)."""
    out = b""
    while not out.endswith(b"\n"):
        c = conn.recv(1)
        if not c:
            return out
        out += c
    return out[:-1]


def greeted(r: ReplicaReceiver, *, timeout: float = 30) -> tuple[socket.socket, str]:
    """A connection to ``r`` and the nonce of its greeting."""
    conn = socket.create_connection((r.host, r.port), timeout=timeout)
    hello, _, nonce = read_line(conn).decode().partition(" ")
    assert hello == "hello" and nonce, hello
    return conn, nonce


def send_header(r: ReplicaReceiver, header: dict[str, Any], token: str, *,
                timeout: float = 30) -> socket.socket:
    """A connection to ``r`` that sent ``header`` signed with ``token`` (a nonce of the
    sender's own is added when it has none)."""
    conn, nonce = greeted(r, timeout=timeout)
    header = {"nonce": "n" * 32, **header}
    conn.sendall(signed_header(header, token=token, nonce=nonce))
    return conn


def read_all(conn: socket.socket) -> bytes:
    out = b""
    while chunk := conn.recv(4096):
        out += chunk
    return out
