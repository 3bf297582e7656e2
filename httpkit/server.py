"""Listening: bind (loopback unless told otherwise, or a 0600 unix socket), body limit, stop.

Bodies over `max_body` are refused before they are read: a declared
Content-Length answers 413 with the JSON error body; a chunked body that
grows past the limit is cut off by tornado itself (400, connection closed).
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket

import tornado.httpserver
import tornado.httputil
import tornado.netutil
import tornado.web

log = logging.getLogger("httpkit")
IDLE_SECONDS = 300   # a connection that sends no request (or no body) this long is closed


def check_bind_address(host: str, allow_non_loopback: bool = False, what: str = "this API") -> None:
    """Refuse anything but a loopback address unless explicitly allowed."""
    if allow_non_loopback or host == "localhost":
        return
    try:
        ok = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"refusing to bind {what} to {host!r}: not a loopback address "
                         "(pass allow_non_loopback=True to override)")


class Server:
    """A listening API: its port, and stop() (closes the listeners, removes the unix socket)."""

    def __init__(self, server: tornado.httpserver.HTTPServer, sockets: list[socket.socket],
                 unix_socket: str | None = None):
        self.server, self.sockets, self.unix_socket = server, sockets, unix_socket

    @property
    def port(self) -> int | None:
        for s in self.sockets:
            addr = s.getsockname()
            if isinstance(addr, tuple):
                return addr[1]
        return None

    def stop(self) -> None:
        self.server.stop()
        if self.unix_socket:
            try:
                os.unlink(self.unix_socket)
            except FileNotFoundError:
                pass


def serve(app: tornado.web.Application, *, max_body: int, host: str = "127.0.0.1", port: int = 0,
          unix_socket: str | None = None, loopback_only: bool = True, what: str = "this API",
          ssl_options=None) -> Server:
    """Start listening on the running asyncio loop. port=0 picks a free port; ssl_options (an
    ssl.SSLContext): HTTPS."""
    if unix_socket:
        sockets = [tornado.netutil.bind_unix_socket(unix_socket, mode=0o600)]
    else:
        check_bind_address(host, not loopback_only, what)
        sockets = tornado.netutil.bind_sockets(port, address=host)
    server = tornado.httpserver.HTTPServer(_BodyLimit(app, max_body), max_body_size=max_body, xheaders=False,
                                          idle_connection_timeout=IDLE_SECONDS, body_timeout=IDLE_SECONDS,
                                          ssl_options=ssl_options)
    server.add_sockets(sockets)
    return Server(server, sockets, unix_socket)


class _BodyLimit(tornado.httputil.HTTPServerConnectionDelegate):
    def __init__(self, app: tornado.web.Application, limit: int):
        self.app, self.limit = app, limit

    def start_request(self, server_conn, request_conn):
        return _LimitedRequest(self.app.start_request(server_conn, request_conn), request_conn, self.limit)

    def on_close(self, server_conn) -> None:
        self.app.on_close(server_conn)


class _LimitedRequest(tornado.httputil.HTTPMessageDelegate):
    def __init__(self, inner: tornado.httputil.HTTPMessageDelegate, conn, limit: int):
        self.inner, self.conn, self.limit = inner, conn, limit

    async def headers_received(self, start_line, headers):
        length = headers.get("Content-Length", "0").split(",")[0].strip()
        if length.isdigit() and int(length) > self.limit:
            # Answer before reading a byte of the body, then drop the connection (detached:
            # tornado reads no further), so the client sees this, not a bare 400.
            log.info("413 %s %s: body of %s bytes, limit %d", start_line.method, start_line.path.split("?")[0],
                     length, self.limit)
            body = json.dumps({"error": "too_large",
                               "message": f"request body is {int(length)} bytes; the limit is {self.limit}"}).encode()
            stream = self.conn.detach()
            try:
                await stream.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\n"
                                   b"Cache-Control: no-store\r\nConnection: close\r\n"
                                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            finally:
                stream.close()
            return None
        return await _maybe(self.inner.headers_received(start_line, headers))

    def data_received(self, chunk):
        return self.inner.data_received(chunk)

    def finish(self) -> None:
        self.inner.finish()

    def on_connection_close(self) -> None:
        self.inner.on_connection_close()


async def _maybe(result):
    return (await result) if result is not None else None
