"""Destination guard: refuse upstream addresses a sandbox must never reach (SSRF).

Three layers, pure first:

* ``parse_ip_literal(host)`` recognises every spelling of an IP address that a
  resolver would accept (``2130706433``, ``0x7f.1``, ``0177.0.0.1``, ``127.1``,
  ``[::1]``, ``fe80::1%eth0``, ``::ffff:127.0.0.1``, trailing dot) so a literal
  can never be mistaken for a harmless host name.
* ``AddressGuard.check(ip, port)`` says why an address is refused (a stable
  reason string such as ``"loopback"``) or ``None`` when it may be contacted.
* ``GuardedResolver`` resolves names itself (dnspython, A + AAAA, no
  ``/etc/hosts``, no search domains; answers cached for their TTL) and keeps only allowed answers.
  ``install(loop, resolver)`` puts it under ``loop.getaddrinfo`` so every
  connection asyncio opens by name (mitmproxy's upstream connections use
  ``asyncio.open_connection``) connects only to addresses that passed the guard.

DNS rebinding: the addresses we check are exactly the addresses asyncio
connects to (the wrapper returns them as getaddrinfo tuples), so an answer that
changes between a policy check and the connect cannot slip through.

IMPORTANT for callers: asyncio does NOT call ``getaddrinfo`` for canonical IP
literals (``asyncio.base_events._ipaddr_info`` short-circuits ``"127.0.0.1"``
and ``"::1"``). The gateway must therefore call ``guard.check()`` itself on
every destination that ``parse_ip_literal`` recognises (CONNECT target, Host,
SNI, URL host) before connecting. Non-canonical literals (``"127.1"``) do
reach the wrapper and are checked there as well.

In mitmproxy the natural place for that check is the ``server_connect`` hook
(``data.server.address``; in transparent mode it is always a literal): set
``data.server.error`` to refuse. mitmproxy's UDP upstreams
(``mitmproxy_rs.udp.open_udp_connection``) resolve in Rust and bypass the
wrapper too: keep UDP upstreams off or check them in the same hook.

Binding (``AI_PASSIVE`` lookups made by ``create_server``) is not egress and is
passed to the original ``getaddrinfo`` untouched; a connection asked for with
``flags=AI_PASSIVE`` has the flag taken off its remote's lookup (on both loops), so
it cannot use that exemption. A listener on a wildcard
address is reachable on every local address: build ``own_endpoints`` with
``expand_wildcard_endpoints(listeners, local_addresses())``.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import inspect
import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from typing import Union

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdataclass
import dns.rdatatype
import dns.resolver

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

__all__ = [
    "AddressGuard",
    "DestinationBlocked",
    "DestinationUnresolvable",
    "GuardedResolver",
    "embedded_ipv4",
    "expand_wildcard_endpoints",
    "install",
    "local_addresses",
    "parse_ip_literal",
]


# --------------------------------------------------------------------------
# IP literals

# One to four dot-separated numbers, each decimal, octal (leading 0) or hex
# (0x...). This is the grammar of BSD inet_aton(), which glibc's getaddrinfo
# uses for numeric hosts. We validate the shape ourselves because glibc's
# inet_aton also accepts trailing garbage after whitespace ("1.2.3.4 x").
_BSD_PART = r"(?:0[xX][0-9a-fA-F]*|[0-9]+)"
_BSD_IPV4 = re.compile(rf"{_BSD_PART}(?:\.{_BSD_PART}){{0,3}}")


def parse_ip_literal(host: str) -> IPAddress | None:
    """Return the address ``host`` denotes if it is an IP literal, else None.

    A zone id (``fe80::1%eth0``) is dropped from the result: it selects an
    interface, not a different address.
    """
    if not isinstance(host, str) or not host:
        return None
    text = host
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
        return _parse_ipv6(text)
    if ":" in text:
        return _parse_ipv6(text)
    if text.endswith("."):
        text = text[:-1]
    if not _BSD_IPV4.fullmatch(text):
        return None
    try:
        packed = socket.inet_aton(text)
    except OSError:
        # Digits that inet_aton refuses (08, 256.1.1.1.1, 2**32): not an
        # address. The caller treats it as a name, and DNS will refuse it.
        return None
    return ipaddress.IPv4Address(packed)


def _parse_ipv6(text: str) -> ipaddress.IPv6Address | None:
    address, _, zone = text.partition("%")
    if "%" in text and not zone:
        return None
    try:
        return ipaddress.IPv6Address(address)
    except ValueError:
        return None


# --------------------------------------------------------------------------
# Address guard (pure)

def _nets(*cidrs: str) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c) for c in cidrs)


# Ordered: the first matching block names the reason. Covers the IANA IPv4
# and IPv6 special-purpose registries plus deprecated ranges.
_IPV4_DENY: tuple[tuple[str, tuple[Network, ...]], ...] = (
    ("unspecified", _nets("0.0.0.0/8")),
    ("loopback", _nets("127.0.0.0/8")),
    ("private", _nets("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")),
    ("link_local", _nets("169.254.0.0/16")),
    ("cgnat", _nets("100.64.0.0/10")),
    ("documentation", _nets("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")),
    ("benchmarking", _nets("198.18.0.0/15")),
    ("multicast", _nets("224.0.0.0/4")),
    ("broadcast", _nets("255.255.255.255/32")),
    ("reserved", _nets("192.0.0.0/24", "192.88.99.0/24", "240.0.0.0/4")),
)

_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_NAT64 = _nets("64:ff9b::/96", "64:ff9b:1::/48")
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_TEREDO = ipaddress.ip_network("2001::/32")
_COMPATIBLE = ipaddress.ip_network("::/96")     # ::a.b.c.d, deprecated (RFC 4291)
_GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")

_IPV6_DENY: tuple[tuple[str, tuple[Network, ...]], ...] = (
    ("unspecified", _nets("::/128")),
    ("loopback", _nets("::1/128")),
    ("link_local", _nets("fe80::/10")),
    ("unique_local", _nets("fc00::/7")),
    ("multicast", _nets("ff00::/8")),
    ("documentation", _nets("2001:db8::/32", "3fff::/20")),
    ("benchmarking", _nets("2001:2::/48")),
    # 2001::/23 IETF protocol assignments (Teredo, ORCHID, AMT, ...),
    # 100::/64 discard-only, 5f00::/16 SRv6 SIDs, fec0::/10 site-local.
    ("reserved", _nets("2001::/23", "100::/64", "100:0:0:1::/64",
                       "5f00::/16", "fec0::/10")),
)


def _as_address(ip: str | IPAddress) -> IPAddress:
    if isinstance(ip, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        address = ip
    else:
        parsed = parse_ip_literal(ip)
        if parsed is None:
            raise ValueError(f"not an IP address: {ip!r}")
        address = parsed
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
        address = ipaddress.IPv6Address(str(address).partition("%")[0])
    return address


def _default_reason(address: IPAddress) -> str | None:
    """Reason from the built-in special-purpose table, ignoring exemptions."""
    if address.version == 4:
        for reason, nets in _IPV4_DENY:
            if any(address in n for n in nets):
                return reason
        return None
    for reason, nets in _IPV6_DENY:
        if any(address in n for n in nets):
            return reason
    return None


class AddressGuard:
    """Decides whether the gateway may open a connection to ``ip:port``.

    Order of checks (first hit wins):
      1. ``own_endpoints`` -> ``own_listener`` (never exempt: proxy loops)
      2. ``extra_deny_cidrs`` -> ``denied_cidr`` (operator denies beat exemptions)
      3. ``allow_cidrs`` -> allowed (exempts exactly the addresses it names)
      4. IPv6 forms embedding IPv4 (mapped, translated, NAT64, 6to4, Teredo,
         IPv4-compatible; ``embedded_ipv4``): the
         embedded address's reason if it has one, else the form's own reason
      5. the special-purpose table; any IPv6 outside 2000::/3 is ``reserved``

    ``own_endpoints`` holds ``(ip, port)`` pairs; ``port=None`` means every
    port of that address. A wildcard ip (``0.0.0.0`` / ``::``) cannot be
    resolved here: pass the concrete local addresses instead.
    """

    def __init__(
        self,
        allow_cidrs: Iterable[str | Network] = (),
        extra_deny_cidrs: Iterable[str | Network] = (),
        own_endpoints: Iterable[tuple[str | IPAddress, int | None]] = (),
    ) -> None:
        self.allow_cidrs: tuple[Network, ...] = tuple(
            ipaddress.ip_network(c) for c in allow_cidrs)
        self.extra_deny_cidrs: tuple[Network, ...] = tuple(
            ipaddress.ip_network(c) for c in extra_deny_cidrs)
        endpoints: set[tuple[IPAddress, int | None]] = set()
        for ip, port in own_endpoints:
            endpoints.add((_as_address(ip), None if port is None else int(port)))
        self.own_endpoints: frozenset[tuple[IPAddress, int | None]] = frozenset(endpoints)

    def ipv4_boundaries(self) -> tuple[tuple[ipaddress.IPv4Network, ...], frozenset[int]]:
        """Every IPv4 network and port this guard's decision tells apart: within a network
        that straddles none of them, every address gets the same answer for a port not named
        (what a caller deciding a whole CIDR at once, the switch's direct paths, cuts at)."""
        nets = [n for _, group in _IPV4_DENY for n in group]
        nets += [n for n in (*self.extra_deny_cidrs, *self.allow_cidrs) if n.version == 4]
        nets += [ipaddress.ip_network(ip) for ip, _ in self.own_endpoints if ip.version == 4]
        return tuple(nets), frozenset(port for _, port in self.own_endpoints if port is not None)

    def check(self, ip: str | IPAddress, port: int | None = None) -> str | None:
        """Return why ``ip`` (and ``port``) is refused, or None if allowed.

        Unknown ``port`` with an own endpoint on that address: refused (fail
        closed). A string that is not an IP address raises ValueError.
        """
        address = _as_address(ip)
        for own_ip, own_port in self.own_endpoints:
            if own_ip == address and (own_port is None or port is None or own_port == port):
                return "own_listener"
        if any(address in n for n in self.extra_deny_cidrs if n.version == address.version):
            return "denied_cidr"
        if any(address in n for n in self.allow_cidrs if n.version == address.version):
            return None
        if address.version == 6:
            embedded = _embedded_ipv4(address)
            if embedded is not None:
                form_reason, v4 = embedded
                return self.check(v4, port) or form_reason
            reason = _default_reason(address)
            if reason is None and address not in _GLOBAL_UNICAST_V6:
                reason = "reserved"
            return reason
        return _default_reason(address)


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, translated, NAT64, 6to4, Teredo's client,
    IPv4-compatible), else None: the one unwrapping, for this guard and for policy deny CIDRs."""
    if address.version != 6:
        return None
    found = _embedded_ipv4(address)
    return found[1] if found is not None else None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[str | None, ipaddress.IPv4Address] | None:
    """(reason of the IPv6 form, embedded IPv4) for forms that carry one."""
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _MAPPED:
        return "ipv4_mapped", low32
    if address in _TRANSLATED:
        return "ipv4_translated", low32
    if any(address in n for n in _NAT64):
        return "nat64", low32
    if address in _SIX_TO_FOUR:
        # 2002:WWXX:YYZZ::/48 routes to the 6to4 relay WW.XX.YY.ZZ: refuse it
        # when that IPv4 is refused, otherwise it is ordinary global unicast.
        return None, ipaddress.IPv4Address((int(address) >> 80) & 0xFFFFFFFF)
    if address in _TEREDO:
        # 2001:0:SSSS:SSSS:FFFF:PPPP:CCCC:CCCC reaches the client at CCCC:CCCC, bits inverted;
        # reserved in itself (2001::/23) whatever it carries
        return "reserved", ipaddress.IPv4Address(~int(address) & 0xFFFFFFFF)
    if address in _COMPATIBLE and int(low32) >= 1 << 24:   # not ::, ::1 nor the rest of ::0.0.0.0/8
        return "reserved", low32
    return None


def expand_wildcard_endpoints(
    endpoints: Iterable[tuple[str | IPAddress, int | None]],
    local_ips: Iterable[str | IPAddress],
) -> set[tuple[IPAddress, int | None]]:
    """Replace ``0.0.0.0``/``::`` listeners by one entry per local address.

    An IPv6 wildcard also covers IPv4 (dual-stack sockets), so it expands to
    every local address.
    """
    locals_ = [_as_address(ip) for ip in local_ips]
    result: set[tuple[IPAddress, int | None]] = set()
    for ip, port in endpoints:
        address = _as_address(ip)
        if address.is_unspecified:
            result.update((local, port) for local in locals_
                          if address.version == 6 or local.version == 4)
        result.add((address, port))
    return result


def local_addresses() -> set[IPAddress]:
    """Addresses configured on interfaces of the calling thread's network namespace."""
    from pyroute2 import IPRoute  # imported here: only the gateway's startup needs it

    with IPRoute() as ipr:
        return {_as_address(msg.get_attr("IFA_ADDRESS")) for msg in ipr.get_addr()
                if msg.get_attr("IFA_ADDRESS")}


