"""GuardedResolver and the getaddrinfo wrapper against the lab's real DNS server.

Each test runs an asyncio loop in a thread inside the lab's gw namespace
(lab.call_gw), so sockets and DNS queries use the lab network.
"""

import asyncio
import socket
import uuid

import dns.asyncresolver
import pytest

from egress import netguard
from egress.netguard import (AddressGuard, DestinationBlocked, DestinationUnresolvable,
                             GuardedResolver)

pytestmark = pytest.mark.netns

EVIL = {
    "loopback.evil.test": ("loopback", "127.0.0.1"),
    "private.evil.test": ("private", "10.0.0.1"),
    "metadata.evil.test": ("link_local", "169.254.169.254"),
    "cgnat.evil.test": ("cgnat", "100.64.0.1"),
    "mapped.evil.test": ("loopback", "::ffff:127.0.0.1"),
    "ula.evil.test": ("unique_local", "fd00::1"),
}


def make_resolver(lab, **kw):
    return GuardedResolver(AddressGuard(allow_cidrs=[lab.lab_cidr], **kw),
                           nameservers=[lab.dns_addr], timeout=2)


def in_lab(lab, coro_fn, *args):
    return lab.call_gw(asyncio.run, coro_fn(*args), timeout=60)


def _dns_queries_so_far(lab) -> int:
    """Queries the lab's DNS server logged, counted once a marker query of ours shows in the log:
    a thread drains that log, so lines of earlier queries may still be on their way."""
    mark = f"mark-{uuid.uuid4().hex[:10]}.test"
    lab.run_gw(["dig", "+short", "+time=2", "+tries=2", f"@{lab.net_addr}", mark], lab_dns=False)
    return lab.wait_logs("dns", lambda out: f" {mark} from " in out).count("query")


