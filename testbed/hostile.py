"""A hostile lab upstream: it takes the credential the gateway injected and hands it back
to the sandbox in every shape it can think of, one route per shape.

    python -m testbed.hostile --bind 198.18.0.30 --bind 198.18.0.31 --cert c.pem --key k.pem \
        --log /tmp/hostile.jsonl [--extra-port 18071]

Listens on :80 (HTTP/1.1) and :443 (TLS, ALPN h2 and http/1.1) on every --bind address,
plus plain HTTP on each --extra-port. The key is whatever follows "Bearer " in the
request's Authorization header (the value the gateway injected).

Every connection and request is appended to the --log file as one JSON line
(``event`` connect | request | body | ws_message | progress | sent) so a test can
tell what reached the upstream and what never did. Bodies are read as a stream:
counted and hashed whole, only the first ``LOGGED_BODY`` bytes are kept (base64).

Routes (the first path segment picks the route, the rest is free for a test's marker;
query parameters in brackets):
  /echo (default)        JSON of the request, Authorization included (key raw in the body)
  /raw                   key raw in a text body
  /header                key in response headers (X-Leak, Set-Cookie)
  /split-header          key split across X-Part-A and X-Part-B
  /gzip-corrupt [cl=1]   Content-Encoding gzip: a valid gzip header, then raw bytes holding the key
                         (cl=0: chunked, streamed)
  /gzip-truncated [cl=1] gzip of a body holding the key, cut before its end (no CRC/size trailer)
  /gzip-multimember      two gzip members; the key sits in the second one
  /unknown-encoding      Content-Encoding x-custom, key raw
  /chain [ce=gzip,br]    the body encoded by each listed coding in order (gzip, deflate, br, identity)
  /json [style=slash|u|U|mixed]   JSON string holding the key with \\/ or \\u00XX escapes
  /percent [style=std|all]        key percent-encoded (all: every byte %XX)
  /b64 [offset=1&alphabet=std|url] base64 of (offset filler bytes + key + filler)
  /hex                   key hex-encoded
  /bomb [mib=1024&cl=0]  gzip bomb: mib MiB of zeros as concatenated 1 MiB gzip members
                         (about 1 KiB each), generated on the fly, then a member holding the key
  /range                 a body holding the key; honours Range (206 + Content-Range), ETag
  /range-206 [start=0&end=7]  always 206 with that slice, whatever the request asked
  /badname               a response header whose NAME is the key plus invalid bytes (HTTP/1.1)
  /chunked-split [trailer=1]  chunked body, key split across 3-byte chunks (trailer=1: and in a trailer)
  /early-hints           103 Early Hints carrying the key, then 200
  /ws                    WebSocket (HTTP/1.1): sends "Authorization: <value>" as text and as binary,
                         then echoes every message it receives
  /bytes [n=N]           N bytes of b"x" (at most 1 GiB), logs progress every 16 MiB
  /status [code=N]       empty answer with that status
"""
from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import ssl
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import brotli

from testbed.serving import LabServer, serve_until_stopped, spawn_upstream, tls_context

LOGGED_BODY = 1 << 20
MAX_BYTES = 1 << 30
PROGRESS_EVERY = 16 << 20
IDLE_TIMEOUT = 30
MIB = 1 << 20


