"""The replica channel's handshake, spoken by hand: for tests that send a stream's
header (and bytes) themselves, as a peer of the group (knowing the token) or as a
stranger."""

from __future__ import annotations

import socket
from typing import Any

from elastic_kit.snapshot._replica import ReplicaReceiver, content_mac, signed_header


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


def open_stream(r: ReplicaReceiver, header: dict[str, Any], token: str, *,
                timeout: float = 30) -> tuple[socket.socket, Any]:
    """A connection to ``r`` that sent ``header`` signed with ``token`` (a nonce of the
    sender's own, and ``r``'s identity, are added when it has none), and the HMAC
    that the stream's trailer must carry (feed it the bytes sent: see :func:`trailer`)."""
    conn, nonce = greeted(r, timeout=timeout)
    header = {"nonce": "n" * 32, "to": r.ident, **header}
    conn.sendall(signed_header(header, token=token, nonce=nonce))
    return conn, content_mac(token, sender_nonce=header["nonce"], nonce=nonce)


def send_header(r: ReplicaReceiver, header: dict[str, Any], token: str, *,
                timeout: float = 30) -> socket.socket:
    """A connection to ``r`` that sent ``header`` (see :func:`open_stream`)."""
    return open_stream(r, header, token, timeout=timeout)[0]


def trailer(mac: Any, body: bytes) -> bytes:
    """``body`` followed by the trailer line that signs it (and what ``mac`` was fed)."""
    mac.update(body)
    return body + b"mac " + mac.hexdigest().encode() + b"\n"


def read_all(conn: socket.socket) -> bytes:
    out = b""
    while chunk := conn.recv(4096):
        out += chunk
    return out
