"""The line between the daemon and one worker process: JSON messages, one per line, on a socketpair.

daemon → worker   {"t": "hello", "settings": {...}, "keys": {...}}   first, once (vault key sources:
                                                                     never in the environment)
                  {"t": "policy"}        the policy store changed: follow it now
                  {"t": "drain"}         stop listening, finish in-flight flows, exit
                  {"t": "agent_reply", "id": n, "status": s, "doc": {...}}
worker → daemon   {"t": "state", "ready": bool, "checks": {...}, "pid": p}   every STATE_SECONDS
                  {"t": "agent", "id": n, "sandbox": ..., "labels": {...}, "method": ..., "path": ...,
                   "body": base64}       a request to cubegate.internal, answered by the daemon
"""
from __future__ import annotations

import asyncio
import json
import socket

MAX_LINE = 1 << 20       # bounded: a message larger than this ends the link
STATE_SECONDS = 0.5      # how often a worker says whether it is ready
STALE_SECONDS = 3.0      # a worker not heard from this long is not ready


class Link:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, sock: socket.socket) -> "Link":
        reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_LINE)
        return cls(reader, writer)

    def send(self, msg: dict) -> None:
        if not self.writer.is_closing():
            self.writer.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")

    async def receive(self) -> dict | None:
        """The next message; None when the other side is gone (or sent something unreadable)."""
        try:
            line = await self.reader.readline()
        except (ValueError, ConnectionError, asyncio.LimitOverrunError):
            return None
        if not line:
            return None
        try:
            msg = json.loads(line)
        except ValueError:
            return None
        return msg if isinstance(msg, dict) else None

    def close(self) -> None:
        self.writer.close()
