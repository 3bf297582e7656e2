"""Memory of an idle connection: hold N passthrough tunnels open through a proxy, each after
one keep-alive request, and read how much the proxy's process tree grew (RSS from /proc).

Run from the bench (bench_gateway.py --idle-conns N): the client runs in a thread inside
the lab's gw namespace, opens the tunnels one after another (bounded: N ≤ 2,000, each step
with a timeout), measures, then closes every socket it opened.
"""
from __future__ import annotations

import base64
import socket
import ssl
import time
from urllib.parse import urlsplit

from bench.proctree import tree_pids

__all__ = ["tree_rss_kib", "hold_idle_tunnels"]
MAX_CONNS = 2000
STEP_TIMEOUT = 10.0


def tree_rss_kib(root: int) -> int:
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def _open_tunnel(proxy_url: str, host: str, ca: str) -> ssl.SSLSocket:
    u = urlsplit(proxy_url)
    sock = socket.create_connection((u.hostname, u.port), timeout=STEP_TIMEOUT)
    auth = ""
    if u.username:
        cred = base64.b64encode(f"{u.username}:{u.password}".encode()).decode()
        auth = f"Proxy-Authorization: Basic {cred}\r\n"
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n{auth}\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("proxy closed before answering CONNECT")
        head += chunk
    if not head.startswith(b"HTTP/1.1 200") and not head.startswith(b"HTTP/1.0 200"):
        raise ConnectionError(f"CONNECT refused: {head[:60]!r}")
    tls = ssl.create_default_context(cafile=ca).wrap_socket(sock, server_hostname=host)
    tls.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    got = b""
    while b"\r\n\r\n" not in got:   # nginx's small answer: the head is enough, the rest stays buffered
        chunk = tls.recv(65536)
        if not chunk:
            raise ConnectionError("upstream closed the keep-alive tunnel")
        got += chunk
    return tls


def hold_idle_tunnels(lab, proxy_url: str, host: str, ca: str, n: int, proxy_pid: int, settle) -> dict:
    """Open n tunnels, wait until the proxy is quiet (`settle(pid)`), read its RSS growth, close all."""
    n = max(1, min(n, MAX_CONNS))
    before_kib = (settle(proxy_pid), tree_rss_kib(proxy_pid))[1]

    def run() -> tuple[list, str | None]:
        held, error = [], None
        deadline = time.monotonic() + 120
        try:
            for _ in range(n):
                if time.monotonic() > deadline:
                    error = "gave up after 120 s"
                    break
                held.append(_open_tunnel(proxy_url, host, ca))
        except (OSError, ConnectionError, ssl.SSLError) as e:
            error = f"{type(e).__name__}: {e}"[:200]
        return held, error

    held, error = lab.call_gw(run, timeout=180)
    try:
        settle(proxy_pid)
        after_kib = tree_rss_kib(proxy_pid)
    finally:
        for s in held:
            try:
                s.close()
            except OSError:
                pass
    out = {"held": len(held), "rss_before_kib": before_kib, "rss_after_kib": after_kib,
           "kib_per_conn": (after_kib - before_kib) / len(held) if held else None}
    if error:
        out["error"] = error
    return out
