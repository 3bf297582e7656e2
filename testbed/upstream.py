"""A lab "internet" server: HTTP and HTTPS on one address, JSON answers.

    python -m testbed.upstream --bind 198.18.0.10 --http-port 80 --https-port 443 \
        --cert api.pem --key api.key --name api.allowed.test
    python -m testbed.upstream --site 198.18.0.10,api.allowed.test,api.pem,api.key \
        --site 198.18.0.12,denied.test,denied.pem,denied.key     # many sites, one process

Endpoints (any method; HEAD answers without a body):
  /echo-headers          JSON + every request header reflected as X-Echo-<Name>
  /redirect?to=URL&code=302
  /bytes?n=N             N bytes of b"x" (at most 256 MiB)
  /slow?ms=M             answer after M ms (at most 60 s)
  /status?code=N         empty answer with that status
  anything else          200 JSON {"server", "method", "path", "host", "tls",
                         "client", "headers", "header_list", "body_len",
                         "body_sha256", "body" (first 64 KiB, utf-8)}
Prints "READY" once both listeners are bound.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import ssl
import sys
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from testbed.serving import LabServer, serve_until_stopped, tls_context

MAX_BYTES = 256 * 1024 * 1024
MAX_BODY = 64 * 1024 * 1024
BODY_SHOWN = 64 * 1024
IDLE_TIMEOUT = 30


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body are two writes: without TCP_NODELAY, Nagle + the client's delayed ACK
    # add ~40 ms to every keep-alive response (it made bench_inject measure the upstream)
    disable_nagle_algorithm = True
    server_version = "cubegate-testbed-upstream"
    timeout = IDLE_TIMEOUT

    # Dispatch every method to one handler.
    def do_GET(self) -> None: self._handle()
    def do_HEAD(self) -> None: self._handle()
    def do_POST(self) -> None: self._handle()
    def do_PUT(self) -> None: self._handle()
    def do_DELETE(self) -> None: self._handle()
    def do_PATCH(self) -> None: self._handle()
    def do_OPTIONS(self) -> None: self._handle()

    def log_message(self, fmt: str, *args: object) -> None:
        if not self.server.quiet:  # type: ignore[attr-defined]
            print(f"{self.server.label} {self.client_address[0]} {fmt % args}", flush=True)  # type: ignore[attr-defined]

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks, total = [], 0
            while True:
                size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(8192) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                total += size
                if total > MAX_BODY:
                    raise ValueError("body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline(8)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise ValueError("body too large")
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, status: int, body: bytes = b"", headers: list[tuple[str, str]] = (),
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _handle(self) -> None:
        try:
            body = self._read_body()
        except ValueError as e:
            self.close_connection = True
            self._send(400, json.dumps({"error": str(e)}).encode())
            return
        try:
            self._route(body)
        except ValueError as e:  # bad query parameter
            self._send(400, json.dumps({"error": str(e)}).encode())

    def _route(self, body: bytes) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        route = url.path

        if route == "/redirect":
            code = int(query.get("code", "302"))
            if not 300 <= code <= 399:
                code = 400
            self._send(code, b"", [("Location", query.get("to", "/"))])
            return
        if route == "/bytes":
            n = max(0, min(int(query.get("n", "0")), MAX_BYTES))
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(n))
            self.end_headers()
            if self.command != "HEAD":
                block = b"x" * 65536
                left = n
                while left > 0:
                    self.wfile.write(block[:min(left, len(block))])
                    left -= len(block)
            return
        if route == "/status":
            code = int(query.get("code", "200"))
            if not 200 <= code <= 599:
                raise ValueError("status code out of range")
            self._send(code, b"")
            return
        if route == "/slow":
            time.sleep(max(0, min(int(query.get("ms", "1000")), 60000)) / 1000)

        header_list = [[k, v] for k, v in self.headers.items()]
        headers: dict[str, str] = {}
        for k, v in header_list:
            headers[k] = f"{headers[k]}, {v}" if k in headers else v
        info = {
            "server": self.server.label,  # type: ignore[attr-defined]
            "method": self.command,
            "path": self.path,
            "host": self.headers.get("Host"),
            "tls": self.server.tls,  # type: ignore[attr-defined]
            "client": self.client_address[0],
            "headers": headers,
            "header_list": header_list,
            "body_len": len(body),
            "body_sha256": hashlib.sha256(body).hexdigest(),
            "body": body[:BODY_SHOWN].decode("utf-8", "replace"),
        }
        extra: list[tuple[str, str]] = []
        if route == "/echo-headers":
            for k, v in header_list:
                extra.append((f"X-Echo-{k}", v.replace("\r", " ").replace("\n", " ")))
        self._send(200, json.dumps(info, sort_keys=True).encode() + b"\n", extra)


class Server(LabServer):
    def __init__(self, address: tuple[str, int], label: str, tls: ssl.SSLContext | None,
                 quiet: bool) -> None:
        self.label = label
        self.quiet = quiet
        super().__init__(address, Handler, tls)

    def handshake_failed(self, client_address, error: Exception) -> None:
        if not self.quiet:
            print(f"{self.label} {client_address[0]} TLS handshake failed: {error}", flush=True)


def _servers_for(bind: str, label: str, http_port: int, https_port: int,
                 cert: str | None, key: str | None, quiet: bool) -> list[Server]:
    servers = []
    if http_port:
        servers.append(Server((bind, http_port), label, None, quiet))
    if cert and https_port:
        servers.append(Server((bind, https_port), label, tls_context(cert, key, ["http/1.1"]), quiet))
    return servers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cubegate lab upstream server")
    parser.add_argument("--bind", default=None, help="address of the single site (default 127.0.0.1)")
    parser.add_argument("--http-port", type=int, default=80)
    parser.add_argument("--https-port", type=int, default=443)
    parser.add_argument("--cert")
    parser.add_argument("--key")
    parser.add_argument("--name", default=None, help="label reported as 'server'")
    parser.add_argument("--site", action="append", default=[], metavar="IP,NAME,CERT,KEY",
                        help="serve another site from this process (repeatable; same ports)")
    parser.add_argument("--quiet", action="store_true", help="do not log requests")
    args = parser.parse_args(argv)

    servers: list[Server] = []
    if args.bind or not args.site:
        bind = args.bind or "127.0.0.1"
        servers += _servers_for(bind, args.name or bind, args.http_port, args.https_port,
                                args.cert, args.key, args.quiet)
    for site in args.site:
        bind, name, cert, key = site.split(",", 3)
        servers += _servers_for(bind, name, args.http_port, args.https_port, cert, key, args.quiet)
    return serve_until_stopped(servers, "upstream",
                               lambda s: f"{s.label}={s.server_address[0]}:{s.server_address[1]}")


if __name__ == "__main__":
    sys.exit(main())
