"""Pure normalisation of host names, host patterns and URL paths.

Both policy patterns and request hosts go through the same functions, so a
pattern and a request can only be compared in one canonical spelling:
lowercase ASCII (IDN as punycode), no trailing dot, no port.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

import idna

from egress.netguard import embedded_ipv4

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_HEX_LABEL = re.compile(r"^0x[0-9a-f]*$")
_NAME = re.compile(r"(?:[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
# Anything that needs the slow, careful path normalisation.
_PATH_NEEDS_WORK = re.compile(r"[%;\\\x00-\x1f\x7f]|//|/\.")
_MAX_NAME = 253


class InvalidHost(ValueError):
    """A host name (or host pattern) that cannot be normalised."""


class InvalidPath(ValueError):
    """A URL path that cannot be normalised without guessing."""


def parse_ip(text: str) -> IPAddress | None:
    """The address if ``text`` is a canonical IP literal (IPv6 optionally bracketed), else None.

    IPv4-mapped IPv6 addresses are returned as the IPv4 address they carry, so
    CIDR checks see one spelling.
    """
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if "%" in text:  # zone ids (fe80::1%eth0) are host-local: never a valid destination
        return None
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def deny_views(addr: IPAddress) -> tuple[IPAddress, ...]:
    """The spellings a deny CIDR is matched against: the address, and the IPv4 address an IPv6
    form carries (6to4, NAT64, Teredo, IPv4-compatible: netguard's one unwrapping), so a deny of
    203.0.113.0/24 also denies 2002:cb00:7101::1. Allows match the address as written only."""
    v4 = embedded_ipv4(addr)
    return (addr,) if v4 is None else (addr, v4)


def parse_cidr(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A policy CIDR (or bare address) in the spelling requests are compared in; ValueError.

    Requests are normalised by parse_ip (IPv4-mapped IPv6 → the IPv4 address), so a
    network inside ::ffff:0:0/96 becomes the IPv4 network it carries: else a deny
    entry written `::ffff:10.0.0.0/104` would deny nothing. Zone ids are refused
    (a request with one is invalid, so such an entry could only ever match nothing).
    Non-canonical IPv4 spellings (127.1, 0x7f.1, 010.0.0.1) are refused by ipaddress.
    """
    if not isinstance(text, str):
        raise ValueError("expected a CIDR string")
    if "%" in text:
        raise ValueError("zone ids (%eth0) name a host-local interface, never a destination")
    net = ipaddress.ip_network(text, strict=True)
    if isinstance(net, ipaddress.IPv6Network) and net.subnet_of(_MAPPED):
        net = ipaddress.IPv4Network((int(net.network_address) & 0xFFFFFFFF, net.prefixlen - 96))
    return net


def _strip_port(raw: str) -> str:
    """Remove a ``:port`` suffix; keep bare IPv6 literals intact."""
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise InvalidHost("unbalanced '[' in host")
        rest = raw[end + 1 :]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            raise InvalidHost("unexpected text after ']' in host")
        return raw[: end + 1]
    if raw.count(":") == 1:
        host, _, port = raw.partition(":")
        if not port.isdigit():
            raise InvalidHost("port in host is not a number")
        return host
    return raw  # no colon, or several (a bare IPv6 literal)


def normalise_name(text: str) -> str:
    """Canonical spelling of a DNS name (no port, no wildcard); raises InvalidHost."""
    if not text:
        raise InvalidHost("empty host name")
    name = text.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name:
        raise InvalidHost("empty host name")
    if not name.isascii():
        try:
            name = idna.encode(name, uts46=True, transitional=False).decode("ascii")
        except (idna.IDNAError, UnicodeError) as exc:
            raise InvalidHost(f"invalid internationalised name ({exc})") from None
    if len(name) > _MAX_NAME:
        raise InvalidHost(f"host name longer than {_MAX_NAME} characters")
    labels = name.split(".")
    last = labels[-1]
    if _NAME.fullmatch(name) and not (last.isdigit() or _HEX_LABEL.match(last)):
        return name  # fast path; the loop below only explains what is wrong
    for label in labels:
        if not label:
            raise InvalidHost("empty label (two dots in a row, or a leading dot)")
        if not _LABEL.match(label):
            raise InvalidHost(f"invalid label {label!r}: use letters, digits, '-' and '_' (at most 63)")
    if last.isdigit() or _HEX_LABEL.match(last):
        # 127.1, 2130706433, 0x7f.1, 010.0.0.1: resolvers accept these as IPs.
        raise InvalidHost("looks like an IP address in a non-canonical spelling")
    return name


def _looks_like_ip(host: str) -> bool:
    return host[-1:].isdigit() or ":" in host or host.startswith("[")


def normalize_host_addr(raw: str) -> tuple[str, IPAddress | None]:
    """normalize_host() plus the parsed address when the host is an IP literal."""
    if not isinstance(raw, str):
        raise InvalidHost("host is not a string")
    raw = raw.strip()
    if not raw:
        raise InvalidHost("empty host name")
    host = _strip_port(raw)
    if _looks_like_ip(host):
        addr = parse_ip(host)
        if addr is not None:
            return str(addr), addr
    if host.startswith("["):
        raise InvalidHost("bracketed host is not an IPv6 address")
    if ":" in host:
        raise InvalidHost("invalid host (stray ':')")
    return normalise_name(host), None


def normalize_host(raw: str) -> str:
    """Canonical host for matching: lowercase, one trailing dot stripped,
    IDN to punycode, ``:port`` stripped. IP literals come back in canonical
    text form (IPv6 without brackets). Raises InvalidHost.
    """
    if not isinstance(raw, str):
        raise InvalidHost("host is not a string")
    raw = raw.strip()
    if not raw:
        raise InvalidHost("empty host name")
    host = _strip_port(raw)
    addr = parse_ip(host)
    if addr is not None:
        return str(addr)
    if host.startswith("["):
        raise InvalidHost("bracketed host is not an IPv6 address")
    if ":" in host:
        raise InvalidHost("invalid host (stray ':')")
    return normalise_name(host)


@dataclass(frozen=True)
class HostPattern:
    """``name`` is the canonical domain; ``wildcard`` means ``*.name`` (strict subdomains only)."""

    name: str
    wildcard: bool

    def __str__(self) -> str:
        return f"*.{self.name}" if self.wildcard else self.name

    def matches(self, host: str) -> bool:
        """Reference check for one canonical host (the trie does the fast version)."""
        if self.wildcard:
            return host.endswith("." + self.name)
        return host == self.name

    @property
    def labels_reversed(self) -> tuple[str, ...]:
        return tuple(reversed(self.name.split(".")))


def parse_host_pattern(text: str) -> HostPattern:
    """Parse ``example.com`` or ``*.example.com``; raises InvalidHost with a helpful message."""
    if not isinstance(text, str):
        raise InvalidHost("host pattern must be a string")
    text = text.strip()
    if not text:
        raise InvalidHost("empty host pattern")
    if text == "*":
        raise InvalidHost(
            'a bare "*" is only accepted in the seed format\'s denied_domains (meaning '
            '"deny everything else"); use `default: deny` or `default: allow` instead'
        )
    if "://" in text or "/" in text:
        raise InvalidHost("write a host name, not a URL (paths go in match.paths)")
    if parse_ip(text) is not None:
        raise InvalidHost("IP addresses go in match.cidrs, not in hosts")
    if ":" in text:
        raise InvalidHost("ports go in match.ports, not in the host pattern")
    wildcard = False
    if text.startswith("**"):
        raise InvalidHost('"**" is not supported; "*.example.com" already matches every depth of subdomain')
    if text.startswith("*."):
        wildcard = True
        text = text[2:]
    if "*" in text:
        if not wildcard and text.startswith("*"):
            raise InvalidHost('"*" must be a whole label followed by a dot, like "*.example.com"')
        raise InvalidHost('"*" is only allowed as the whole leftmost label, like "*.example.com"')
    try:
        name = normalise_name(text)
    except InvalidHost as exc:
        raise InvalidHost(f"invalid host pattern: {exc}") from None
    if parse_ip(name) is not None:
        raise InvalidHost("IP addresses go in match.cidrs, not in hosts")
    return HostPattern(name=name, wildcard=wildcard)


_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEXDIGITS = frozenset("0123456789abcdefABCDEF")


def _decode_unreserved(path: str) -> str:
    """Decode %XX only where it stands for an unreserved character; refuse encoded
    separators (%2F, %5C) and NUL, which servers disagree about."""
    if "%" not in path:
        return path
    out: list[str] = []
    i = 0
    while i < len(path):
        ch = path[i]
        if ch != "%":
            out.append(ch)
            i += 1
            continue
        hexpart = path[i + 1 : i + 3]
        if len(hexpart) != 2 or not set(hexpart) <= _HEXDIGITS:
            raise InvalidPath("malformed percent-encoding")
        char = chr(int(hexpart, 16))
        if char in "/\\\x00" or char == ";":
            raise InvalidPath("encoded '/', '\\', ';' or NUL in path")
        out.append(char if char in _UNRESERVED else "%" + hexpart.upper())
        i += 3
    return "".join(out)


def normalize_path(raw: str) -> str:
    """Canonical path for prefix matching: query and fragment cut, unreserved
    %XX decoded, ``;params`` dropped per segment, duplicate slashes collapsed,
    ``.``/``..`` resolved. Raises InvalidPath where a server might read the path
    differently from us (so a deny rule cannot be sidestepped).
    """
    if raw == "*":  # OPTIONS * — matches no path rule
        return "*"
    if "#" in raw:
        # A request target has no fragment (RFC 9112 3.2) and the whole target goes upstream:
        # a server that keeps '#' in its path (Go) resolves "/ok/#/../admin" to /admin.
        raise InvalidPath("'#' in the request target")
    path = raw.split("?", 1)[0]
    if not path.startswith("/"):
        raise InvalidPath("path must start with '/'")
    if not _PATH_NEEDS_WORK.search(path) and not path.endswith("/.."):
        return path
    if "\\" in path or any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise InvalidPath("backslash or control character in path")
    path = _decode_unreserved(path)
    segments: list[str] = []
    parts = path.split("/")[1:]
    for idx, seg in enumerate(parts):
        seg = seg.split(";", 1)[0]  # Tomcat-style matrix params: "/a/..;/b" is "/b"
        last = idx == len(parts) - 1
        if seg == "" and not last:
            continue
        if seg == ".":
            if last:
                segments.append("")
            continue
        if seg == "..":
            if not segments or segments == [""]:
                raise InvalidPath("'..' climbs above the root")
            segments.pop()
            if last:
                segments.append("")
            continue
        segments.append(seg)
    return "/" + "/".join(segments)


def path_prefix_matches(prefix: str, path: str) -> bool:
    """Segment-aware prefix: ``/admin`` matches ``/admin`` and ``/admin/x`` but
    not ``/administrator``; ``/v1/`` matches everything under ``/v1/``."""
    if not path.startswith(prefix):
        return False
    if len(path) == len(prefix) or prefix.endswith("/"):
        return True
    return path[len(prefix)] == "/"