async def http_get(reader, writer, host):
    writer.write(f"GET /who HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


def test_allowed_name_resolves_to_its_address(lab):
    async def go():
        return await make_resolver(lab).resolve("api.allowed.test", 443)
    assert in_lab(lab, go) == [(socket.AF_INET, "198.18.0.10")]


def test_without_exemption_the_lab_range_is_refused(lab):
    async def go():
        resolver = GuardedResolver(AddressGuard(), nameservers=[lab.dns_addr])
        await resolver.resolve("api.allowed.test", 443)
    with pytest.raises(DestinationBlocked) as err:
        in_lab(lab, go)
    assert err.value.reason == "benchmarking"


@pytest.mark.parametrize("name", sorted(EVIL))
def test_names_resolving_to_forbidden_addresses_are_blocked(lab, name):
    reason, address = EVIL[name]

    async def go():
        await make_resolver(lab).resolve(name, 443)
    with pytest.raises(DestinationBlocked) as err:
        in_lab(lab, go)
    assert err.value.reason == reason
    assert err.value.host == name
    assert isinstance(err.value, OSError)
    assert str(err.value) == f"blocked destination {name} -> {address}: {reason}"


def test_mixed_answers_keep_only_allowed_addresses(lab):
    async def go():
        return await make_resolver(lab).resolve("mixed.evil.test", 80)
    assert in_lab(lab, go) == [(socket.AF_INET, "198.18.0.10")]


def test_nxdomain_is_unresolvable(lab):
    async def go():
        await make_resolver(lab).resolve("no-such-name.test", 80)
    with pytest.raises(DestinationUnresolvable) as err:
        in_lab(lab, go)
    assert "NXDOMAIN" in str(err.value)
    assert isinstance(err.value, socket.gaierror)


def test_dead_nameserver_is_unresolvable_not_allowed(lab):
    async def go():
        resolver = GuardedResolver(AddressGuard(allow_cidrs=[lab.lab_cidr]),
                                   nameservers=["198.18.0.2:5353"], timeout=0.5)
        await resolver.resolve("api.allowed.test", 80)
    with pytest.raises(DestinationUnresolvable):
        in_lab(lab, go)


@pytest.mark.parametrize("literal, reason", [("127.1", "loopback"), ("2130706433", "loopback"),
                                             ("[::1]", "loopback"), ("0xa.1", "private"),
                                             ("169.254.169.254.", "link_local")])
def test_literals_are_checked_without_dns(lab, literal, reason):
    async def go():
        await make_resolver(lab).resolve(literal, 80)
    before = _dns_queries_so_far(lab)
    with pytest.raises(DestinationBlocked) as err:
        in_lab(lab, go)
    assert err.value.reason == reason
    assert _dns_queries_so_far(lab) == before + 1          # our own marker query only


def test_own_listener_is_blocked_by_name(lab):
    async def go():
        await make_resolver(lab, own_endpoints=[("198.18.0.10", 443)]).resolve("api.allowed.test", 443)
    with pytest.raises(DestinationBlocked) as err:
        in_lab(lab, go)
    assert err.value.reason == "own_listener"


def test_set_zone_change_is_seen_immediately(lab):
    async def go():
        return await make_resolver(lab).resolve("spare1.test", 80)
    try:
        lab.set_zone("spare1.test", ["10.1.2.3"])
        with pytest.raises(DestinationBlocked):
            in_lab(lab, go)
    finally:
        lab.set_zone("spare1.test", [lab.hosts["spare1.test"]])
    assert in_lab(lab, go) == [(socket.AF_INET, lab.hosts["spare1.test"])]


# ---------------------------------------------------------------- install()

def test_open_connection_by_name_goes_through_the_guard(lab):
    async def go():
        loop = asyncio.get_running_loop()
        uninstall = netguard.install(loop, make_resolver(lab))
        results = {}
        try:
            reader, writer = await asyncio.open_connection("api.allowed.test", 80)
            results["ok"] = await http_get(reader, writer, "api.allowed.test")
            for name in EVIL:
                try:
                    await asyncio.open_connection(name, 80)
                    results[name] = "connected"
                except DestinationBlocked as e:
                    results[name] = e.reason
            for literal in ("127.1", "0x7f000001", "2130706433"):
                try:
                    await asyncio.open_connection(literal, 80)
                    results[literal] = "connected"
                except DestinationBlocked as e:
                    results[literal] = e.reason
            try:
                await asyncio.open_connection("no-such-name.test", 80)
            except socket.gaierror as e:
                results["nx"] = str(e)
        finally:
            uninstall()
        results["restored"] = "getaddrinfo" not in vars(loop)
        return results

    results = in_lab(lab, go)
    assert b'"server": "api.allowed.test"' in results.pop("ok")
    assert results.pop("restored") is True
    assert "NXDOMAIN" in results.pop("nx")
    assert results == {**{n: r for n, (r, _) in EVIL.items()},
                       "127.1": "loopback", "0x7f000001": "loopback", "2130706433": "loopback"}


def test_canonical_literals_bypass_getaddrinfo(lab):
    """Why callers must check literals themselves: asyncio never asks getaddrinfo."""
    async def go():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        uninstall = netguard.install(asyncio.get_running_loop(), make_resolver(lab))
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            peer = writer.get_extra_info("peername")[0]
            writer.close()
        finally:
            uninstall()
            server.close()
        return peer

    assert in_lab(lab, go) == "127.0.0.1"  # connected: the wrapper was not consulted
    assert AddressGuard().check("127.0.0.1", 1) == "loopback"


def test_passive_lookups_for_binding_are_untouched(lab):
    async def go():
        uninstall = netguard.install(asyncio.get_running_loop(), make_resolver(lab))
        try:
            server = await asyncio.start_server(lambda r, w: None, None, 0)  # AI_PASSIVE wildcard
            server.close()
            try:
                await asyncio.get_running_loop().getaddrinfo(None, 80)
            except DestinationBlocked as e:
                return e.reason
        finally:
            uninstall()

    assert in_lab(lab, go) == "loopback"  # a connecting lookup of no host means loopback


def test_install_refuses_foreign_loops():
    class NotAsyncio:
        pass
    with pytest.raises(TypeError):
        netguard.install(NotAsyncio(), None)  # type: ignore[arg-type]


def test_dns_rebinding_cannot_reach_loopback(lab):
    """rebind.allowed.test alternates 198.18.0.10 / 127.0.0.1 with TTL 0.

    Control: a naive check-then-connect (resolve, check, resolve again to
    connect) is fooled and hits a canary on 127.0.0.1:80. With install(), we
    connect to exactly the addresses we checked: the canary is never hit.
    """
    name = "rebind.allowed.test"
    attempts = 8

    async def go():
        hits = []

        async def canary(reader, writer):
            hits.append(writer.get_extra_info("peername"))
            writer.close()

        server = await asyncio.start_server(canary, "127.0.0.1", 80)
        guard = AddressGuard(allow_cidrs=[lab.lab_cidr])
        plain = dns.asyncresolver.Resolver(configure=False)
        plain.nameservers = ["198.18.0.2"]
        plain.cache = None

        # Control: time-of-check / time-of-use with two lookups.
        naive_connected = 0
        for _ in range(attempts):
            checked = [r.address for r in await plain.resolve(name, "A")]
            if any(guard.check(ip, 80) for ip in checked):
                continue
            used = (await plain.resolve(name, "A"))[0].address
            _, writer = await asyncio.open_connection(used, 80)
            naive_connected += 1
            writer.close()
        await asyncio.sleep(0.05)
        naive_hits = len(hits)
        hits.clear()

        uninstall = netguard.install(asyncio.get_running_loop(), GuardedResolver(guard, [lab.dns_addr]))
        peers, blocked = [], 0
        try:
            for _ in range(attempts):
                try:
                    reader, writer = await asyncio.open_connection(name, 80)
                except DestinationBlocked as e:
                    assert e.reason == "loopback"
                    blocked += 1
                    continue
                peers.append(writer.get_extra_info("peername")[0])
                await http_get(reader, writer, name)
        finally:
            uninstall()
        await asyncio.sleep(0.05)
        server.close()
        return naive_connected, naive_hits, peers, blocked, len(hits)

    naive_connected, naive_hits, peers, blocked, guarded_hits = in_lab(lab, go)
    assert naive_connected > 0 and naive_hits == naive_connected  # the attack is real here
    assert guarded_hits == 0
    assert blocked > 0 and peers  # both answers were seen
    assert set(peers) == {"198.18.0.10"}
    assert blocked + len(peers) == attempts


def test_local_addresses_in_the_gw_namespace(lab):
    from egress.netguard import local_addresses
    found = {str(a) for a in lab.call_gw(local_addresses)}
    assert {"127.0.0.1", lab.gw_addr} <= found
    assert "198.18.0.2" not in found  # the other end of the veth is not ours
