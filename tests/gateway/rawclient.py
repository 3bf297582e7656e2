"""Byte-level proxy clients for attack shapes curl will not produce.

Run them inside the lab's gw namespace with lab.call_gw(fn, ...).
"""
from __future__ import annotations

import base64
import socket
import ssl
import time


def auth_header(sandbox: str, token: str) -> str:
    return "Proxy-Authorization: Basic " + base64.b64encode(f"{sandbox}:{token}".encode()).decode()


def recv_all(sock: socket.socket, timeout: float = 5.0, limit: int = 1 << 20) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    total = 0
    try:
        while total < limit:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
            total += len(data)
    except (socket.timeout, ConnectionResetError):
        pass
    return b"".join(chunks)


def send_raw(port: int, payload: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes to the proxy, return everything it answers until it closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        return recv_all(s, timeout)


def connect_tunnel(port: int, target: str, auth: str, timeout: float = 5.0) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n\r\n".encode())
    s.settimeout(timeout)
    return s, read_head(s)


def read_head(sock: socket.socket, limit: int = 65536) -> bytes:
    """Bytes up to the end of an HTTP response head (or EOF / limit)."""
    head = b""
    while b"\r\n\r\n" not in head and len(head) <= limit:
        data = sock.recv(4096)
        if not data:
            break
        head += data
    return head


def connect_status(head: bytes) -> int:
    try:
        return int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def tls_through_tunnel(port: int, target: str, auth: str, *, sni: str | None, cafile: str | None,
                       request: bytes | None = None, timeout: float = 5.0) -> dict:
    """CONNECT, then a TLS handshake with the given SNI; returns what happened."""
    s, head = connect_tunnel(port, target, auth, timeout)
    out: dict = {"connect_status": connect_status(head)}
    if out["connect_status"] != 200:
        s.close()
        return out
    ctx = ssl.create_default_context(cafile=cafile) if cafile else ssl._create_unverified_context()
    if not cafile:
        ctx.check_hostname = False
    try:
        with ctx.wrap_socket(s, server_hostname=sni) as tls:
            out["handshake"] = "ok"
            cert = tls.getpeercert(binary_form=True)
            out["peer_cert_der"] = cert
            if request:
                tls.sendall(request)
                out["response"] = recv_all(tls, timeout)
    except (ssl.SSLError, OSError) as e:
        out["handshake"] = f"failed: {type(e).__name__}: {e}"
    finally:
        s.close()
    return out


def slow_clients(port: int, n: int, hold_seconds: float) -> int:
    """Open n connections that send a partial request line and stall; return how many opened."""
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.sendall(b"GET http://api.allowed.test/ HTTP/1.1\r\nHost: api.al")
            socks.append(s)
        time.sleep(hold_seconds)
        return len(socks)
    finally:
        for s in socks:
            s.close()
