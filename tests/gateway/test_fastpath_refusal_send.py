"""_Conn.finish on real loopback sockets (uvloop and asyncio, as the workers run): a refusal page
is corked and leaves with the FIN, and still arrives when the sandbox sent bytes nobody read
(a close with unread bytes is a reset, which would drop a page still waiting in the cork)."""
from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from egress.fastpath.server import _Conn

PAGE = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 5\r\nConnection: close\r\n\r\nnope\n"


class _Refuser(asyncio.Protocol):
    """Reads the first bytes, stops reading (what follows stays unread in the kernel), refuses."""

    def __init__(self, refused: asyncio.Event) -> None:
        self.refused = refused

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.pause_reading()
        asyncio.get_running_loop().call_later(0.1, self._refuse)   # the client's extra bytes arrive

    def _refuse(self) -> None:
        _Conn.finish(self, PAGE)
        self.refused.set()


async def _refused_with_unread_bytes() -> bytes:
    loop = asyncio.get_running_loop()
    refused = asyncio.Event()
    srv = await loop.create_server(lambda: _Refuser(refused), "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    c = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        c.sendall(b"CONNECT denied.test:443 HTTP/1.1\r\n\r\n")
        await asyncio.sleep(0.03)
        c.sendall(b"\x16\x03\x01" + b"x" * 2000)     # a ClientHello sent without waiting: never read
        await asyncio.wait_for(refused.wait(), 5)
        await asyncio.sleep(0.05)                    # the close (a reset) has happened by now
        got = b""
        while True:
            try:
                chunk = await loop.run_in_executor(None, c.recv, 65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        return got
    finally:
        c.close()
        srv.close()


@pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop], ids=["uvloop", "asyncio"])
def test_refusal_page_arrives_although_the_client_sent_more(loop_factory):
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(_refused_with_unread_bytes()) == PAGE