# --------------------------------------------------------------------------
# Errors

class DestinationBlocked(OSError):
    """Every address of a destination was refused by the guard."""

    def __init__(self, reason: str, host: str, addresses: list[str]) -> None:
        self.reason = reason
        self.host = host
        self.addresses = list(addresses)
        shown = ", ".join(self.addresses) if self.addresses else "(none)"
        self.message = f"blocked destination {host} -> {shown}: {reason}"
        super().__init__(errno.EACCES, self.message)

    def __str__(self) -> str:
        return self.message


class DestinationUnresolvable(socket.gaierror):
    """The name does not exist, has no A/AAAA records, or DNS failed."""

    def __init__(self, host: str, detail: str) -> None:
        self.host = host
        self.detail = detail
        self.message = f"cannot resolve {host}: {detail}"
        super().__init__(socket.EAI_NONAME, self.message)

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------
# Resolver (I/O edge)

def _nameserver(spec: str) -> dns.nameserver.Do53Nameserver:
    """"ip", "ip:port", "[v6]:port" or bare "v6" -> a dnspython nameserver."""
    spec = spec.strip()
    port = 53
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        if rest.startswith(":"):
            port = int(rest[1:])
    elif spec.count(":") == 1:
        host, _, port_text = spec.partition(":")
        port = int(port_text)
    else:
        host = spec
    ipaddress.ip_address(host)  # nameservers must be addresses, not names
    return dns.nameserver.Do53Nameserver(host, port)


