"""Graceful drain on SIGTERM: stop accepting, let in-flight flows finish, then stop.

Rolling restart model (no SO_REUSEPORT: mitmproxy binds with a plain
asyncio.start_server): the old gateway closes its listeners first, the new
one binds after that. What a client sees:
  - a request already sent on an open connection gets its answer (up to
    proxy.drain_seconds), with "Connection: close" so the client reconnects;
  - an idle keep-alive HTTP/MITM connection is closed at once (nothing in
    flight on it: the ordinary keep-alive race, clients retry);
  - a passthrough tunnel keeps flowing until it ends or the bound expires
    (its inner requests are opaque to us), then it is closed;
  - a new connection gets ECONNREFUSED until the new gateway has bound.
Every connection that ends during the drain still gets its connection_closed
audit record, because it ends while the master runs.
"""
from __future__ import annotations

import asyncio
import logging
import time

from mitmproxy import http

log = logging.getLogger("cubegate.drain")

POLL_SECONDS = 0.05
FORCED_CLOSE_GRACE = 2.0   # after the bound: time for close hooks (audit) to run


class DrainAddon:
    """Tracks in-flight HTTP flows per client connection; while draining ends keep-alive."""

    name = "cubegate_drain"

    def __init__(self) -> None:
        self.draining = False
        self.inflight: dict[str, set[str]] = {}   # client id -> ids of flows without an answer yet
        self.http_seen: set[str] = set()          # client ids that carried a (non-CONNECT) request

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT":
            return
        cid = flow.client_conn.id
        self.http_seen.add(cid)
        self.inflight.setdefault(cid, set()).add(flow.id)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if self.draining and flow.response is not None and flow.request.method != "CONNECT":
            flow.response.headers["Connection"] = "close"

    def response(self, flow: http.HTTPFlow) -> None:
        self.responseheaders(flow)
        self._done(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def _done(self, flow: http.HTTPFlow) -> None:
        s = self.inflight.get(flow.client_conn.id)
        if s is not None:
            s.discard(flow.id)

    def client_disconnected(self, client) -> None:
        self.inflight.pop(client.id, None)
        self.http_seen.discard(client.id)

    def idle_http(self, client_id: str) -> bool:
        """A keep-alive HTTP connection with nothing in flight: safe to close now."""
        return client_id in self.http_seen and not self.inflight.get(client_id)


async def drain(master, seconds: float, *, close_first=()) -> dict:
    """Close listeners (proxy + `close_first`, e.g. ops/admin servers), wait for
    in-flight flows up to `seconds`, then close what is left. Returns counts for the log."""
    addon = master.addons.get(DrainAddon.name)
    ps = master.addons.get("proxyserver")
    started = time.monotonic()
    if addon is not None:
        addon.draining = True
    if ps is not None:
        await ps.servers.update([])     # listeners closed: the new gateway may bind now
    for server in close_first:
        if server is not None:
            try:
                server.stop()
            except Exception as e:  # a side listener must not block the drain
                log.warning("drain: stopping %r failed: %s", server, e)
    stats = {"at_start": len(ps.connections) if ps else 0, "closed_idle": 0, "forced": 0}
    deadline = started + max(0.0, seconds)
    while ps is not None and ps.connections and time.monotonic() < deadline:
        if addon is not None:
            for cid, handler in list(ps.connections.items()):
                if addon.idle_http(cid) and handler.client.id == cid:
                    _close(handler)
                    addon.http_seen.discard(cid)
                    stats["closed_idle"] += 1
        await asyncio.sleep(POLL_SECONDS)
    if ps is not None and ps.connections:
        for handler in list(ps.connections.values()):
            _close(handler)
            stats["forced"] += 1
        grace = time.monotonic() + FORCED_CLOSE_GRACE
        while ps.connections and time.monotonic() < grace:
            await asyncio.sleep(POLL_SECONDS)
    stats["left"] = len(ps.connections) if ps else 0
    stats["seconds"] = round(time.monotonic() - started, 3)
    log.info("drain done: %s", stats)
    return stats


def _close(handler) -> None:
    try:
        handler.close_connection(handler.client)
    except (KeyError, AssertionError):
        pass  # already gone
