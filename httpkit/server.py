"""Listening: bind (loopback unless told otherwise, or a 0600 unix socket), body limit, stop.

Bodies over `max_body` (or the route's own limit, `body_limit(path)`) are refused
before they are read: a declared Content-Length answers 413 with the JSON error
body; a chunked body that grows past the limit is cut off (400, connection closed).
Tornado reads a whole body before any handler (and its token check) runs, so the
bodies one server holds at a time are bounded too (`max_buffered`, default twice
`max_body`): a request whose body would not fit is answered 503 before it is read.

That budget is reserved from the declared length, before a byte arrives: without
`admit`, anyone on loopback could hold all of it with two idle connections (for the
body timeout) and every other caller's body would be 503. `admit(headers)` names who
the headers' valid credentials belong to (None: nobody). Each such caller may hold at
most half the budget (one tenant cannot take it from the others); a request nobody is
admitted for may send only a small body (ANON_MAX_BODY, from a small budget of its own,
ANON_BUDGET: it still reaches its handler, which answers 401 and audits it), anything
larger is answered 401 before it is read.

Anyone on the host may send such small bodies, so none may hold the anonymous budget for
long: one not complete ANON_BODY_SECONDS after its headers is answered 408 and closed, and
when the budget is full a new one takes the place of the oldest still being read (that one
is answered 503 and closed). A real client's small body (a login form) arrives with its
headers and is read at once; idle connections can no longer keep it out.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
from collections.abc import Callable

import tornado.httpserver
import tornado.httputil
import tornado.ioloop
import tornado.netutil
import tornado.web

from httpkit.connections import MAX_CONNECTIONS, CappedHTTPServer

log = logging.getLogger("httpkit")
IDLE_SECONDS = 300   # a connection that sends no request (or no body) this long is closed
ANON_MAX_BODY = 64 << 10    # a body whose headers carry no valid credentials (see admit)
ANON_BUDGET = 1 << 20       # all such bodies being read at once
ANON_BODY_SECONDS = 10.0    # how long one such body may take to arrive


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


Admit = Callable[[tornado.httputil.HTTPHeaders], "str | None"]


def bearer_admit(verify: Callable[[str], object]) -> Admit:
    """`admit` for an API whose handlers take a bearer token (JsonHandler): the token's id
    when verify(token) knows it (the same check the handler makes after the body)."""
    def admit(headers: tornado.httputil.HTTPHeaders) -> str | None:
        scheme, _, token = headers.get("Authorization", "").partition(" ")
        token = token.strip()
        found = verify(token) if scheme.lower() == "bearer" and token else None
        return None if found is None else str(getattr(found, "id", found))
    return admit


def session_admit(sessions, cookie: str) -> Admit:
    """`admit` for a browser app (SessionHandler): the actor of the live session of `sessions`
    the session cookie (`cookie`, or its `__Host-` form over TLS) names (looked at, not touched)."""
    def admit(headers: tornado.httputil.HTTPHeaders) -> str | None:
        try:
            jar = tornado.httputil.parse_cookie(headers.get("Cookie", ""))
        except Exception:  # noqa: BLE001 - a malformed cookie header admits nobody
            return None
        for name in (cookie, "__Host-" + cookie):
            session = sessions.get(jar.get(name), touch=False)
            if session is not None:
                return str(session.actor)
        return None
    return admit


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
          ssl_options=None, body_limit: Callable[[str], int] | None = None,
          max_buffered: int | None = None, admit: Admit | None = None,
          max_connections: int = MAX_CONNECTIONS) -> Server:
    """Start listening on the running asyncio loop. port=0 picks a free port; ssl_options (an
    ssl.SSLContext): HTTPS. body_limit(path): a route's own limit (at most max_body);
    max_buffered: all bodies being read at once (default 2 * max_body); admit(headers): who their
    valid credentials belong to, or None (no admit: every request may use the whole budget);
    max_connections: held at once (connections.py)."""
    if unix_socket:
        sockets = [tornado.netutil.bind_unix_socket(unix_socket, mode=0o600)]
    else:
        check_bind_address(host, not loopback_only, what)
        sockets = tornado.netutil.bind_sockets(port, address=host)
    total = 2 * max_body if max_buffered is None else max_buffered
    budget = _Budget(total, share=total // 2 if admit is not None else None)
    delegate = _BodyLimit(app, max_body, body_limit, budget, admit)
    server = CappedHTTPServer(delegate, max_body_size=max_body,
                                          xheaders=False,
                                          idle_connection_timeout=IDLE_SECONDS, body_timeout=IDLE_SECONDS,
                                          ssl_options=ssl_options)
    server.max_connections = max_connections
    delegate.server = server
    server.add_sockets(sockets)
    return Server(server, sockets, unix_socket)


class _Budget:
    """Bytes of request bodies being read at once, and by each caller at most `share` (the
    event loop's thread only: no lock)."""

    def __init__(self, limit: int, share: int | None = None):
        self.limit, self.used, self.share = limit, 0, share
        self.used_by: dict[str, int] = {}

    def take(self, n: int, who: str | None = None) -> bool:
        mine = self.used_by.get(who, 0) if who is not None else 0
        if self.used + n > self.limit or (self.share is not None and who is not None and mine + n > self.share):
            return False
        self.used += n
        if who is not None:
            self.used_by[who] = mine + n
        return True

    def give(self, n: int, who: str | None = None) -> None:
        self.used -= n
        if who is not None:
            left = self.used_by.get(who, 0) - n
            if left > 0:
                self.used_by[who] = left
            else:
                self.used_by.pop(who, None)


class _BodyLimit(tornado.httputil.HTTPServerConnectionDelegate):
    def __init__(self, app: tornado.web.Application, limit: int, body_limit, budget: _Budget, admit=None):
        self.app, self.limit, self.body_limit, self.budget = app, limit, body_limit, budget
        self.admit, self.anon_budget = admit, _Budget(ANON_BUDGET)
        self.anon_reading: dict[_LimitedRequest, None] = {}     # in arrival order: the oldest first

    def start_request(self, server_conn, request_conn):
        return _LimitedRequest(self.app.start_request(server_conn, request_conn), request_conn, self, server_conn)

    def on_close(self, server_conn) -> None:
        self.app.on_close(server_conn)


class _LimitedRequest(tornado.httputil.HTTPMessageDelegate):
    def __init__(self, inner: tornado.httputil.HTTPMessageDelegate, conn, owner: _BodyLimit, server_conn=None):
        self.inner, self.conn, self.owner, self.server_conn = inner, conn, owner, server_conn
        self.limit, self.held, self.seen = owner.limit, 0, 0
        self.held_from, self.who, self.deadline = owner.budget, None, None
        self.dropped = False

    async def _refuse(self, start_line, status: str, error: str, message: str) -> None:
        """Answer before reading a byte of the body, then drop the connection (detached:
        tornado reads no further), so the client sees this, not a bare 400."""
        log.info("%s %s %s: %s", status.split()[0], start_line.method, start_line.path.split("?")[0], message)
        stream = self.conn.detach()
        try:
            await stream.write(_error_response(status, error, message))
        finally:
            stream.close()

    async def headers_received(self, start_line, headers):
        server = getattr(self.owner, "server", None)
        if server is not None:
            server.busy(self.server_conn, self.conn)
        path = start_line.path.split("?", 1)[0]
        if self.owner.body_limit is not None:
            self.limit = min(self.owner.limit, self.owner.body_limit(path))
        raw = headers.get("Content-Length")
        length = raw.split(",")[0].strip() if raw is not None else None
        if length is not None and not (length.isascii() and length.isdigit()):
            # str.isdigit() takes "²", which int() then refuses: a clear 400, not a dropped connection
            return await self._refuse(start_line, "400 Bad Request", "bad_request", "Content-Length is not a number")
        if length is not None and int(length) > self.limit:
            return await self._refuse(start_line, "413 Payload Too Large", "too_large",
                                      f"request body is {int(length)} bytes; the limit is {self.limit}")
        chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        has_body = chunked or (length is not None and int(length) > 0)
        if has_body and self.owner.admit is not None:
            self.who = self.owner.admit(headers)
            if self.who is None:
                if chunked or int(length) > ANON_MAX_BODY:
                    return await self._refuse(start_line, "401 Unauthorized", "unauthorized",
                                              f"a body over {ANON_MAX_BODY} bytes needs valid credentials in the headers")
                self.limit, self.held_from = min(self.limit, ANON_MAX_BODY), self.owner.anon_budget
        # what this body may hold: its declared length, else (chunked) the whole limit
        want = int(length) if length is not None else (self.limit if chunked else 0)
        if want:
            if not (self._hold_anonymous(want) if self.held_from is self.owner.anon_budget
                    else self.held_from.take(want, self.who)):
                return await self._refuse(start_line, "503 Service Unavailable", "busy",
                                          "too many request bodies are being received; try again")
            self.held = want
        return await _maybe(self.inner.headers_received(start_line, headers))

    def _hold_anonymous(self, want: int) -> bool:
        """Take `want` of the anonymous budget, making room by dropping the oldest anonymous
        bodies still being read; and drop this one too if it is not complete in time."""
        reading = self.owner.anon_reading
        while not self.held_from.take(want):
            if not reading:
                return False
            next(iter(reading))._drop("503 Service Unavailable", "busy",
                                      "other request bodies without credentials arrived; send yours at once")
        reading[self] = None
        self.deadline = tornado.ioloop.IOLoop.current().call_later(
            ANON_BODY_SECONDS, self._drop, "408 Request Timeout", "timeout",
            f"a request body without credentials must arrive within {ANON_BODY_SECONDS:g} s")
        return True

    def _drop(self, status: str, error: str, message: str) -> None:
        """Give up on this anonymous body mid-read: answer, then close the connection (what
        still arrives of it reaches no handler)."""
        self._release()
        self.dropped = True
        log.info("%s: dropped a request body without credentials: %s", status.split()[0], message)
        stream = self.conn.stream

        async def answer() -> None:
            try:
                await stream.write(_error_response(status, error, message))
            except Exception:  # noqa: BLE001 - the client may be gone already
                pass
            finally:
                stream.close()
        tornado.ioloop.IOLoop.current().add_callback(answer)

    def data_received(self, chunk):
        if self.dropped:
            return None
        self.seen += len(chunk)
        if self.seen > self.limit:      # a chunked body past the route's limit: 400, closed (as tornado's own)
            self._release()
            raise tornado.httputil.HTTPInputError(f"request body over {self.limit} bytes")
        return self.inner.data_received(chunk)

    def _release(self) -> None:
        if self.held:
            self.held_from.give(self.held, self.who)
            self.held = 0
        if self.deadline is not None:
            tornado.ioloop.IOLoop.current().remove_timeout(self.deadline)
            self.deadline = None
            self.owner.anon_reading.pop(self, None)

    def finish(self) -> None:
        self._release()
        if not self.dropped:
            self.inner.finish()

    def on_connection_close(self) -> None:
        self._release()
        self.inner.on_connection_close()


def _error_response(status: str, error: str, message: str) -> bytes:
    """A whole JSON error response that closes the connection."""
    body = json.dumps({"error": error, "message": message}).encode()
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nCache-Control: no-store\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (status.encode(), len(body), body))


async def _maybe(result):
    return (await result) if result is not None else None
