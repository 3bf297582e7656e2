"""Shape of what the installed getaddrinfo returns (no network: a fixed resolver)."""

import asyncio
import socket

import pytest

from egress import netguard
from egress.netguard import AddressGuard, DestinationBlocked, GuardedResolver


class FixedAnswers(GuardedResolver):
    """A GuardedResolver whose DNS always answers the same addresses."""

    def __init__(self, answers):
        super().__init__(AddressGuard(allow_cidrs=["198.18.0.0/24"]), nameservers=["192.0.2.53"])
        self.answers = answers
        self.asked = []

    async def _query(self, name, rdtype):
        self.asked.append((name, rdtype))
        return [a for a in self.answers if (":" in a) == (rdtype == "AAAA")]


def run_with(resolver, coro_fn):
    async def main():
        loop = asyncio.get_running_loop()
        uninstall = netguard.install(loop, resolver)
        try:
            return await coro_fn(loop)
        finally:
            uninstall()
    return asyncio.run(main())


def test_tuples_for_a_stream_connection():
    resolver = FixedAnswers(["198.18.0.10", "2606:4700::1", "127.0.0.1"])
    infos = run_with(resolver, lambda loop: loop.getaddrinfo("API.Example.TEST.", "https",
                                                              type=socket.SOCK_STREAM))
    assert infos == [
        (socket.AF_INET, socket.SOCK_STREAM, 0, "", ("198.18.0.10", 443)),
        (socket.AF_INET6, socket.SOCK_STREAM, 0, "", ("2606:4700::1", 443, 0, 0)),
    ]
    assert resolver.asked == [("api.example.test.", "A"), ("api.example.test.", "AAAA")]


def test_family_filter_and_type_zero():
    resolver = FixedAnswers(["198.18.0.10", "2606:4700::1"])
    infos = run_with(resolver, lambda loop: loop.getaddrinfo(b"x.test", 80, family=socket.AF_INET6))
    assert infos == [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("2606:4700::1", 80, 0, 0)),
                     (socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_UDP, "", ("2606:4700::1", 80, 0, 0))]


def test_only_blocked_family_left_is_an_error():
    resolver = FixedAnswers(["198.18.0.10", "fd00::1"])
    with pytest.raises(socket.gaierror):
        run_with(resolver, lambda loop: loop.getaddrinfo("x.test", 80, family=socket.AF_INET6))


def test_numeric_host_flag_refuses_names():
    with pytest.raises(socket.gaierror):
        run_with(FixedAnswers(["198.18.0.10"]),
                 lambda loop: loop.getaddrinfo("x.test", 80, flags=socket.AI_NUMERICHOST))


def test_non_canonical_literal_reaches_the_guard_and_no_dns():
    resolver = FixedAnswers([])
    with pytest.raises(DestinationBlocked) as err:
        run_with(resolver, lambda loop: loop.getaddrinfo("0x7f.1", 80))
    assert err.value.reason == "loopback" and resolver.asked == []
    infos = run_with(resolver, lambda loop: loop.getaddrinfo("0306.022.0.012", 80, type=socket.SOCK_STREAM))
    assert infos == [(socket.AF_INET, socket.SOCK_STREAM, 0, "", ("198.18.0.10", 80))]


def test_uninstall_restores_the_original():
    async def main():
        loop = asyncio.get_running_loop()
        original = loop.getaddrinfo
        uninstall = netguard.install(loop, FixedAnswers([]))
        assert loop.getaddrinfo != original
        uninstall()
        assert loop.getaddrinfo == original and "getaddrinfo" not in vars(loop)
    asyncio.run(main())
