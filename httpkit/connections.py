"""How many connections one server holds: at most MAX_CONNECTIONS, the idle ones given up first.

Each connection is a file descriptor of the daemon, which every API of it, its sandbox DNS
and its state files share. Tornado accepts without a limit and keeps a connection that sends
nothing for the idle timeout (300 s), so anyone on the host could open connections until the
daemon had no descriptor left (its RLIMIT_NOFILE), for every API at once.

A connection is busy from its request's head to the end of its response (a long stream
included), idle otherwise: before its first request (or while its head trickles in) and
between requests. At the cap, a new connection takes the place of the connection idle the
longest (closed; a client reopens an idle keep-alive connection); if every one is busy the
new one is closed at once. A real client's request, sent as it connects, is served at once,
so idle connections, however many, cannot keep it out.
"""
from __future__ import annotations

import logging

import tornado.httpserver

log = logging.getLogger("httpkit")
MAX_CONNECTIONS = 512


class CappedHTTPServer(tornado.httpserver.HTTPServer):
    """An HTTPServer holding at most `max_connections` (set after construction)."""

    max_connections = MAX_CONNECTIONS

    def initialize(self, *args, **kwargs) -> None:
        super().initialize(*args, **kwargs)
        self._idle: dict = {}              # connection -> None, in the order they went idle

    def handle_stream(self, stream, address) -> None:
        if len(self._connections) >= self.max_connections and not self._close_longest_idle():
            log.info("refused a connection: all %d are busy", self.max_connections)
            stream.close()
            return
        before = set(self._connections)
        super().handle_stream(stream, address)
        for conn in self._connections - before:
            self._idle[conn] = None

    def _close_longest_idle(self) -> bool:
        while self._idle:
            conn = next(iter(self._idle))
            del self._idle[conn]
            if conn in self._connections:
                conn.stream.close()        # its loop ends and on_close() forgets it
                return True
        return False

    def busy(self, server_conn, request_conn) -> None:
        """server_conn has a request's head: busy until request_conn's response is written."""
        self._idle.pop(server_conn, None)
        finished = getattr(request_conn, "_finish_future", None)    # tornado's HTTP1Connection
        if finished is not None:
            finished.add_done_callback(lambda _f: self._went_idle(server_conn))

    def _went_idle(self, server_conn) -> None:
        if server_conn in self._connections:
            self._idle[server_conn] = None

    def on_close(self, server_conn) -> None:
        self._idle.pop(server_conn, None)
        super().on_close(server_conn)
