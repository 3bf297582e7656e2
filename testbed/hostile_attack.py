"""A second hostile lab upstream for attack passes: every route of testbed/hostile.py plus
shapes that live outside a response body (status line, HTTP/2 trailers, protocol
switches, WebSocket control frames, transfer codings) and resource attacks.

    python -m testbed.hostile_attack --bind 198.18.0.36 --h1-only 198.18.0.37 --cert c.pem --key k.pem \
        --log /tmp/attack.jsonl

--bind addresses serve :80 and :443 (ALPN h2 + http/1.1) like testbed/hostile.py;
--h1-only addresses serve :443 with ALPN http/1.1 only (so an HTTP/2 sandbox is
proxied to HTTP/1.1 upstream connections). Same JSONL log format, plus:
  upgraded     bytes the peer sent after a 101 (base64, first 64 KiB)
  ws_ctl       a WebSocket control frame from the peer (ping/pong payload, close reason)
  hold_start   /hold began (one per upstream request, with the connection's client port)

Extra routes (the first path segment picks the route):
  /reason                 HTTP/1.1 status line whose reason phrase is the key
  /trailers [cl=0]        HTTP/2: body, then a trailer x-trailer-leak: <key>  (cl=1: with content-length)
  /nobody [code=204]      that status, then body bytes holding the key anyway (HTTP/2 DATA frames)
  /upgrade [proto=foo]    101 Switching Protocols to <proto>, then the key raw; logs what the peer sends
  /te [te=gzip,chunked]   Transfer-Encoding gzip (chunked or read-until-close) over a body holding the key
  /wsctl [send=1]         WebSocket: a ping whose payload holds the key, then a close whose reason holds it
                          (send=0: sends nothing, logs the peer's control frames for 3 s)
  /hexmixed               the key hex-encoded, alternating upper and lower case
  /hold [s=3]             answers after s seconds (at most 10)
  /endless-head [mib=64]  a response head that never ends: 64 KiB header lines up to mib MiB
  /ce [h=gzip&enc=gzip]   body encoded by each coding in enc (left to right), Content-Encoding: h verbatim
  /gzip-split             two gzip members, the key split between them
  /br-split               one brotli stream, the key split across two metablocks
  /hdrname                a response header whose NAME is the key in unpadded base64url (a valid token)
  /location               302 with the key in the Location query
"""
from __future__ import annotations

import argparse
import base64
import gzip
import sys
import time

from testbed import hostile
from testbed.hostile import MIB, Reply, Request, RequestLog
from testbed.serving import serve_until_stopped, tls_context

ATTACK_HOSTS = {
    "evil.allowed.test": "198.18.0.36",      # bound (ekey), h2 + http/1.1, plain :80 too
    "evh1.allowed.test": "198.18.0.37",      # bound (ekey), TLS with http/1.1 only
}
H1_ONLY = ("evh1.allowed.test",)


def mixed_case_hex(data: bytes) -> str:
    """Hex with its letters alternately lower and upper case (any hex decoder reads it)."""
    out, upper = [], False
    for c in data.hex():
        if c.isalpha():
            c, upper = (c.upper() if upper else c), not upper
        out.append(c)
    return "".join(out)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


def _read_for(sock, seconds: float, limit: int = 65536) -> bytes:
    got = bytearray()
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < deadline and len(got) < limit:
        try:
            data = sock.recv(65536)
        except (TimeoutError, OSError):
            continue
        if not data:
            break
        got += data
    return bytes(got)


def _ws(h, req: Request, log: RequestLog, send: bool) -> None:
    from wsproto.connection import Connection, ConnectionType
    from wsproto.events import CloseConnection, Message, Ping, Pong
    from wsproto.utilities import generate_accept_token

    wskey = (h.headers.get("Sec-WebSocket-Key") or "").encode()
    h.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  b"Sec-WebSocket-Accept: " + generate_accept_token(wskey) + b"\r\n\r\n")
    h.wfile.flush()
    h.close_connection = True
    ws = Connection(ConnectionType.SERVER)
    sock = h.connection
    if send:
        sock.sendall(ws.send(Ping(payload=b"ping key=" + req.key)))
    deadline = time.monotonic() + 3
    sock.settimeout(0.2)
    sent_close = False
    while time.monotonic() < deadline:
        for ev in ws.events():
            if isinstance(ev, (Ping, Pong)):
                log.write("ws_ctl", rid=req.rid, path=req.path, kind=type(ev).__name__.lower(),
                          data_b64=base64.b64encode(bytes(ev.payload)).decode())
                if isinstance(ev, Ping):
                    sock.sendall(ws.send(ev.response()))
                elif send and not sent_close:
                    sock.sendall(ws.send(CloseConnection(code=1000, reason="key=" + req.key.decode("latin-1"))))
                    sent_close = True
            elif isinstance(ev, CloseConnection):
                log.write("ws_ctl", rid=req.rid, path=req.path, kind="close", code=ev.code,
                          data_b64=base64.b64encode((ev.reason or "").encode()).decode())
                return
            elif isinstance(ev, Message):
                pass
        try:
            data = h.rfile.read1(65536)
        except (TimeoutError, OSError):
            continue
        if not data:
            return
        ws.receive_data(data)