class GuardedResolver:
    """Resolves a destination and keeps only the addresses the guard allows.

    ``nameservers``: list of "ip" or "ip:port"; empty = system resolv.conf.
    ``/etc/hosts`` and search domains are never consulted, answers are cached for their TTL only
    (a TTL-0 answer is asked again next time, and checked again).
    """

    def __init__(
        self,
        guard: AddressGuard,
        nameservers: Iterable[str] = (),
        timeout: float = 3.0,
    ) -> None:
        self.guard = guard
        self.timeout = float(timeout)
        servers = [_nameserver(s) for s in nameservers]
        self._resolver = dns.asyncresolver.Resolver(configure=not servers)
        if servers:
            self._resolver.nameservers = servers
        self._resolver.lifetime = self.timeout
        self._resolver.timeout = min(self.timeout, 2.0)
        # Answers are cached for their TTL (TTL 0 = never): every cached address
        # still goes through the guard on each use, so caching cannot let a
        # blocked address through; it only halves DNS work per connection
        # (the gate resolves at CONNECT and again at connect time).
        self._resolver.cache = dns.resolver.Cache(cleaning_interval=60.0)

    async def resolve(self, host: str, port: int | None = None) -> list[tuple[int, str]]:
        """Allowed ``(family, ip)`` pairs for ``host``; IPv4 first.

        Raises DestinationBlocked when every address is refused and
        DestinationUnresolvable when there is no address at all.
        """
        literal = parse_ip_literal(host)
        if literal is not None:
            reason = self.guard.check(literal, port)
            if reason is not None:
                raise DestinationBlocked(reason, host, [str(literal)])
            family = socket.AF_INET if literal.version == 4 else socket.AF_INET6
            return [(family, str(literal))]

        name = _normalise_name(host)
        addresses = self._cached(name)
        failures: list[BaseException] = []
        if addresses is None:   # not both answers in the cache: ask (A and AAAA at once)
            results = await asyncio.gather(
                self._query(name, "A"), self._query(name, "AAAA"), return_exceptions=True)
            addresses = []
            for result in results:
                if isinstance(result, BaseException):
                    failures.append(result)
                else:
                    addresses.extend(result)
        if any(isinstance(f, dns.resolver.NXDOMAIN) for f in failures):
            raise DestinationUnresolvable(host, "NXDOMAIN")
        if not addresses:
            if failures:
                raise DestinationUnresolvable(host, _describe(failures[0]))
            raise DestinationUnresolvable(host, "no A or AAAA records")

        allowed: list[tuple[int, str]] = []
        first_reason: str | None = None
        for ip in addresses:
            reason = self.guard.check(ip, port)
            if reason is None:
                family = socket.AF_INET if ":" not in ip else socket.AF_INET6
                if (family, ip) not in allowed:
                    allowed.append((family, ip))
            elif first_reason is None:
                first_reason = reason
        if not allowed:
            raise DestinationBlocked(first_reason or "blocked", host, addresses)
        return allowed

    def _cached(self, name: str) -> list[str] | None:
        """Both answers (A, AAAA) from the TTL cache, without a task or a query; None unless both
        are there (what dnspython's resolve would return for them, so the same addresses)."""
        try:
            qname = dns.name.from_text(name)
        except dns.exception.DNSException:
            return None
        out: list[str] = []
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            answer = self._resolver.cache.get((qname, rdtype, dns.rdataclass.IN))
            if answer is None:
                return None
            if answer.rrset is not None:
                out.extend(r.address for r in answer.rrset)
        return out

    async def _query(self, name: str, rdtype: str) -> list[str]:
        try:
            answer = await self._resolver.resolve(
                name, rdtype, search=False, raise_on_no_answer=False)
        except dns.resolver.NoAnswer:
            return []
        # answer.rrset is the final rrset of the CNAME chain for this name
        return [r.address for r in answer.rrset] if answer.rrset is not None else []