# ----------------------------------------------------------------------------- log
class RequestLog:
    """Append-only JSONL, one writer lock for every serving thread."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self._ids = iter(range(1, 1 << 62))

    def next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def write(self, event: str, **fields: object) -> None:
        line = json.dumps({"event": event, "t": round(time.time(), 3), **fields}, sort_keys=True)
        with self._lock:
            self._f.write(line + "\n")


# ------------------------------------------------------------------------- requests
@dataclass
class Request:
    rid: int
    proto: str                      # HTTP/1.1 | HTTP/1.0 | h2
    tls: bool
    method: str
    target: str                     # request-target as received (origin or absolute form; h2: :path)
    headers: list[tuple[str, str]]  # as received, in order (h2: regular headers only)
    authority: str | None = None    # h2 :authority
    body: bytes = b""               # first LOGGED_BODY bytes

    @property
    def path(self) -> str:
        return urlsplit(self.target).path or "/"

    @property
    def query(self) -> dict[str, str]:
        return {k: v[-1] for k, v in parse_qs(urlsplit(self.target).query, keep_blank_values=True).items()}

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    @property
    def key(self) -> bytes:
        auth = self.header("authorization") or ""
        return (auth[7:] if auth.lower().startswith("bearer ") else auth).encode("latin-1", "replace")


@dataclass
class Reply:
    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes | Iterable[bytes] = b""
    length: int | None = None       # for an iterable body: Content-Length (None: chunked / streamed)
    informational: list[tuple[int, list[tuple[str, str]]]] = field(default_factory=list)
    raw_h1: Callable[["H1Handler"], None] | None = None   # writes the whole HTTP/1.1 answer itself
    websocket: bool = False
    trailers: list[tuple[str, str]] = field(default_factory=list)   # HTTP/2 only: sent after the body


# --------------------------------------------------------------------------- shapes
def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, 6, mtime=0)


_ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": _gzip,
    "x-gzip": _gzip,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "identity": lambda b: b,
}


def _json_escape(key: bytes, style: str) -> bytes:
    text = key.decode("latin-1")
    if style == "slash":
        inner = text.replace("\\", "\\\\").replace('"', '\\"').replace("/", "\\/")
    elif style in ("u", "U"):
        fmt = "\\u{:04x}" if style == "u" else "\\u{:04X}"
        inner = "".join(fmt.format(ord(c)) for c in text)
    else:  # mixed: every other char escaped, slashes as \/
        inner = "".join(("\\u{:04x}".format(ord(c)) if i % 2 else ("\\/" if c == "/" else c))
                        for i, c in enumerate(text))
    return b'{"object": "token", "token": "' + inner.encode("latin-1") + b'", "ok": true}\n'


_BOMB_MEMBER: bytes | None = None


def _bomb(mib: int, key: bytes) -> tuple[list[bytes] | Iterator[bytes], int]:
    """``mib`` MiB of zeros as concatenated gzip members, then one with the key; (chunks, length)."""
    global _BOMB_MEMBER
    if _BOMB_MEMBER is None:
        _BOMB_MEMBER = gzip.compress(b"\0" * MIB, 9, mtime=0)
    member, tail = _BOMB_MEMBER, _gzip(b"tail key=" + key + b"\n")
    batch = 64

    def gen() -> Iterator[bytes]:
        left = mib
        while left > 0:
            n = min(batch, left)
            yield member * n
            left -= n
        yield tail
    return gen(), len(member) * mib + len(tail)


def _range_body(key: bytes) -> bytes:
    return b"AAAAAAAAAAAAA key=" + key + b"; BBBBBBBBBBB\n"


def _parse_range(value: str | None, total: int) -> tuple[int, int] | None:
    if not value or not value.startswith("bytes=") or "," in value:
        return None
    a, _, b = value[6:].partition("-")
    try:
        if a == "":
            start, end = max(0, total - int(b)), total - 1
        else:
            start, end = int(a), (int(b) if b else total - 1)
    except ValueError:
        return None
    end = min(end, total - 1)
    return (start, end) if 0 <= start <= end else None


def route(req: Request, log: RequestLog) -> Reply:
    # The first path segment picks the route: "/raw/<test marker>" is /raw.
    key, q, path = req.key, req.query, "/" + req.path.lstrip("/").split("/", 1)[0]
    text = [("Content-Type", "text/plain")]
    if path == "/raw":
        return Reply(200, text, b"here is your key=" + key + b"\n")
    if path == "/header":
        k = key.decode("latin-1")
        return Reply(200, [*text, ("X-Leak", k), ("Set-Cookie", f"session={k}; Path=/")], b"look at the headers\n")
    if path == "/split-header":
        k = key.decode("latin-1")
        half = len(k) // 2
        return Reply(200, [*text, ("X-Part-A", k[:half]), ("X-Part-B", k[half:])], b"two halves\n")
    if path == "/gzip-corrupt":
        body = _gzip(b"")[:10] + b"\xff\xfe not deflate data: key=" + key + b" and more garbage\n"
        if q.get("cl", "1") == "1":
            return Reply(200, [*text, ("Content-Encoding", "gzip")], body)
        return Reply(200, [*text, ("Content-Encoding", "gzip")], iter([body[:10], body[10:]]))
    if path == "/gzip-truncated":
        full = _gzip(b"start key=" + key + b" " + bytes(range(32, 127)) * 20 + b"\n")
        body = full[:len(full) - 8 - 24]
        if q.get("cl", "1") == "1":
            return Reply(200, [*text, ("Content-Encoding", "gzip")], body)
        return Reply(200, [*text, ("Content-Encoding", "gzip")], iter([body]))
    if path == "/gzip-multimember":
        body = _gzip(b"nothing to see here\n") + _gzip(b"second member key=" + key + b"\n")
        return Reply(200, [*text, ("Content-Encoding", "gzip")], body)
    if path == "/unknown-encoding":
        return Reply(200, [*text, ("Content-Encoding", "x-custom")], b"custom coded key=" + key + b"\n")
    if path == "/chain":
        codings = [c.strip() for c in q.get("ce", "gzip,br").split(",") if c.strip()]
        body = b"chained key=" + key + b"\n"
        for c in codings:
            body = _ENCODERS[c](body)
        return Reply(200, [*text, ("Content-Encoding", ", ".join(codings))], body)
    if path == "/json":
        return Reply(200, [("Content-Type", "application/json")], _json_escape(key, q.get("style", "slash")))
    if path == "/percent":
        if q.get("style") == "all":
            enc = "".join(f"%{b:02X}" for b in key)
        else:
            enc = quote(key, safe="")
        return Reply(200, text, b"q=" + enc.encode() + b"\n")
    if path == "/b64":
        off = int(q.get("offset", "1"))
        enc = base64.urlsafe_b64encode if q.get("alphabet") == "url" else base64.b64encode
        return Reply(200, text, b"blob=" + enc(b"~" * off + key + b"~~") + b"\n")
    if path == "/hex":
        return Reply(200, text, b"hex=" + key.hex().encode() + b"\n")
    if path == "/bomb":
        chunks, length = _bomb(max(1, min(int(q.get("mib", "1024")), 4096)), key)
        cl = length if q.get("cl") == "1" else None
        return Reply(200, [("Content-Type", "application/octet-stream"), ("Content-Encoding", "gzip")],
                     chunks, length=cl)
    if path == "/range":
        body = _range_body(key)
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        hdrs = [*text, ("Accept-Ranges", "bytes"), ("ETag", etag)]
        rng = _parse_range(req.header("range"), len(body))
        if rng is None:
            return Reply(200, hdrs, body)
        start, end = rng
        return Reply(206, [*hdrs, ("Content-Range", f"bytes {start}-{end}/{len(body)}")], body[start:end + 1])
    if path == "/range-206":
        body = _range_body(key)
        start = max(0, int(q.get("start", "0")))
        end = min(len(body) - 1, int(q.get("end", str(start + 7))))
        return Reply(206, [*text, ("Accept-Ranges", "bytes"),
                           ("Content-Range", f"bytes {start}-{end}/{len(body)}")], body[start:end + 1])
    if path == "/badname":
        def raw(h: "H1Handler") -> None:
            h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n"
                          b"X-Leak-" + key + b"\x01\x7f(): 1\r\nConnection: close\r\n\r\nok\n")
            h.close_connection = True
        return Reply(raw_h1=raw)
    if path == "/chunked-split":
        def raw(h: "H1Handler") -> None:
            data = b"chunk key=" + key + b"\n"
            trailer = q.get("trailer") == "1"
            out = [b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n"
                   + (b"Trailer: X-Trailer-Leak\r\n" if trailer else b"") + b"\r\n"]
            for i in range(0, len(data), 3):
                piece = data[i:i + 3]
                out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
            out.append(b"0\r\n" + (b"X-Trailer-Leak: " + key + b"\r\n" if trailer else b"") + b"\r\n")
            for part in out:
                h.wfile.write(part)
                h.wfile.flush()
        return Reply(raw_h1=raw)
    if path == "/early-hints":
        k = key.decode("latin-1")
        return Reply(200, text, b"after the hints\n",
                     informational=[(103, [("Link", f"</style.css?k={k}>; rel=preload"), ("X-Leak", k)])])
    if path == "/ws":
        return Reply(websocket=True)
    if path == "/bytes":
        n = max(0, min(int(q.get("n", "0")), MAX_BYTES))
        return Reply(200, [("Content-Type", "application/octet-stream")], _progress(n, req, log), length=n)
    if path == "/status":
        code = int(q.get("code", "200"))
        return Reply(code if 200 <= code <= 599 else 400, text, b"")
    info = {"proto": req.proto, "tls": req.tls, "method": req.method, "target": req.target,
            "authority": req.authority, "headers": req.headers, "body_len": len(req.body)}
    return Reply(200, [("Content-Type", "application/json")], json.dumps(info, sort_keys=True).encode() + b"\n")


def _progress(n: int, req: Request, log: RequestLog) -> Iterator[bytes]:
    block = b"x" * 65536
    sent = next_mark = 0
    while sent < n:
        piece = block[:min(len(block), n - sent)]
        yield piece
        sent += len(piece)
        if sent >= next_mark:
            log.write("progress", rid=req.rid, path=req.path, sent=sent)
            next_mark += PROGRESS_EVERY
    log.write("sent", rid=req.rid, path=req.path, sent=sent, complete=True)


# --------------------------------------------------------------------------- HTTP/1.1
class BodyReader:
    """Reads a request body as a stream: counts, hashes, keeps the first LOGGED_BODY bytes."""

    def __init__(self) -> None:
        self.length = 0
        self.sha = hashlib.sha256()
        self.kept = bytearray()
        self.trailers: list[tuple[str, str]] = []
        self.complete = False

    def feed(self, data: bytes) -> None:
        self.length += len(data)
        self.sha.update(data)
        room = LOGGED_BODY - len(self.kept)
        if room > 0:
            self.kept += data[:room]

    def log(self, log: RequestLog, rid: int, path: str) -> None:
        log.write("body", rid=rid, path=path, body_len=self.length, body_sha256=self.sha.hexdigest(),
                  body_b64=base64.b64encode(bytes(self.kept)).decode(), complete=self.complete,
                  trailers=self.trailers)


class H1Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server_version = "hostile-upstream"
    timeout = IDLE_TIMEOUT

    def do_GET(self) -> None: self._handle()
    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def log_message(self, fmt: str, *args: object) -> None:
        pass

    def _read_body(self, body: BodyReader) -> None:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            while True:
                line = self.rfile.readline(1024)
                if not line:
                    return
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:
                        t = self.rfile.readline(8192)
                        if t in (b"\r\n", b"\n", b""):
                            break
                        name, _, value = t.decode("latin-1").partition(":")
                        body.trailers.append((name.strip(), value.strip()))
                    body.complete = True
                    return
                left = size
                while left:
                    data = self.rfile.read(min(left, 65536))
                    if not data:
                        return
                    body.feed(data)
                    left -= len(data)
                self.rfile.readline(8)
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            data = self.rfile.read(min(left, 65536))
            if not data:
                return
            body.feed(data)
            left -= len(data)
        body.complete = True

    def _handle(self) -> None:
        srv: Server = self.server  # type: ignore[assignment]
        log = srv.log
        req = Request(rid=log.next_id(), proto=self.request_version, tls=srv.tls, method=self.command,
                      target=self.path, headers=list(self.headers.items()))
        log.write("request", rid=req.rid, proto=req.proto, tls=req.tls, method=req.method, target=req.target,
                  path=req.path, host=self.headers.get_all("Host") or [], authority=None, headers=req.headers,
                  server=f"{srv.server_address[0]}:{srv.server_address[1]}")
        body = BodyReader()
        try:
            self._read_body(body)
        finally:
            body.log(log, req.rid, req.path)
        if not body.complete:
            self.close_connection = True
            return
        req.body = bytes(body.kept)
        reply = route(req, log)
        if reply.raw_h1 is not None:
            reply.raw_h1(self)
            return
        if reply.websocket:
            self._websocket(req)
            return
        for status, hdrs in reply.informational:
            self.wfile.write(f"HTTP/1.1 {status} Early Hints\r\n".encode()
                             + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in hdrs) + b"\r\n")
        self.send_response(reply.status)
        for k, v in reply.headers:
            self.send_header(k, v)
        chunked = False
        if isinstance(reply.body, bytes):
            self.send_header("Content-Length", str(len(reply.body)))
        elif reply.length is not None:
            self.send_header("Content-Length", str(reply.length))
        else:
            chunked = True
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.command == "HEAD":
            return
        if isinstance(reply.body, bytes):
            self.wfile.write(reply.body)
            return
        for piece in reply.body:
            if not piece:
                continue
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _websocket(self, req: Request) -> None:
        from wsproto.connection import Connection, ConnectionType
        from wsproto.events import BytesMessage, CloseConnection, Message, Ping, TextMessage
        from wsproto.utilities import generate_accept_token

        srv: Server = self.server  # type: ignore[assignment]
        wskey = (self.headers.get("Sec-WebSocket-Key") or "").encode()
        self.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: " + generate_accept_token(wskey) + b"\r\n\r\n")
        self.close_connection = True
        ws = Connection(ConnectionType.SERVER)
        auth = req.header("authorization") or ""
        sock = self.connection
        sock.sendall(ws.send(TextMessage(data=f"Authorization: {auth}")))
        sock.sendall(ws.send(BytesMessage(data=b"Authorization: " + auth.encode("latin-1", "replace"))))
        sock.settimeout(IDLE_TIMEOUT)
        while True:
            for event in ws.events():
                if isinstance(event, Message):
                    data = event.data.encode() if isinstance(event.data, str) else bytes(event.data)
                    if event.message_finished:
                        srv.log.write("ws_message", rid=req.rid, path=req.path,
                                      text=isinstance(event, TextMessage), data_b64=base64.b64encode(data).decode())
                    sock.sendall(ws.send(type(event)(data=event.data, message_finished=event.message_finished)))
                elif isinstance(event, Ping):
                    sock.sendall(ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    try:
                        sock.sendall(ws.send(event.response()))
                    except Exception:  # noqa: BLE001 - the peer is gone already
                        pass
                    srv.log.write("ws_closed", rid=req.rid, path=req.path, code=event.code)
                    return
            try:
                data = self.rfile.read1(65536)   # frames may already sit in rfile's buffer
            except OSError:
                data = b""
            if not data:
                srv.log.write("ws_closed", rid=req.rid, path=req.path, code=None)
                return
            ws.receive_data(data)


# ------------------------------------------------------------------------------ HTTP/2
def serve_h2(sock: ssl.SSLSocket, srv: "Server") -> None:
    """One h2 connection; streams answered one after another (enough for a lab)."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions

    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=False, header_encoding=None, validate_inbound_headers=False,
        normalize_inbound_headers=False, validate_outbound_headers=False))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    sock.settimeout(IDLE_TIMEOUT)
    pending: dict[int, dict] = {}

    def pump(events: list) -> list[int]:
        done = []
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                pending[ev.stream_id] = {"headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                                     for k, v in ev.headers], "body": BodyReader()}
                if ev.stream_ended:
                    done.append(ev.stream_id)
            elif isinstance(ev, h2.events.DataReceived):
                st = pending.get(ev.stream_id)
                if st is not None:
                    st["body"].feed(ev.data)
                conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.TrailersReceived):
                st = pending.get(ev.stream_id)
                if st is not None:
                    st["body"].trailers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in ev.headers]
            elif isinstance(ev, h2.events.StreamEnded):
                done.append(ev.stream_id)
            elif isinstance(ev, h2.events.ConnectionTerminated):
                raise ConnectionError("h2 connection terminated")
        return done

    def read_more() -> list[int]:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("h2 peer closed")
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            raise ConnectionError(f"h2 protocol error: {e}") from None
        out = pump(events)
        sock.sendall(conn.data_to_send())
        return out

    def send_body(stream_id: int, chunks: Iterable[bytes], trailers: list[tuple[str, str]],
                  queue: list[int]) -> None:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                window = min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
                if window <= 0:
                    queue += read_more()
                    continue
                conn.send_data(stream_id, bytes(view[:window]))
                sock.sendall(conn.data_to_send())
                view = view[window:]
        if trailers:
            conn.send_headers(stream_id, [(k.encode("latin-1"), v.encode("latin-1")) for k, v in trailers],
                              end_stream=True)
        else:
            conn.end_stream(stream_id)
        sock.sendall(conn.data_to_send())

    queue: list[int] = []
    while True:
        if not queue:
            queue += read_more()
            continue
        sid = queue.pop(0)
        st = pending.pop(sid, None)
        if st is None:
            continue
        pseudo = {k: v for k, v in st["headers"] if k.startswith(":")}
        regular = [(k, v) for k, v in st["headers"] if not k.startswith(":")]
        req = Request(rid=srv.log.next_id(), proto="h2", tls=True, method=pseudo.get(":method", "?"),
                      target=pseudo.get(":path", "/"), headers=regular, authority=pseudo.get(":authority"))
        body: BodyReader = st["body"]
        body.complete = True
        srv.log.write("request", rid=req.rid, proto="h2", tls=True, method=req.method, target=req.target,
                      path=req.path, host=[v for k, v in regular if k.lower() == "host"],
                      authority=req.authority, headers=req.headers,
                      server=f"{srv.server_address[0]}:{srv.server_address[1]}")
        body.log(srv.log, req.rid, req.path)
        req.body = bytes(body.kept)
        reply = route(req, srv.log)
        if reply.raw_h1 is not None or reply.websocket:
            reply = Reply(501, [("content-type", "text/plain")], b"HTTP/1.1 only\n")
        for status, hdrs in reply.informational:
            conn.send_headers(sid, [(":status", str(status)), *[(k.lower(), v) for k, v in hdrs]])
        hdrs = [(":status", str(reply.status)), *[(k.lower(), v) for k, v in reply.headers]]
        if isinstance(reply.body, bytes):
            hdrs.append(("content-length", str(len(reply.body))))
            chunks: Iterable[bytes] = [reply.body]
        else:
            if reply.length is not None:
                hdrs.append(("content-length", str(reply.length)))
            chunks = reply.body
        conn.send_headers(sid, [(k.encode("latin-1"), v.encode("latin-1")) for k, v in hdrs])
        sock.sendall(conn.data_to_send())
        send_body(sid, [] if req.method == "HEAD" else chunks, reply.trailers, queue)


