"""A caller's getaddrinfo arguments never turn the guard off for a connection, on either loop.

AI_PASSIVE marks a binding lookup, which the guard hands to the loop's own resolver; a
connection made with flags=AI_PASSIVE must still have its remote name resolved by the
guard (stdlib asyncio passes create_connection's flags straight to getaddrinfo). Run in
the lab's gw namespace against the lab DNS (loopback.evil.test -> 127.0.0.1) and a
canary listening on loopback that must never be reached.
"""
from __future__ import annotations

import asyncio
import socket

import pytest

from egress import netguard
from egress.guarded_uvloop import GuardedUVLoop
from egress.netguard import DestinationBlocked
from tests.netguard.test_guarded_uvloop import canary, make_resolver, run_in_lab

pytestmark = pytest.mark.netns

LOOPS = {"stdlib": asyncio.new_event_loop, "uvloop": GuardedUVLoop}
NAMES = ["loopback.evil.test", "127.1", "2130706433"]


def _outcome(coro_fn):
    async def one(name, port):
        try:
            await coro_fn(name, port)
            return "connected"
        except DestinationBlocked as e:
            return e.reason
        except OSError as e:
            return type(e).__name__
    return one


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_passive_flags_on_a_connection_still_go_through_the_guard(lab, loop_name):
    async def go():
        loop = asyncio.get_running_loop()
        uninstall = netguard.install(loop, make_resolver(lab))
        server, port, hits = await canary()
        out: dict[str, dict[str, str]] = {}
        try:
            async def tcp(h, p):
                transport, _ = await loop.create_connection(asyncio.Protocol, h, p, flags=socket.AI_PASSIVE)
                transport.close()

            async def stream(h, p):
                _, writer = await asyncio.open_connection(h, p, flags=socket.AI_PASSIVE | socket.AI_ADDRCONFIG)
                writer.close()

            async def udp(h, p):
                transport, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, remote_addr=(h, p),
                                                                   flags=socket.AI_PASSIVE)
                transport.close()

            for entry, fn in (("create_connection", tcp), ("open_connection", stream), ("datagram", udp)):
                one = _outcome(fn)
                out[entry] = {n: await one(n, port) for n in NAMES}
            # binding stays the loop's own: a passive wildcard listener still comes up
            other = await asyncio.start_server(lambda r, w: None, None, 0)
            out["bind"] = {"wildcard": "ok" if other.sockets else "none"}
            other.close()
        finally:
            uninstall()
            await asyncio.sleep(0.05)
            server.close()
        return out, len(hits)

    out, hits = run_in_lab(lab, go, LOOPS[loop_name])
    assert hits == 0, f"the loopback canary was reached on {loop_name}: {out}"
    assert out.pop("bind") == {"wildcard": "ok"}
    for entry, got in out.items():
        assert got == {n: "loopback" for n in NAMES}, (loop_name, entry, got)
