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
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed import hostile
from testbed.hostile import MIB, Reply, Request, RequestLog

ATTACK_HOSTS = {
    "evil.allowed.test": "198.18.0.36",      # bound (ekey), h2 + http/1.1, plain :80 too
    "evh1.allowed.test": "198.18.0.37",      # bound (ekey), TLS with http/1.1 only
}
H1_ONLY = ("evh1.allowed.test",)


@dataclass
class TrailerReply(Reply):
    trailers: list[tuple[str, str]] = field(default_factory=list)


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
        return TrailerReply(200, text, body if q.get("cl") == "1" else iter([body]),
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


def serve_h2(sock: ssl.SSLSocket, srv) -> None:
    """testbed.hostile.serve_h2 plus trailers (TrailerReply) and bodies on any status."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions

    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=False, header_encoding=None, validate_inbound_headers=False,
        normalize_inbound_headers=False, validate_outbound_headers=False))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    sock.settimeout(hostile.IDLE_TIMEOUT)
    pending: dict[int, dict] = {}

    def pump(events: list) -> list[int]:
        done = []
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                pending[ev.stream_id] = {"headers": [(k.decode("latin-1"), v.decode("latin-1"))
                                                     for k, v in ev.headers], "body": hostile.BodyReader()}
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
        body = st["body"]
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
        hdrs = [(":status", str(reply.status)), *[(k.lower(), v) for k, v in reply.headers]]
        chunks = [reply.body] if isinstance(reply.body, bytes) else list(reply.body)
        if isinstance(reply.body, bytes):
            hdrs.append(("content-length", str(len(reply.body))))
        trailers = getattr(reply, "trailers", [])
        conn.send_headers(sid, [(k.encode("latin-1"), v.encode("latin-1")) for k, v in hdrs])
        for chunk in ([] if req.method == "HEAD" else chunks):
            if chunk:
                conn.send_data(sid, chunk)
        if trailers:
            conn.send_headers(sid, [(k.encode("latin-1"), v.encode("latin-1")) for k, v in trailers],
                              end_stream=True)
        else:
            conn.end_stream(sid)
        sock.sendall(conn.data_to_send())


class H1OnlyServer(hostile.Server):
    def finish_request(self, request, client_address) -> None:
        self.log.write("connect", server=f"{self.server_address[0]}:{self.server_address[1]}",
                       client=f"{client_address[0]}:{client_address[1]}", tls=self.tls)
        request.settimeout(hostile.HANDSHAKE_TIMEOUT)
        try:
            request = self.tls_context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        hostile.ThreadingHTTPServer.finish_request(self, request, client_address)


def main(argv: list[str] | None = None) -> int:
    hostile.route = route             # this process only: the handlers look their route up here
    hostile.serve_h2 = serve_h2
    parser = argparse.ArgumentParser(description="cubegate lab: hostile upstream for attack passes")
    parser.add_argument("--bind", action="append", default=[])
    parser.add_argument("--h1-only", action="append", default=[])
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--log", required=True)
    args = parser.parse_args(argv)

    log = RequestLog(args.log)

    def tls_ctx(alpn: list[str]) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.cert, args.key)
        ctx.set_alpn_protocols(alpn)
        return ctx

    servers: list[hostile.Server] = []
    for bind in args.bind:
        servers.append(hostile.Server((bind, 80), None, log))
        servers.append(hostile.Server((bind, 443), tls_ctx(["h2", "http/1.1"]), log))
    for bind in args.h1_only:
        servers.append(H1OnlyServer((bind, 443), tls_ctx(["http/1.1"]), log))
    for server in servers:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("READY hostile-attack " + " ".join(f"{s.server_address[0]}:{s.server_address[1]}" for s in servers),
          flush=True)
    while not stop.wait(0.2):
        pass
    for server in servers:
        server.server_close()
    return 0


def ensure_attack_upstream(lab) -> hostile.HostileUpstream:
    """Start this upstream once per lab (names in the lab DNS, cert from the lab CA)."""
    existing = getattr(lab, "_hostile_attack", None)
    if existing is not None and existing.popen.poll() is None:
        return existing
    for name, ip in ATTACK_HOSTS.items():
        lab.add_host(name, ip)
    cert, key = lab.ca.issue(list(ATTACK_HOSTS), list(ATTACK_HOSTS.values()), stem="hostile-attack")
    log_path = Path(lab.workdir) / "hostile-attack.jsonl"
    argv = [sys.executable, "-m", "testbed.hostile_attack", "--cert", str(cert), "--key", str(key),
            "--log", str(log_path)]
    for name, ip in ATTACK_HOSTS.items():
        argv += ["--h1-only" if name in H1_ONLY else "--bind", ip]
    popen = lab.spawn_net(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 10
    line = ""
    while time.monotonic() < deadline:
        line = popen.stdout.readline()
        if line.startswith("READY") or not line:
            break
    if not line.startswith("READY"):
        popen.kill()
        raise RuntimeError(f"hostile-attack upstream did not start: {line!r}")
    threading.Thread(target=lambda: [None for _ in popen.stdout], daemon=True).start()
    up = hostile.HostileUpstream(lab, log_path, popen)
    up.hosts = dict(ATTACK_HOSTS)
    lab._hostile_attack = up
    return up


if __name__ == "__main__":
    sys.exit(main())