def _normalise_name(host: str) -> str:
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if not name or any(c.isspace() for c in name):
        raise DestinationUnresolvable(host, "not a valid host name")
    return name.rstrip(".").lower() + "."


def _describe(error: BaseException) -> str:
    if isinstance(error, dns.resolver.LifetimeTimeout):
        return "DNS timeout"
    if isinstance(error, dns.resolver.NoNameservers):
        return "no nameserver answered"
    return type(error).__name__


# --------------------------------------------------------------------------
# asyncio integration

def _port_number(port: object) -> int:
    if port is None:
        return 0
    if isinstance(port, bytes):
        port = port.decode("ascii")
    if isinstance(port, str):
        if port.isdigit():
            return int(port)
        return socket.getservbyname(port)
    return int(port)  # type: ignore[call-overload]


def _socket_kinds(type_: int, proto: int) -> list[tuple[int, int]]:
    if type_:
        return [(type_, proto)]
    if proto:
        return [(socket.SOCK_STREAM if proto == socket.IPPROTO_TCP else socket.SOCK_DGRAM, proto)]
    return [(socket.SOCK_STREAM, socket.IPPROTO_TCP), (socket.SOCK_DGRAM, socket.IPPROTO_UDP)]


def install(loop: asyncio.AbstractEventLoop, resolver: GuardedResolver) -> Callable[[], None]:
    """Route every name resolution ``loop`` makes for a connection through ``resolver``;
    return an uninstall callable.

    The standard library loop: ``loop.getaddrinfo`` is wrapped (its create_connection,
    sock_connect, ... all resolve through it), and the two that pass a caller's flags on
    (create_connection, create_datagram_endpoint) drop AI_PASSIVE for a remote. uvloop resolves in C and would bypass such a
    wrapper, so of uvloop only egress.guarded_uvloop's subclass is accepted: it sends each
    of its resolving entry points through the guard. Any other loop raises TypeError.
    """
    guarded_uv = _guarded_uvloop_class()
    if guarded_uv is not None and isinstance(loop, guarded_uv):
        loop.set_guard(_guarded_getaddrinfo(resolver, loop._unguarded_getaddrinfo))
        return lambda: loop.set_guard(None)
    if not isinstance(loop, asyncio.base_events.BaseEventLoop):
        raise TypeError(f"netguard.install needs an asyncio BaseEventLoop or a GuardedUVLoop, "
                        f"not {type(loop).__name__}")
    names = ("getaddrinfo", "create_connection", "create_datagram_endpoint")
    saved = {n: vars(loop)[n] for n in names if n in vars(loop)}
    previous = loop.getaddrinfo
    loop.getaddrinfo = _guarded_getaddrinfo(resolver, previous)  # type: ignore[method-assign]
    loop.create_connection = _connecting(loop.create_connection, "host")  # type: ignore[method-assign]
    loop.create_datagram_endpoint = _connecting(loop.create_datagram_endpoint,  # type: ignore[method-assign]
                                                "remote_addr")

    def uninstall() -> None:
        for n in names:
            if n in saved:
                setattr(loop, n, saved[n])
            else:
                vars(loop).pop(n, None)

    return uninstall