# ------------------------------------------------------------------------------ server
class Server(LabServer):
    def __init__(self, address: tuple[str, int], tls: ssl.SSLContext | None, log: RequestLog) -> None:
        self.log = log
        super().__init__(address, H1Handler, tls)

    def finish_request(self, request, client_address) -> None:
        self.log.write("connect", server=f"{self.server_address[0]}:{self.server_address[1]}",
                       client=f"{client_address[0]}:{client_address[1]}", tls=self.tls)
        super().finish_request(request, client_address)

    def serve_other_protocol(self, request: ssl.SSLSocket) -> bool:
        if request.selected_alpn_protocol() != "h2":
            return False
        try:
            serve_h2(request, self)
        except (ConnectionError, OSError, ssl.SSLError):
            pass
        finally:
            request.close()
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cubegate lab: hostile upstream")
    parser.add_argument("--bind", action="append", required=True)
    parser.add_argument("--http-port", type=int, default=80)
    parser.add_argument("--https-port", type=int, default=443)
    parser.add_argument("--extra-port", type=int, action="append", default=[], help="more plain-HTTP ports")
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args(argv)

    log = RequestLog(args.log)
    ctx = tls_context(args.cert, args.key, ["h2", "http/1.1"])
    servers: list[Server] = []
    for bind in args.bind:
        servers.append(Server((bind, args.http_port), None, log))
        servers.append(Server((bind, args.https_port), ctx, log))
        for port in args.extra_port:
            servers.append(Server((bind, port), None, log))
    return serve_until_stopped(servers, "hostile")


