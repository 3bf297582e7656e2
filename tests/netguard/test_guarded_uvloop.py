"""uvloop under netguard: every name a connection would resolve goes through the guard.

Plain uvloop resolves in C (libuv's getaddrinfo: /etc/hosts, "2130706433" as 127.0.0.1), so
the control tests show the attack is real there; egress.guarded_uvloop's loop must refuse the
same names, and never touch the canary listening on loopback. Run in the lab's gw namespace
against the lab's real DNS server (loopback.evil.test → 127.0.0.1, ...).
"""
from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop

from egress import netguard
from egress.guarded_uvloop import GuardedUVLoop, NoGuardInstalled
from egress.netguard import AddressGuard, DestinationBlocked, GuardedResolver

pytestmark = pytest.mark.netns

HOSTILE = ["loopback.evil.test", "mapped.evil.test", "localhost", "127.1", "2130706433", "0x7f000001"]
# What plain uvloop resolves without DNS (/etc/hosts, numeric spellings). Its getaddrinfo runs in
# this process's thread, which sees the host's resolv.conf, not the lab's: a DNS name would only
# wait out the host's unreachable nameserver (10 s a name) and prove nothing.
NO_DNS = ["localhost", "127.1", "2130706433", "0x7f000001"]


def make_resolver(lab):
    return GuardedResolver(AddressGuard(allow_cidrs=[lab.lab_cidr]), nameservers=[lab.dns_addr], timeout=2)


def run_in_lab(lab, coro_fn, loop_factory):
    return lab.call_gw(lambda: asyncio.run(coro_fn(), loop_factory=loop_factory), timeout=60)


async def canary():
    hits: list = []

    def seen(reader, writer):
        hits.append(writer.get_extra_info("peername"))
        writer.close()

    server = await asyncio.start_server(seen, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], hits


async def try_all(port: int, connect, names=HOSTILE) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            await connect(name, port)
            out[name] = "connected"
        except DestinationBlocked as e:
            out[name] = e.reason
        except OSError as e:          # unresolvable (localhost is no name in the lab's DNS)
            out[name] = type(e).__name__
    return out


def test_plain_uvloop_resolves_hostile_names_itself(lab):
    """Control: without the guard, uvloop reaches loopback by name and by a decimal literal."""
    async def go():
        server, port, hits = await canary()
        results = await try_all(port, lambda h, p: asyncio.open_connection(h, p), NO_DNS)
        await asyncio.sleep(0.05)
        server.close()
        return results, len(hits)

    results, hits = run_in_lab(lab, go, uvloop.new_event_loop)
    assert results["localhost"] == results["2130706433"] == "connected"
    assert hits >= 2


def test_install_refuses_a_plain_uvloop():
    loop = uvloop.new_event_loop()
    try:
        with pytest.raises(TypeError):
            netguard.install(loop, None)  # type: ignore[arg-type]
    finally:
        loop.close()


def test_hostile_names_are_refused_on_every_entry_point(lab):
    async def go():
        loop = asyncio.get_running_loop()
        uninstall = netguard.install(loop, make_resolver(lab))
        server, port, hits = await canary()
        try:
            results = {"open_connection": await try_all(port, lambda h, p: asyncio.open_connection(h, p))}

            async def sock_connect(h, p):
                with socket.socket() as s:
                    s.setblocking(False)
                    await loop.sock_connect(s, (h, p))
            results["sock_connect"] = await try_all(port, sock_connect)

            async def datagram(h, p):
                transport, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, remote_addr=(h, p))
                transport.close()
            results["datagram"] = await try_all(port, datagram)
            reader, writer = await asyncio.open_connection("api.allowed.test", 80)   # a real name still works
            writer.write(b"GET /who HTTP/1.1\r\nHost: api.allowed.test\r\nConnection: close\r\n\r\n")
            results["allowed"] = (await asyncio.wait_for(reader.read(), 5))[:12]
            writer.close()
        finally:
            uninstall()
            await asyncio.sleep(0.05)
            server.close()
        return results, len(hits)

    results, hits = run_in_lab(lab, go, GuardedUVLoop)
    assert hits == 0
    assert results.pop("allowed") == b"HTTP/1.1 200"
    for entry, got in results.items():
        assert got == {"loopback.evil.test": "loopback", "mapped.evil.test": "loopback",
                       "localhost": "DestinationUnresolvable", "127.1": "loopback",
                       "2130706433": "loopback", "0x7f000001": "loopback"}, entry


def test_without_a_guard_no_name_is_resolved(lab):
    """Fail closed: before netguard.install (or after uninstall), names are refused, not looked up."""
    async def go():
        server, port, hits = await canary()
        try:
            await asyncio.open_connection("localhost", port)
            got = "connected"
        except NoGuardInstalled:
            got = "refused"
        server.close()
        return got, len(hits)

    assert run_in_lab(lab, go, GuardedUVLoop) == ("refused", 0)


def test_canonical_literals_and_binding_behave_as_on_the_stdlib_loop(lab):
    """Like asyncio's loop: a canonical literal is not resolved (callers guard.check it), and
    binding lookups (create_server) are not egress."""
    async def go():
        uninstall = netguard.install(asyncio.get_running_loop(), make_resolver(lab))
        try:
            server, port, hits = await canary()
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            other = await asyncio.start_server(lambda r, w: None, None, 0)   # AI_PASSIVE wildcard
            other.close()
            await asyncio.sleep(0.05)
            server.close()
            return len(hits)
        finally:
            uninstall()

    assert run_in_lab(lab, go, GuardedUVLoop) == 1


# What this relies on: uvloop's resolving entry points are the ones GuardedUVLoop overrides.
# A new uvloop that adds a method fails here, so someone checks whether it resolves names.
UVLOOP_PUBLIC = {
    "add_reader", "add_signal_handler", "add_writer", "call_at", "call_exception_handler", "call_later",
    "call_soon", "call_soon_threadsafe", "close", "connect_accepted_socket", "connect_read_pipe",
    "connect_write_pipe", "create_connection", "create_datagram_endpoint", "create_future", "create_server",
    "create_task", "create_unix_connection", "create_unix_server", "default_exception_handler", "get_debug",
    "get_exception_handler", "get_task_factory", "getaddrinfo", "getnameinfo", "is_closed", "is_running",
    "print_debug_info", "remove_reader", "remove_signal_handler", "remove_writer", "run_forever",
    "run_in_executor", "run_until_complete", "sendfile", "set_debug", "set_default_executor",
    "set_exception_handler", "set_task_factory", "shutdown_asyncgens", "shutdown_default_executor",
    "slow_callback_duration", "sock_accept", "sock_connect", "sock_recv", "sock_recv_into", "sock_recvfrom",
    "sock_recvfrom_into", "sock_sendall", "sock_sendfile", "sock_sendto", "start_tls", "stop", "subprocess_exec",
    "subprocess_shell", "time",
}


def test_uvloop_surface_is_the_one_reviewed():
    assert {n for n in dir(uvloop.Loop) if not n.startswith("_")} == UVLOOP_PUBLIC
    for name in ("getaddrinfo", "create_connection", "create_datagram_endpoint", "sock_connect"):
        assert name in vars(GuardedUVLoop), name