def _connecting(method, remote: str):
    """`method` (a stdlib loop's create_connection or create_datagram_endpoint) with
    AI_PASSIVE taken out of its flags whenever it names a remote: asyncio hands the flags
    to getaddrinfo, where AI_PASSIVE marks a binding lookup the guard passes unguarded,
    so a caller's flags would otherwise resolve the upstream around the guard."""
    params = list(inspect.signature(method).parameters)
    position = params.index(remote)

    @functools.wraps(method)
    async def connect(*args, **kw):
        named = kw.get(remote, args[position] if len(args) > position else None)
        if named is not None and kw.get("flags", 0) & socket.AI_PASSIVE:
            kw["flags"] &= ~socket.AI_PASSIVE
        return await method(*args, **kw)

    return connect


def _guarded_uvloop_class():
    try:
        from egress.guarded_uvloop import GuardedUVLoop
    except ImportError:   # uvloop is not installed: only the stdlib loop can be guarded
        return None
    return GuardedUVLoop


def _guarded_getaddrinfo(resolver: GuardedResolver, previous):
    """getaddrinfo answering guarded addresses only; binding lookups go to `previous`."""

    async def guarded_getaddrinfo(host, port, *, family=0, type=0, proto=0, flags=0):
        if isinstance(host, bytes):
            try:
                host = host.decode("ascii")
            except UnicodeDecodeError:
                raise DestinationUnresolvable(repr(host), "not a valid host name") from None
        if host is None or host == "":
            if flags & socket.AI_PASSIVE:
                return await previous(host, port, family=family, type=type, proto=proto, flags=flags)
            # getaddrinfo(None) means loopback for a connecting socket.
            raise DestinationBlocked("loopback", "(no host)", [])
        if flags & socket.AI_PASSIVE:
            return await previous(host, port, family=family, type=type, proto=proto, flags=flags)
        port_number = _port_number(port)
        if flags & socket.AI_NUMERICHOST and parse_ip_literal(host) is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        pairs = await resolver.resolve(host, port_number)
        infos = []
        for fam, ip in pairs:
            if family not in (0, socket.AF_UNSPEC) and family != fam:
                continue
            sockaddr = (ip, port_number) if fam == socket.AF_INET else (ip, port_number, 0, 0)
            for sock_type, sock_proto in _socket_kinds(type, proto):
                infos.append((fam, sock_type, sock_proto, "", sockaddr))
        if not infos:
            raise socket.gaierror(socket.EAI_ADDRFAMILY, f"{host}: no allowed address of the requested family")
        return infos

    return guarded_getaddrinfo
