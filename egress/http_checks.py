"""Pure checks on HTTP requests seen by the gateway (no I/O, table-tested)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable
from urllib.parse import unquote, unquote_plus

# Headers that only mean something between the sandbox and us.
PROXY_ONLY_HEADERS = ("proxy-authorization", "proxy-connection")


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str
    detail: str


def split_host_port(authority: str) -> tuple[str, int | None]:
    """'Example.com:443' → ('Example.com', 443); '[::1]:8080' → ('::1', 8080).

    Raises ValueError on an unparseable port.
    """
    a = authority.strip()
    if a.startswith("["):
        end = a.find("]")
        if end < 0:
            raise ValueError(f"unterminated IPv6 literal in {authority!r}")
        host, rest = a[1:end], a[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"garbage after IPv6 literal in {authority!r}")
        port_s = rest[1:] if rest else ""
    elif a.count(":") == 1:
        host, port_s = a.split(":")
    else:
        host, port_s = a, ""
    if port_s == "":
        return host, None
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"bad port in {authority!r}")
    return host, int(port_s)


def transparent_host(hosts: list[str], conn_port: int) -> tuple[str, int | None] | Refusal:
    """A transparent HTTP request's destination: its one Host header, on the port it dialled."""
    if not hosts:
        return Refusal(400, "host_missing", "transparent HTTP request without Host header: destination unknown")
    if len(hosts) > 1:
        return Refusal(400, "duplicate_host", f"{len(hosts)} Host headers")
    try:
        host, port = split_host_port(hosts[0])
    except ValueError as e:
        return Refusal(400, "invalid_host", str(e))
    if port is not None and port != conn_port:
        return Refusal(421, "authority_mismatch", f"Host header names port {port}, the connection is to port {conn_port}")
    return host, port


_BAD_VALUE_BYTE = re.compile(rb"[\r\n\x00]").search


def check_header_limits(fields: Iterable[tuple[bytes, bytes]], *, max_count: int, max_bytes: int) -> Refusal | None:
    """CR, LF or NUL in a value (first such header named), then the count, then the size (name,
    value and 4 bytes of framing per header). One scan of all values joined: a header is named
    only when one is found."""
    fields = fields if isinstance(fields, (list, tuple)) else list(fields)
    values = b"".join([v for _, v in fields])
    if _BAD_VALUE_BYTE(values):
        name = next(n for n, v in fields if _BAD_VALUE_BYTE(v))
        return Refusal(400, "bad_header_value", f"header {name.decode('latin-1')!r} contains CR, LF or NUL")
    count = len(fields)
    if count > max_count:
        return Refusal(431, "too_many_headers", f"{count} headers, limit {max_count}")
    size = len(values) + len(b"".join([n for n, _ in fields])) + 4 * count
    if size > max_bytes:
        return Refusal(431, "headers_too_large", f"{size} bytes of headers, limit {max_bytes}")
    return None


def check_framing(fields: Iterable[tuple[bytes, bytes]]) -> Refusal | None:
    """Refuse smuggling shapes even if the parser would have accepted them."""
    cl_values = []
    te_values = []
    for name, value in fields:
        n = name.lower()
        if n == b"content-length":
            cl_values.append(value.strip())
        elif n == b"transfer-encoding":
            te_values.append(value.strip().lower())
    if len(cl_values) > 1:
        return Refusal(400, "duplicate_content_length", "more than one Content-Length header")
    if cl_values and te_values:
        return Refusal(400, "content_length_and_transfer_encoding", "both Content-Length and Transfer-Encoding")
    if cl_values and not cl_values[0].isdigit():
        return Refusal(400, "bad_content_length", "Content-Length is not a number")
    if te_values and (len(te_values) > 1 or te_values[0] != b"chunked"):
        return Refusal(400, "bad_transfer_encoding", "Transfer-Encoding other than a single 'chunked'")
    return None


DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def check_request_authority(*, want_host: str, want_port: int, scheme: str, authority: str,
                            host_headers: list[str], normalize) -> Refusal | None:
    """Every name a request carries must be the destination that was decided (host AND port).

    `authority` is the absolute-form target or HTTP/2 :authority ("" when absent),
    `host_headers` every Host header value. A request that names another host or
    port in any of them would carry an injected key under that other name
    (domain fronting), so it is refused. `normalize` maps a host to its canonical
    form (raises ValueError).
    """
    if len(host_headers) > 1:
        return Refusal(400, "duplicate_host", f"{len(host_headers)} Host headers")
    default = DEFAULT_PORTS.get(scheme.lower(), want_port)
    for where, value in (("request target", authority), ("Host header", host_headers[0] if host_headers else "")):
        if not value:
            continue
        try:
            h, p = split_host_port(value)
            name = normalize(h)
        except ValueError as e:
            return Refusal(400, "invalid_host", f"{where}: {e}")
        port = p if p is not None else default
        if name != want_host or port != want_port:
            return Refusal(421, "authority_mismatch",
                           f"{where} names {name}:{port}, the connection is to {want_host}:{want_port}")
    return None


def is_websocket_upgrade(request_headers, response) -> bool:
    """The 101s mitmproxy hands to its WebSocket layer (whose messages our hooks see). Any other
    101 becomes a raw byte pipe no hook inspects (mirrors mitmproxy's HttpStream.send_response)."""
    return (response.status_code == 101
            and response.headers.get("upgrade", "").lower() == "websocket"
            and request_headers.get("sec-websocket-version", "") == "13")


# Where common frameworks read a method that replaces the request line's: Google APIs, Azure,
# Symfony (X-HTTP-Method-Override), OData (X-HTTP-Method), Express method-override
# (X-Method-Override), Laravel/Symfony/Express (`_method` in the query).
METHOD_OVERRIDE_HEADERS = (b"x-http-method-override", b"x-http-method", b"x-method-override")
_METHOD_PARAM = "_method"
_QUERY_SEPARATORS = re.compile(r"[&;]")     # ';' too: some servers split on it
_METHOD_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,32}")


def _query_overrides(target: str) -> list[str]:
    """Every `_method` value of the target's query, read as loosely as any server reads it
    (percent- and plus-decoded name, any case, '&' or ';' between pairs)."""
    query = target.partition("?")[2]
    if "_" not in unquote(query):
        return []
    out = []
    for pair in _QUERY_SEPARATORS.split(query):
        name, _, value = pair.partition("=")
        if unquote_plus(name).strip().lower() == _METHOD_PARAM:
            out.append(unquote_plus(value))
    return out


def names_method_override(fields: Iterable[tuple[bytes, bytes]], target: bytes) -> bool:
    """Does this head name a method override? (The fast path hands such requests to the gate.)"""
    return (any(n.lower() in METHOD_OVERRIDE_HEADERS for n, _ in fields)
            or bool(_query_overrides(target.decode("latin-1"))))


def method_override(method: str, fields: Iterable[tuple[bytes, bytes]], target: str) -> str | None | Refusal:
    """The other method this request names for an upstream that honours overrides (None: none).

    An upstream that honours one runs that method instead of the request line's, so the gateway
    decides (policy and credential binding) for both. Two different override methods, or one that
    is not a method token, are refused: which one a server takes is its own choice."""
    named = [v.decode("latin-1") for n, v in fields if n.lower() in METHOD_OVERRIDE_HEADERS]
    named += _query_overrides(target)
    others = set()
    for value in named:
        m = value.strip()
        if not _METHOD_TOKEN.fullmatch(m):
            return Refusal(400, "bad_method_override", "a method override that is not one HTTP method")
        if m.upper() != method.upper():
            others.add(m.upper())
    if len(others) > 1:
        return Refusal(400, "ambiguous_method_override", f"the request names {len(others)} override methods")
    return others.pop() if others else None
