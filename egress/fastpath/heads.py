"""Pure parsing of a connection's first bytes: the CONNECT head, the ClientHello, our answers.

No I/O. mitmproxy's own parsers do the parsing (egress.mitm_internals), so a head
or an SNI means the same here as in the gate.
"""
from __future__ import annotations

from dataclasses import dataclass

from egress import mitm_internals, records

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
    ends = [k + n for k, n in ((i, 4), (j, 2)) if k >= 0]
    return min(ends) if ends else -1


def parse_connect(head: bytes) -> ConnectHead | None:
    """A well-formed CONNECT head → its target and credentials; anything else → None
    (not ours to answer: mitmproxy parses it again and answers as it always did)."""
    lines = head.splitlines(keepends=True)
    while lines and lines[-1].strip() == b"":
        lines.pop()
    if not lines or not lines[0].startswith(b"CONNECT "):
        return None
    try:
        req = mitm_internals.read_request_head(lines)
    except ValueError:
        return None
    if req.method != "CONNECT" or not req.host or not req.port:
        return None
    values = req.headers.get_all("Proxy-Authorization")
    return ConnectHead(req.host, req.port, values[0] if len(values) == 1 else None, bool(values))


@dataclass(frozen=True)
class Hello:
    """Outcome of looking at the first bytes of a tunnel or a transparent TLS connection."""
    state: str               # "incomplete" | "tls" | "not_tls" | "invalid"
    sni: str | None = None
    looks_like_http: bool = False


def read_hello(data: bytes, eof: bool) -> Hello:
    if len(data) < 3 and not eof:
        return Hello("incomplete")
    if not mitm_internals.starts_like_tls(data):
        return Hello("not_tls", looks_like_http=_looks_like_http(data))
    try:
        hello = mitm_internals.parse_client_hello(data)
    except ValueError:
        return Hello("invalid")
    if hello is None:
        return Hello("invalid") if eof else Hello("incomplete")
    return Hello("tls", sni=hello.sni)


def _looks_like_http(data: bytes) -> bool:
    """mitmproxy's next_layer guess (rawtcp): decides plaintext_on_tls_port vs non_tls_on_tls_port."""
    return not (len(data) < 3 or b" " not in data or data.find(b" ") > data.find(b"\n")
                or not data[:3].isalpha() or data.startswith(b"SSH"))


def refusal_response(status: int, reason: str, detail: str, extra_headers: dict[str, str] | None = None, *,
                     st=None, decision=None) -> bytes:
    """The gate's refusal page (egress.records: JSON body, X-Cubegate-Reason) as HTTP/1.1 bytes."""
    from http import HTTPStatus
    body = records.deny_body(status, reason, detail, st=st, decision=decision)
    headers = dict(records.deny_headers(reason))
    headers.update(extra_headers or {})
    headers["content-length"] = str(len(body))
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    lines = [f"HTTP/1.1 {status} {phrase}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + body
