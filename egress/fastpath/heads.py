"""Pure parsing of a connection's first bytes: the CONNECT head, the ClientHello, our answers.

No I/O. The CONNECT head is parsed here, strictly (a narrower grammar than mitmproxy's:
what it does not accept goes to mitmproxy); the ClientHello with mitmproxy's own parser
(egress.mitm_internals), so an SNI means the same here as in the gate — its common shape read
by egress.fastpath.hello_scan, which answers only where it agrees with that parser.
"""
from __future__ import annotations

import functools
import re
import socket
from dataclasses import dataclass
from http import HTTPStatus

from egress import mitm_internals, records
from egress.fastpath.hello_scan import scan_hello

ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"   # what mitmproxy answers


@dataclass(frozen=True)
class ConnectHead:
    host: str
    port: int
    proxy_authorization: str | None
    has_proxy_authorization: bool


def head_end(buf: bytes | bytearray) -> int:
    """Offset just past the blank line that ends an HTTP/1 head, or -1 while incomplete."""
    i = buf.find(b"\r\n\r\n")
    j = buf.find(b"\n\n")
    if j < 0:
        return i + 4 if i >= 0 else -1
    return i + 4 if 0 <= i and i + 4 <= j + 2 else j + 2


# A strict subset of RFC 9112 for CONNECT: what is outside it is not refused here but handed to
# mitmproxy, which parses it again and answers as it always did. So this parser may only ever be
# narrower than mitmproxy's, never wider (tests/gateway/test_fastpath_units.py compares the two).
_REG_NAME = re.compile(rb"[A-Za-z0-9_-]{1,63}(?:\.[A-Za-z0-9_-]{1,63})*\.?")
_PORT = re.compile(rb"[1-9][0-9]{0,4}")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VALUE = re.compile(rb"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*|")   # visible ASCII, inner SP/HTAB only
_VERSIONS = (b"HTTP/1.1", b"HTTP/1.0")
_FRAMING = (b"content-length", b"transfer-encoding")   # a CONNECT with a body: not ours to interpret


_MEMO_HEAD_BYTES = 1024     # heads up to this long are remembered: at most 1024 x 1 KiB


def parse_connect(head: bytes, max_headers: int = 100) -> ConnectHead | None:
    """_parse_connect, remembered for short heads: a sandbox's retries send the same bytes
    (pure and its result immutable, so a remembered answer is the same answer)."""
    if len(head) <= _MEMO_HEAD_BYTES:
        return _parse_connect_memo(head, max_headers)
    return _parse_connect(head, max_headers)


def _parse_connect(head: bytes, max_headers: int = 100) -> ConnectHead | None:
    """A CONNECT head in the strict form → its target and credentials; anything else → None
    (not ours to answer: mitmproxy parses it and answers as it always did).

    Strict: CRLF line ends only (no bare CR or LF, no obs-fold), `CONNECT host:port HTTP/1.x`
    with single spaces, host an ASCII name of DNS labels or a bracketed IPv6 address, port
    1-65535 without leading zeros, header names tokens with the colon right after them,
    values visible ASCII, at most `max_headers` headers, no Content-Length/Transfer-Encoding."""
    if not head.startswith(b"CONNECT ") or not head.endswith(b"\r\n\r\n"):
        return None
    lines = head[:-4].split(b"\r\n")
    if len(lines) - 1 > max_headers:
        return None
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] not in _VERSIONS:
        return None
    target = _parse_authority(parts[1])
    if target is None:
        return None
    auth: list[bytes] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            return None                  # also every bare CR/LF, obs-fold and space before the colon
        value = value.strip(b" \t")
        if _VALUE.fullmatch(value) is None:
            return None
        lname = name.lower()
        if lname in _FRAMING:
            return None
        if lname == b"proxy-authorization":
            auth.append(value)
    host, port = target
    return ConnectHead(host, port, auth[0].decode("ascii") if len(auth) == 1 else None, bool(auth))


_parse_connect_memo = functools.lru_cache(maxsize=1024)(_parse_connect)


def _parse_authority(target: bytes) -> tuple[str, int] | None:
    host, colon, port = target.rpartition(b":")
    if not colon or _PORT.fullmatch(port) is None or int(port) > 65535:
        return None
    if host.startswith(b"[") and host.endswith(b"]"):
        host = host[1:-1]
        try:
            socket.inet_pton(socket.AF_INET6, host.decode("ascii"))
        except (OSError, UnicodeDecodeError, ValueError):
            return None
    elif _REG_NAME.fullmatch(host) is None or len(host) > 255:
        return None
    return host.decode("ascii"), int(port)


@dataclass(frozen=True)
class Hello:
    """Outcome of looking at the first bytes of a tunnel or a transparent TLS connection."""
    state: str               # "incomplete" | "tls" | "not_tls" | "invalid"
    sni: str | None = None
    looks_like_http: bool = False
    sni_unread: bool = False     # a server_name .sni does not stand for (mitm_internals.unread_server_name)


def read_hello(data: bytes, eof: bool) -> Hello:
    if len(data) < 3 and not eof:
        return Hello("incomplete")
    if not mitm_internals.starts_like_tls(data):
        return Hello("not_tls", looks_like_http=_looks_like_http(data))
    common = scan_hello(data)            # the usual shape, read without mitmproxy's object parser
    if common is not None:
        return Hello("tls", sni=common[0], sni_unread=common[1])
    try:
        hello = mitm_internals.parse_client_hello(data)
    except ValueError:
        return Hello("invalid")
    if hello is None:
        return Hello("invalid") if eof else Hello("incomplete")
    return Hello("tls", sni=hello.sni, sni_unread=mitm_internals.unread_server_name(hello))


def _looks_like_http(data: bytes) -> bool:
    """mitmproxy's next_layer guess (rawtcp): decides plaintext_on_tls_port vs non_tls_on_tls_port."""
    return not (len(data) < 3 or b" " not in data or data.find(b" ") > data.find(b"\n")
                or not data[:3].isalpha() or data.startswith(b"SSH"))


def refusal_response(status: int, reason: str, detail: str, extra_headers: dict[str, str] | None = None, *,
                     st=None, decision=None) -> bytes:
    """The gate's refusal page (egress.records: JSON body, X-Cubegate-Reason) as HTTP/1.1 bytes."""
    return _refusal_bytes(status, reason, detail, tuple((extra_headers or {}).items()),
                          st.host if st is not None else None, st.port if st is not None else None,
                          st is not None, decision.rule if decision is not None else None,
                          decision.policy if decision is not None else None, decision is not None)


@functools.lru_cache(maxsize=1024)      # a refusal repeats: the same page for the same sandbox's retries
def _refusal_bytes(status: int, reason: str, detail: str, extra_headers: tuple, host, port, has_st: bool,
                   rule, policy, has_decision: bool) -> bytes:
    st = _Where(host, port) if has_st else None
    decision = _Rule(rule, policy) if has_decision else None
    body = records.deny_body(status, reason, detail, st=st, decision=decision)
    headers = dict(records.deny_headers(reason))
    headers.update(extra_headers)
    headers["content-length"] = str(len(body))
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    lines = [f"HTTP/1.1 {status} {phrase}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + body


@dataclass(frozen=True)
class _Where:            # what deny_body reads of a ConnState
    host: str | None
    port: int | None


@dataclass(frozen=True)
class _Rule:             # what deny_body reads of a Decision
    rule: str | None
    policy: str | None
