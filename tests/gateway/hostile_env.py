"""Shared set-up for the intercept-attack tests: a real gateway (explicit + transparent
listeners, cubevs switch, one sandbox), a vault whose bindings point at the hostile
upstream (testbed/hostile.py), sandbox-side clients for both modes, and a scanner that
looks for a secret in every form an attacker could decode from received bytes.
"""
from __future__ import annotations

import base64
import re
import socket
import ssl
import uuid
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

import brotli

from testbed import netns
from testbed.hostile import HOSTILE_HOSTS, ensure_hostile
from tests.gateway import rawclient
from tests.gateway.switchlab import HUB_IP, switch_lab

KEY_A = "hK9/x2Qv/sk-live-hostile-7f3a9c1e"    # bound to hostile.allowed.test (443 + plaintext 80)
KEY_B = "oB7/kw3m/sk-live-other-5d2b8e4f"      # bound to other.allowed.test (443)
H = "hostile.allowed.test"
OTHER = "other.allowed.test"
SINK = "sink.allowed.test"
SANDBOX = "sb-h1"
SECOND = "sb-h2"                                # a second identity (explicit mode only)
MODES = ("explicit", "transparent")
TIMEOUT = 5.0

POLICY = """\
name: hostile
tenant: acme
default: deny
rules:
  - name: hostile-lab
    action: allow
    match: {hosts: [hostile.allowed.test, other.allowed.test, sink.allowed.test], ports: [443, 80]}
  - name: sink-odd-port          # the port the gateway's own transparent listener uses in test_fronting
    action: allow
    match: {hosts: [sink.allowed.test], ports: [18071]}
"""


def setup_vault(gw) -> None:
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "hkey", input=KEY_A + "\n")
    gw.cli("vault", "secret", "put", "acme", "okey", input=KEY_B + "\n")
    gw.cli("vault", "binding", "add", "--id", "b-hostile", "--tenant", "acme", "--secret", "hkey",
           "--host", H, "--port", "443", "--port", "80", "--allow-plaintext",
           "--header", "Authorization", "--format", "Bearer {secret}", "--placeholder")
    gw.cli("vault", "binding", "add", "--id", "b-other", "--tenant", "acme", "--secret", "okey",
           "--host", OTHER, "--port", "443", "--header", "Authorization", "--format", "Bearer {secret}")
    gw.tokens[SECOND] = gw.cli("identity", "add", SECOND).strip()


@dataclass
class Env:
    gw: object
    sw: object
    net: object
    hostile: object
    placeholder: str

    def sandbox(self, mode: str, sandbox: str = SANDBOX) -> "Sandbox":
        return Sandbox(self, mode, sandbox)


@contextmanager
def hostile_env(lab, tmp, *, tport: int, prefix: str, settings_extra=None):
    hostile = ensure_hostile(lab)
    with switch_lab(lab, tmp, POLICY, sandbox=SANDBOX, tport=tport, prefix=prefix,
                    settings_extra=settings_extra, before_start=setup_vault) as (gw, sw, net):
        out = gw.cli("identity", "placeholders", SANDBOX)
        phs = dict(line.split("=", 1) for line in out.split() if "=" in line)
        yield Env(gw, sw, net, hostile, phs["CUBEGATE_SECRET_HKEY"])


# ------------------------------------------------------------------------ responses
@dataclass
class Response:
    wire: bytes                       # every byte the sandbox received
    status: int = 0                   # final status (0: nothing parseable, e.g. a reset)
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""                 # de-chunked when chunked
    informational: list[int] = field(default_factory=list)
    proto: str = "h1"

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.decode("latin-1").lower() == name.lower():
                return v.decode("latin-1")
        return None

    @property
    def reason(self) -> str | None:
        return self.header("X-Cubegate-Reason")

    def __repr__(self) -> str:
        return f"Response(status={self.status}, reason={self.reason}, 1xx={self.informational}, wire={self.wire[:300]!r})"


def _dechunk(data: bytes) -> bytes:
    out, i = bytearray(), 0
    while i < len(data):
        j = data.find(b"\r\n", i)
        if j < 0:
            break
        try:
            size = int(data[i:j].split(b";")[0].strip() or b"0", 16)
        except ValueError:
            break
        if size == 0:
            break
        out += data[j + 2:j + 2 + size]
        i = j + 2 + size + 2
    return bytes(out)


def parse_h1(wire: bytes) -> Response:
    resp = Response(wire=wire)
    rest = wire
    while True:
        end = rest.find(b"\r\n\r\n")
        if end < 0:
            return resp
        head, rest = rest[:end], rest[end + 4:]
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            return resp
        if 100 <= status < 200 and status != 101:
            resp.informational.append(status)
            continue
        resp.status = status
        resp.headers = [tuple(x.strip() for x in line.split(b":", 1)) for line in lines[1:] if b":" in line]
        if (resp.header("Transfer-Encoding") or "").lower() == "chunked":
            resp.body = _dechunk(rest)
        elif resp.header("Content-Length", ) is not None and resp.header("Content-Length").isdigit():
            resp.body = rest[:int(resp.header("Content-Length"))]
        else:
            resp.body = rest
        return resp


