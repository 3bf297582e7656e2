"""Listening sockets with SO_REUSEPORT, so several gateway processes can share a port."""
from __future__ import annotations

import socket

BACKLOG = 4096   # asyncio's default (100) drops the last ACK of a burst of connects (engine.py)


def listen_sockets(host: str, port: int, backlog: int = BACKLOG) -> list[socket.socket]:
    """One bound, listening, non-blocking socket per address `host` names (port 0: the
    kernel picks one, and every address gets the same)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[socket.socket] = []
    seen = set()
    try:
        for family, type_, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            s = socket.socket(family, type_, proto)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(out) > 1:
                addr = (addr[0], out[0].getsockname()[1], *addr[2:])
            s.bind(addr)
            s.listen(backlog)
            s.setblocking(False)
    except BaseException:
        for s in out:
            s.close()
        raise
    return out
