"""uvloop, with every name it would resolve for a connection sent through netguard first.

uvloop resolves host names in C (libuv's getaddrinfo: /etc/hosts, the system
resolver, every IP spelling libc accepts such as "2130706433"), so wrapping
``loop.getaddrinfo`` as netguard does for the stdlib loop would not be enough.
This subclass overrides each Python entry point that can resolve a name for an
outgoing connection — ``getaddrinfo``, ``create_connection``,
``create_datagram_endpoint``, ``sock_connect`` — so that any host that is not a
canonical IP address (``inet_pton``) is resolved by the installed guard first,
and uvloop itself only ever sees numeric addresses (which it parses without DNS).
Canonical IP literals pass straight through, exactly as asyncio's own loop does
(``asyncio.base_events._ipaddr_info``): callers check those with ``guard.check``.

Fail closed: until ``netguard.install`` sets a guard, a name is refused, never
resolved by the system. Binding lookups (``AI_PASSIVE``, ``create_server``) are
not egress and stay uvloop's. The listing of uvloop's internal resolve calls
this relies on (create_connection, create_datagram_endpoint, getaddrinfo,
sock_connect; create_server binds) is checked by tests/gateway/test_guarded_uvloop.py.
"""
from __future__ import annotations

import socket

import uvloop


def _canonical_ip(host) -> bool:
    """True for what inet_pton accepts (the only spellings a loop may skip resolving for)."""
    if isinstance(host, bytes):
        try:
            host = host.decode("ascii")
        except UnicodeDecodeError:
            return False
    if not isinstance(host, str):
        return False
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except (OSError, ValueError):
            pass
    return False


class NoGuardInstalled(socket.gaierror):
    def __init__(self, host) -> None:
        message = f"{host!r}: no guarded resolver installed on this loop (refused)"
        super().__init__(socket.EAI_FAIL, message)


class GuardedUVLoop(uvloop.Loop):
    """A uvloop whose name resolutions for connections all go through `self._guarded`."""

    _guarded = None   # async (host, port, *, family, type, proto, flags) -> getaddrinfo tuples

    def set_guard(self, guarded_getaddrinfo) -> None:
        self._guarded = guarded_getaddrinfo

    async def _unguarded_getaddrinfo(self, host, port, *, family=0, type=0, proto=0, flags=0):
        return await super().getaddrinfo(host, port, family=family, type=type, proto=proto, flags=flags)

    async def getaddrinfo(self, host, port, *, family=0, type=0, proto=0, flags=0):
        if flags & socket.AI_PASSIVE:
            return await super().getaddrinfo(host, port, family=family, type=type, proto=proto, flags=flags)
        if self._guarded is None:
            raise NoGuardInstalled(host)
        return await self._guarded(host, port, family=family, type=type, proto=proto, flags=flags)

    async def _resolved(self, host, port, family: int, type_: int, proto: int, flags: int) -> list[tuple]:
        # A remote to connect to: AI_PASSIVE (a binding lookup, which getaddrinfo passes unguarded)
        # means nothing for a named host, so a caller's flags must not turn the guard off.
        flags &= ~socket.AI_PASSIVE
        return [(fam, addr) for fam, _t, _p, _c, addr in
                await self.getaddrinfo(host, port, family=family, type=type_, proto=proto, flags=flags)]

    async def create_connection(self, protocol_factory, host=None, port=None, *, ssl=None, family=0, proto=0,
                                flags=0, sock=None, local_addr=None, server_hostname=None, **kw):
        _refuse_named_local(local_addr)
        if sock is not None or host is None or _canonical_ip(host):
            return await super().create_connection(protocol_factory, host, port, ssl=ssl, family=family,
                                                   proto=proto, flags=flags, sock=sock, local_addr=local_addr,
                                                   server_hostname=server_hostname, **kw)
        if ssl and server_hostname is None:
            server_hostname = host   # what the loop would have verified against, had it resolved the name
        errors: list[OSError] = []
        for fam, addr in await self._resolved(host, port, family, socket.SOCK_STREAM, proto, flags):
            try:
                return await super().create_connection(protocol_factory, addr[0], addr[1], ssl=ssl, family=fam,
                                                       proto=proto, flags=flags, local_addr=local_addr,
                                                       server_hostname=server_hostname, **kw)
            except OSError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise OSError(f"Multiple exceptions: {', '.join(str(e) for e in errors)}")

    async def create_datagram_endpoint(self, protocol_factory, local_addr=None, remote_addr=None, *, family=0,
                                       proto=0, flags=0, **kw):
        _refuse_named_local(local_addr)
        if remote_addr is not None and not _canonical_ip(remote_addr[0]):
            pairs = await self._resolved(remote_addr[0], remote_addr[1], family, socket.SOCK_DGRAM, proto, flags)
            family, remote_addr = pairs[0][0], pairs[0][1]
        return await super().create_datagram_endpoint(protocol_factory, local_addr, remote_addr, family=family,
                                                      proto=proto, flags=flags, **kw)

    async def sock_connect(self, sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _canonical_ip(address[0]):
            pairs = await self._resolved(address[0], address[1], sock.family, sock.type, sock.proto, 0)
            address = pairs[0][1]
        return await super().sock_connect(sock, address)


def _refuse_named_local(local_addr) -> None:
    """A local address given by name would be resolved by libuv: refused (nobody here needs one)."""
    if local_addr is not None and local_addr[0] not in (None, "") and not _canonical_ip(local_addr[0]):
        raise ValueError(f"local_addr must be an IP address, not {local_addr[0]!r}")


def new_event_loop() -> GuardedUVLoop:
    return GuardedUVLoop()