def route(req: Request, log: RequestLog) -> Reply:
    key, q, path = req.key, req.query, "/" + req.path.lstrip("/").split("/", 1)[0]
    text = [("Content-Type", "text/plain")]
    if path == "/reason":
        def raw(h) -> None:
            h.wfile.write(b"HTTP/1.1 200 key=" + key + b"\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
            h.close_connection = True
        return Reply(raw_h1=raw)
    if path == "/trailers":
        body = b"body without the key\n"
        return Reply(200, text, body if q.get("cl") == "1" else iter([body]),
                     trailers=[("x-trailer-leak", key.decode("latin-1"))])
    if path == "/nobody":
        code = int(q.get("code", "204"))

        def raw(h) -> None:
            h.wfile.write(b"HTTP/1.1 %d Nothing\r\nConnection: close\r\n\r\nbody key=%s\n" % (code, key))
            h.close_connection = True
        return Reply(code, text, iter([b"body key=" + key + b"\n"]), raw_h1=None if req.proto == "h2" else raw)
    if path == "/upgrade":
        proto = q.get("proto", "foo")

        def raw(h) -> None:
            h.wfile.write(f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: {proto}\r\nConnection: Upgrade\r\n\r\n"
                          .encode() + b"raw key=" + key + b"\n")
            h.wfile.flush()
            h.close_connection = True
            got = _read_for(h.connection, 1.0)
            log.write("upgraded", rid=req.rid, path=req.path, data_b64=base64.b64encode(got).decode())
        return Reply(raw_h1=raw)
    if path == "/te":
        te = q.get("te", "gzip,chunked")
        payload = gzip.compress(b"transfer-coded key=" + key + b"\n", mtime=0)

        def raw(h) -> None:
            h.wfile.write(f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: {te}\r\n"
                          "Connection: close\r\n\r\n".encode())
            h.wfile.write(_chunk(payload) + b"0\r\n\r\n" if te.endswith("chunked") else payload)
            h.close_connection = True
        return Reply(raw_h1=raw)
    if path == "/wsctl":
        send = q.get("send", "1") == "1"
        return Reply(raw_h1=lambda h: _ws(h, req, log, send))
    if path == "/hexmixed":
        mixed = mixed_case_hex(key)
        return Reply(200, text, b"hex=" + mixed.encode() + b"\n")
    if path == "/hold":
        time.sleep(max(0.0, min(float(q.get("s", "3")), 10.0)))
        return Reply(200, text, b"held\n")
    if path == "/endless-head":
        mib = max(1, min(int(q.get("mib", "64")), 256))

        def raw(h) -> None:
            line = b"X-Pad: " + b"a" * (64 * 1024 - 9) + b"\r\n"
            sent = 0
            try:
                h.wfile.write(b"HTTP/1.1 200 OK\r\n")
                while sent < mib * MIB:
                    h.wfile.write(line)
                    sent += len(line)
            except OSError:
                pass
            log.write("endless_sent", rid=req.rid, path=req.path, sent=sent)
            h.close_connection = True
        return Reply(raw_h1=raw)
    if path == "/ce":
        body = b"coded key=" + key + b"\n"
        for c in [c.strip() for c in q.get("enc", "gzip").split(",") if c.strip()]:
            body = hostile._ENCODERS[c](body)
        return Reply(200, [*text, ("Content-Encoding", q.get("h", "gzip"))], body)
    if path == "/gzip-split":
        half = len(key) // 2
        body = gzip.compress(b"first key=" + key[:half], mtime=0) + gzip.compress(key[half:] + b"\n", mtime=0)
        return Reply(200, [*text, ("Content-Encoding", "gzip")], body)
    if path == "/br-split":
        import brotli
        half = len(key) // 2
        comp = brotli.Compressor()
        body = comp.process(b"first key=" + key[:half]) + comp.flush() + comp.process(key[half:] + b"\n") + comp.finish()
        return Reply(200, [*text, ("Content-Encoding", "br")], body)
    if path == "/hdrname":
        name = base64.urlsafe_b64encode(key).rstrip(b"=").decode()
        return Reply(200, [*text, (name, "1")], b"look at the header names\n")
    if path == "/location":
        return Reply(302, [*text, ("Location", "https://elsewhere.test/cb?k=" + key.decode("latin-1"))], b"moved\n")
    return _hostile_route(req, log)


_hostile_route = hostile.route


def main(argv: list[str] | None = None) -> int:
    hostile.route = route             # this process only: the handlers look their route up here
    parser = argparse.ArgumentParser(description="cubegate lab: hostile upstream for attack passes")
    parser.add_argument("--bind", action="append", default=[])
    parser.add_argument("--h1-only", action="append", default=[])
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args(argv)

    log = RequestLog(args.log)
    servers: list[hostile.Server] = []
    for bind in args.bind:
        servers.append(hostile.Server((bind, 80), None, log))
        servers.append(hostile.Server((bind, 443), tls_context(args.cert, args.key, ["h2", "http/1.1"]), log))
    for bind in args.h1_only:   # ALPN never picks h2 here: every connection is served as HTTP/1.1
        servers.append(hostile.Server((bind, 443), tls_context(args.cert, args.key, ["http/1.1"]), log))
    return serve_until_stopped(servers, "hostile-attack")


def ensure_attack_upstream(lab) -> hostile.HostileUpstream:
    """Start this upstream once per lab."""
    args = [a for name, ip in ATTACK_HOSTS.items() for a in ("--h1-only" if name in H1_ONLY else "--bind", ip)]
    return hostile.ensure_in_lab(lab, "_hostile_attack", ATTACK_HOSTS, "testbed.hostile_attack", args)


if __name__ == "__main__":
    sys.exit(main())