# --------------------------------------------------------------------- leak scanner
_JSON_ESC = re.compile(rb'\\u([0-9a-fA-F]{4})|\\(["\\/bfnrt])')
_SIMPLE = {b'"': b'"', b"\\": b"\\", b"/": b"/", b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t"}
_DECODE_CAP = 4 << 20


def json_unescape(data: bytes) -> bytes:
    def sub(m: re.Match) -> bytes:
        if m.group(1):
            cp = int(m.group(1), 16)
            return bytes([cp]) if cp < 256 else chr(cp).encode()
        return _SIMPLE[m.group(2)]
    return _JSON_ESC.sub(sub, data)


def _inflate(data: bytes, wbits: int) -> bytes:
    """Whatever a tolerant decoder gets out of data (corrupt or truncated streams included)."""
    d, out = zlib.decompressobj(wbits), bytearray()
    for i in range(0, min(len(data), 1 << 22), 256):
        try:
            out += d.decompress(data[i:i + 256], _DECODE_CAP - len(out))
        except zlib.error:
            break
        if len(out) >= _DECODE_CAP or d.eof:
            break
    return bytes(out)


def _unbrotli(data: bytes) -> bytes:
    d, out = brotli.Decompressor(), bytearray()
    for i in range(0, min(len(data), 1 << 22), 256):
        try:
            out += d.process(data[i:i + 256])
        except brotli.error:
            break
        if len(out) >= _DECODE_CAP:
            break
    return bytes(out)


def decoded_views(data: bytes, depth: int = 3) -> list[bytes]:
    """data decoded as gzip (every member start, first and last ones), zlib, raw deflate and br."""
    if depth == 0 or not data:
        return []
    out = []
    starts = [m.start() for m in re.finditer(rb"\x1f\x8b\x08", data[:1 << 23])]
    for s in starts[:8] + starts[-8:]:
        out.append(_inflate(data[s:], 31))
    out += [_inflate(data, 15), _inflate(data, -15), _unbrotli(data)]
    out = [v for v in out if v]
    for v in list(out):
        out += decoded_views(v, depth - 1)
    return out


def b64_pieces(secret: bytes) -> list[bytes]:
    """The part of base64(anything + secret + anything) that depends only on secret, per alignment."""
    out = []
    for enc in (base64.b64encode, base64.urlsafe_b64encode):
        for shift in range(3):
            e = enc(b"\0" * shift + secret)
            out.append(e[(0, 2, 3)[shift]:4 * ((shift + len(secret)) // 3)])
    return out


def found_forms(data: bytes, secret: str | bytes) -> list[str]:
    """Names of the forms of ``secret`` recoverable from ``data``; [] means none."""
    s = secret.encode() if isinstance(secret, str) else secret
    hits = []
    views = {"raw": data, "percent": unquote_to_bytes(data), "json": json_unescape(data)}
    views["json+percent"] = unquote_to_bytes(views["json"])
    for i, v in enumerate(decoded_views(data)):
        views[f"decoded{i}"] = v
        views[f"decoded{i}+json"] = json_unescape(v)
        views[f"decoded{i}+percent"] = unquote_to_bytes(v)
    for name, v in views.items():
        if s in v:
            hits.append(name)
        if any(p in v for p in b64_pieces(s)):
            hits.append(name + "+base64")
        if s.hex().encode() in v.lower():
            hits.append(name + "+hex")
    return hits


def assert_never_leaked(data: bytes, *secrets: str, what: str = "") -> None:
    for s in secrets:
        hits = found_forms(data, s)
        assert not hits, f"{what}: secret {s[:4]}… recoverable as {hits}: {data[:400]!r}"


# ------------------------------------------------------------------------- clients
def new_marker(prefix: str) -> str:
    """A unique path marker: it picks one test's requests out of the upstream's log."""
    return prefix + uuid.uuid4().hex[:10]


def injected_request(upstream, marker: str, key: str) -> dict:
    """The one upstream request for ``marker``, after checking the gateway injected ``key`` into it."""
    got = upstream.requests(marker)
    assert len(got) == 1, f"upstream got {len(got)} requests for {marker}"
    auth = [v for k, v in got[0]["headers"] if k.lower() == "authorization"]
    assert auth == [f"Bearer {key}"], "the key was not injected: the test would prove nothing"
    return got[0]


class Refused(Exception):
    def __init__(self, head: bytes):
        super().__init__(head[:200])
        self.head = head
        self.status = rawclient.connect_status(head)


def recv_until_close(sock: socket.socket, timeout: float = TIMEOUT, limit: int = 8 << 20) -> bytes:
    return rawclient.recv_all(sock, timeout, limit)


class Sandbox:
    """The sandbox's side of the wire, in explicit-proxy or transparent mode."""

    def __init__(self, env: Env, mode: str, sandbox: str = SANDBOX) -> None:
        assert mode in MODES
        self.env, self.mode, self.sandbox = env, mode, sandbox
        gw = env.gw
        self.auth = rawclient.auth_header(sandbox, gw.tokens[sandbox])

    @property
    def _own_netns(self) -> bool:
        """The attached sandbox's token works only from its own address (explicit mode too); SECOND
        is an identity of no sandbox, used from the gateway's namespace."""
        return self.mode == "transparent" or self.sandbox == self.env.net.sandbox_id

    @property
    def ns(self) -> str:
        return self.env.net.netns if self._own_netns else self.env.gw.lab.gw_ns

    @property
    def proxy_addr(self) -> tuple[str, int]:
        return (HUB_IP if self._own_netns else "127.0.0.1"), self.env.gw.proxy_port

    def connect(self, addr: tuple[str, int], timeout: float = TIMEOUT) -> socket.socket:
        """A TCP socket created (and connected) inside the sandbox's namespace."""
        return netns.call_in_netns(self.ns, socket.create_connection, addr, timeout, timeout=timeout + 5)

    def tls(self, host: str, *, port: int = 443, alpn: tuple[str, ...] = ("http/1.1",),
            sni: str | None = None) -> ssl.SSLSocket:
        if self.mode == "explicit":
            s = self.connect(self.proxy_addr)
            s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n{self.auth}\r\n\r\n".encode())
            head = rawclient.read_head(s)
            if rawclient.connect_status(head) != 200:
                s.close()
                raise Refused(head)
        else:
            s = self.connect((HOSTILE_HOSTS.get(host, host), port))
        ctx = ssl.create_default_context(cafile=str(self.env.gw.ca_cert))
        ctx.load_verify_locations(str(self.env.gw.lab.ca.bundle_path))
        ctx.set_alpn_protocols(list(alpn))
        s.settimeout(TIMEOUT)
        return ctx.wrap_socket(s, server_hostname=sni or host)

    def plain(self, host: str, port: int = 80) -> socket.socket:
        if self.mode == "explicit":
            return self.connect(self.proxy_addr)
        return self.connect((HOSTILE_HOSTS.get(host, host), port))

    def request_bytes(self, scheme: str, host: str, path: str, *, method: str = "GET",
                      headers: list[tuple[str, str]] | None = None, body: bytes | None = None,
                      host_header: str | None = None, target: str | None = None) -> bytes:
        if target is None:
            target = f"http://{host}{path}" if scheme == "http" and self.mode == "explicit" else path
        hdrs = [("Host", host_header if host_header is not None else host)]
        hdrs += headers or []
        if scheme == "http" and self.mode == "explicit":
            hdrs.append(tuple(self.auth.split(": ", 1)))
        names = {k.lower() for k, _ in hdrs}
        if body is not None and "content-length" not in names and "transfer-encoding" not in names:
            hdrs.append(("Content-Length", str(len(body))))
        if "connection" not in names:
            hdrs.append(("Connection", "close"))
        head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs) + "\r\n"
        return head.encode("latin-1") + (body or b"")

    def exchange(self, scheme: str, host: str, raw: bytes, timeout: float = TIMEOUT) -> Response:
        """Send raw request bytes on a fresh connection; read until the peer closes (bounded)."""
        try:
            sock = self.tls(host) if scheme == "https" else self.plain(host)
        except Refused as e:
            return parse_h1(e.head)
        try:
            sock.sendall(raw)
            return parse_h1(recv_until_close(sock, timeout))
        except (ssl.SSLError, OSError) as e:
            return Response(wire=b"", status=0, body=str(e).encode())
        finally:
            sock.close()

    def get(self, scheme: str, host: str, path: str, **kw) -> Response:
        timeout = kw.pop("timeout", TIMEOUT)
        return self.exchange(scheme, host, self.request_bytes(scheme, host, path, **kw), timeout)

    def h2(self, host: str, headers: list[tuple[str, str]], body: bytes = b"", timeout: float = TIMEOUT) -> Response:
        sock = self.tls(host, alpn=("h2",))
        try:
            if sock.selected_alpn_protocol() != "h2":
                raise AssertionError(f"gateway did not negotiate h2 ({sock.selected_alpn_protocol()})")
            out = rawclient.h2_request(sock, headers, body, timeout=timeout)
        finally:
            sock.close()
        hdrs = [(k.encode(), v.encode()) for k, v in out["headers"]]
        # HPACK hides header bytes on the wire: scan the decoded blocks and the data as well
        seen = b"".join(k.encode() + b": " + v.encode() + b"\r\n" for k, v in out["all_headers"])
        return Response(wire=seen + out["data"] + out["wire"], status=out["status"], headers=hdrs, body=out["data"],
                        informational=out["informational"], proto="h2")

    def direct_gateway(self, port: int) -> socket.socket:
        """Transparent mode: dial the gateway's own address and port (not steered)."""
        return self.connect((HUB_IP, port))


def audit_reason(gw, reason: str, marker: str, timeout: float = 3.0) -> dict:
    return gw.wait_record(lambda r: r.get("reason") == reason and marker in (r.get("path") or ""), timeout=timeout)