# ------------------------------------------------------------------------- lab wiring
HOSTILE_HOSTS = {
    "hostile.allowed.test": "198.18.0.30",   # bound: the key is injected here
    "other.allowed.test": "198.18.0.31",     # bound to another secret (intercepted, unbound for the first)
    "sink.allowed.test": "198.18.0.32",      # bound to nothing
}
EXTRA_PORTS = (18071,)                        # plain HTTP, for "dialled the gateway's own port" checks


class HostileUpstream:
    """The hostile upstream running in a lab's net namespace, and its request log."""

    def __init__(self, lab, log_path: Path, popen) -> None:
        self.lab = lab
        self.log_path = log_path
        self.popen = popen
        self.hosts = dict(HOSTILE_HOSTS)

    def entries(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass   # a line being written right now
        return out

    def requests(self, marker: str) -> list[dict]:
        """Requests whose target contains ``marker``, each with its "body" entry merged in."""
        entries = self.entries()
        bodies = {e["rid"]: e for e in entries if e["event"] == "body"}
        reqs = [dict(e) for e in entries if e["event"] == "request" and marker in e.get("target", "")]
        for r in reqs:
            b = bodies.get(r["rid"], {})
            r["body"] = base64.b64decode(b.get("body_b64", ""))
            r["body_len"] = b.get("body_len")
            r["body_complete"] = b.get("complete")
            r["trailers"] = b.get("trailers", [])
        return reqs

    def events(self, event: str, **match: object) -> list[dict]:
        return [e for e in self.entries() if e["event"] == event and all(e.get(k) == v for k, v in match.items())]


def ensure_hostile(lab) -> HostileUpstream:
    """Start the hostile upstream once per lab."""
    args = [a for ip in HOSTILE_HOSTS.values() for a in ("--bind", ip)]
    args += [a for port in EXTRA_PORTS for a in ("--extra-port", str(port))]
    return ensure_in_lab(lab, "_hostile", HOSTILE_HOSTS, "testbed.hostile", args)


def ensure_in_lab(lab, attr: str, hosts: dict[str, str], module: str, args: list[str]) -> HostileUpstream:
    """Start `python -m module` once per lab (kept as lab.<attr>) for `hosts`: their names in
    the lab DNS, one certificate from the lab CA, its request log in the lab's workdir."""
    existing = getattr(lab, attr, None)
    if existing is not None and existing.popen.poll() is None:
        return existing
    for name, ip in hosts.items():
        lab.add_host(name, ip)
    stem = module.rsplit(".", 1)[-1].replace("_", "-")
    cert, key = lab.ca.issue(list(hosts), list(hosts.values()), stem=stem)
    log_path = Path(lab.workdir) / f"{stem}.jsonl"
    argv = [sys.executable, "-m", module, "--cert", str(cert), "--key", str(key), "--log", str(log_path), *args]
    up = HostileUpstream(lab, log_path, spawn_upstream(lab, argv, stem))
    up.hosts = dict(hosts)
    setattr(lab, attr, up)
    return up


if __name__ == "__main__":
    sys.exit(main())
