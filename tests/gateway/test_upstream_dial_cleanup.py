"""A dial mitmproxy abandons before any further hook leaves nothing of it in the gate.

mitmproxy's open_connection runs server_connect, then waits for one of its 5 slots per upstream
address (per client connection) before dialling; a handler cancelled there (the client left, or
the connect timer fired) runs neither server_connect_error nor server_disconnected. Whatever the
gate keys by that upstream connection's id must not outlive it.
"""
from __future__ import annotations

import asyncio

import pytest
from mitmproxy.proxy import server_hooks

from egress import mitm_internals
from egress.conn_state import ConnectionClaims
from tests.gateway.test_gate_units import nameserver, parts, run, tunnel  # noqa: F401


def _tables_holding(gate, key: str) -> list[str]:
    return [name for name, value in vars(gate).items()
            if isinstance(value, (dict, set)) and key in value]


@pytest.mark.parametrize("limit", [None, 8], ids=["no_cap", "capped"])
def test_a_pinned_dial_cancelled_before_connecting_is_held_by_no_table(parts, limit):
    if limit is not None:        # upstream connections are claimed against the sandbox's cap
        parts.gate.max_connections_per_sandbox, parts.gate.claims = limit, ConnectionClaims(limit)

    async def scenario(tctx):
        client, data = await tunnel(parts, tctx, "other.allowed.test")
        server = data.context.server
        server.address = ("other.allowed.test", 443)
        await parts.gate.server_connect(server_hooks.ServerConnectionHookData(server=server, client=client))
        assert server.error is None and server.address == ("198.18.0.11", 443)   # pinned, to be dialled
        # ... the handler is cancelled waiting for a slot: no server hook follows, the client leaves
        parts.gate.client_disconnected(client)
        return server.id
    server_id = run(parts, scenario)
    assert _tables_holding(parts.gate, server_id) == []
    assert parts.gate.claims.open == {}          # the sandbox's upstream claim was given back


def test_a_pinned_dial_gets_its_name_back_once_connected(parts):
    async def scenario(tctx):
        client, data = await tunnel(parts, tctx, "other.allowed.test")
        server = data.context.server
        server.address = ("other.allowed.test", 443)
        sd = server_hooks.ServerConnectionHookData(server=server, client=client)
        await parts.gate.server_connect(sd)
        assert server.address == ("198.18.0.11", 443)
        server.peername = ("198.18.0.11", 443)
        parts.gate.server_connected(sd)
        return server.address, server.id
    address, server_id = run(parts, scenario)
    assert address == ("other.allowed.test", 443)
    assert _tables_holding(parts.gate, server_id) == []


def test_a_dial_whose_connect_timer_cancels_it_before_connecting_is_held_by_no_table(parts, monkeypatch):
    cancelled = []
    # mitmproxy's handler of that dial, cancelled where it waits (for a slot): no server hook follows
    monkeypatch.setattr(mitm_internals, "cancel_server", lambda client_id, server, why: cancelled.append(why) or True)
    parts.gate.connect_timeout = 0.05

    async def scenario(tctx):
        client, data = await tunnel(parts, tctx, "other.allowed.test")
        server = data.context.server
        server.address = ("other.allowed.test", 443)
        await parts.gate.server_connect(server_hooks.ServerConnectionHookData(server=server, client=client))
        await asyncio.sleep(0.2)
        parts.gate.client_disconnected(client)
        return server.id
    server_id = run(parts, scenario)
    assert cancelled == ["upstream connect timeout"]
    assert _tables_holding(parts.gate, server_id) == []
