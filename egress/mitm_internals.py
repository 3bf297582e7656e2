"""Every reach into mitmproxy's private parts, in one place.

mitmproxy has no public API for these; tests/gateway/test_mitm_internals.py
fails when an upgrade moves any of them, instead of the gateway silently
losing a guarantee (a reset that does not happen, an error page that quotes
upstream bytes again).
"""
from __future__ import annotations

import inspect
import types

from mitmproxy import addonmanager, connection, ctx, exceptions, flow, hooks, http
from mitmproxy.proxy.layers.http import _http1, _http2, _http3


def _handler(client_id: str):
    ps = ctx.master.addons.get("proxyserver")
    return ps.connections.get(client_id) if ps is not None else None


def client_of(client_id: str) -> connection.Client | None:
    handler = _handler(client_id)
    return handler.client if handler is not None else None


def connection_io(client_id: str, conn: connection.Connection):
    """mitmproxy's ConnectionIO (reader, writer, handler task) for one side of a client's flow."""
    handler = _handler(client_id)
    return handler.transports.get(conn) if handler is not None else None


def transport_of(client_id: str, conn: connection.Connection):
    io = connection_io(client_id, conn)
    writer = getattr(io, "writer", None) if io is not None else None
    return getattr(writer, "transport", None)


def close_client(client: connection.Client, *, flush: bool) -> None:
    """Close a client connection now: the handler's own close, then the socket itself
    (reset, or closed after the queued bytes when `flush`). The handler's close only
    cancels its task; a task waiting on one of our hooks would leave the socket open."""
    handler = _handler(client.id)
    if handler is None:
        return
    transport = transport_of(client.id, client)
    handler.close_connection(client)
    if transport is not None and not transport.is_closing():
        if flush and transport.get_write_buffer_size():
            transport.close()
        else:
            transport.abort()


def abort_now(client_id: str, *conns: connection.Connection) -> None:
    """Reset sockets synchronously, from inside a stream callback: whatever the layer yields
    after this is written to a closed transport and never reaches the peer."""
    for conn in conns:
        transport = transport_of(client_id, conn)
        if transport is not None and not transport.is_closing():
            transport.abort()


def cancel_server(client_id: str, server: connection.Server, why: str) -> bool:
    io = connection_io(client_id, server)
    if io is not None and io.handler is not None:
        io.handler.cancel(why)
        return True
    return False


def wrap_reader(client_id: str, conn: connection.Connection, wrap) -> None:
    io = connection_io(client_id, conn)
    if io is not None and io.reader is not None:
        io.reader = wrap(io.reader)


def listening_sockets(master) -> list:
    ps = master.addons.get("proxyserver")
    out = []
    for instance in list(ps.servers) if ps is not None else []:
        for srv in getattr(instance, "_servers", []):
            out.extend(getattr(srv, "sockets", ()))
    return out


# -- error pages ------------------------------------------------------------------
# mitmproxy's own error pages put the protocol error's text into the body, and that
# text quotes the bytes that failed to parse (an upstream header name holding the
# injected key, a sandbox's request line). Ours are the gate's deny shape (JSON body,
# X-Cubegate-Reason: relay_failed), saying what happened, never what was sent.
_ERROR_MODULES = (_http1, _http2, _http3)
_RELAY_FAILED = "the connection could not be relayed (protocol error, upstream failure or refusal; see the audit log)"


def _format_error(status_code: int, message: str) -> bytes:
    """The body of an HTTP/2 or HTTP/3 error answer (mitmproxy writes its headers)."""
    from egress import records
    return records.deny_body(status_code, "relay_failed", _RELAY_FAILED)


def _make_error_response(status_code: int, message: str = "") -> bytes:
    """A whole HTTP/1 error answer: the same bytes as every other refusal."""
    return _refusal_bytes(status_code, reason="relay_failed", detail=_RELAY_FAILED)


def install_safe_error_pages() -> None:
    for mod in _ERROR_MODULES:
        mod.format_error = _format_error
    _http1.make_error_response = _make_error_response


def safe_error_pages_installed() -> bool:
    return all(getattr(mod, "format_error", None) is _format_error for mod in _ERROR_MODULES) \
        and _http1.make_error_response is _make_error_response


# -- HTTP/1 trailers ----------------------------------------------------------------
# mitmproxy 12 raises NotImplementedError when an HTTP/1 message ends with trailers:
# the connection's task dies and the sandbox waits forever. Turn that into a protocol
# error, so the message is refused (400 to a sandbox, 502 for an upstream) and closed.
TRAILERS_REFUSED = "HTTP/1 trailers are not supported"


def _trailers_refused_response() -> bytes:
    return _refusal_bytes(400, "trailers_refused", TRAILERS_REFUSED)


def install_trailer_refusal() -> None:
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http._base import ReceiveHttp

    cls = _http1.Http1Connection
    if getattr(cls.read_body, "_cubegate", False):
        return
    original = cls.read_body

    def read_body(self, event):
        try:
            yield from original(self, event)
        except NotImplementedError:
            if isinstance(self, _http1.Http1Server):   # the sandbox's side: it gets an answer
                yield commands.SendData(self.conn, _trailers_refused_response())
            # the error first, so the flow's error hook still sees its connection
            yield ReceiveHttp(self.ReceiveProtocolError(self.stream_id, TRAILERS_REFUSED,
                                                        code=self.ReceiveProtocolError.code))
            yield commands.CloseConnection(self.conn)

    read_body._cubegate = True
    cls.read_body = read_body


def trailer_refusal_installed() -> bool:
    return getattr(_http1.Http1Connection.read_body, "_cubegate", False)


# -- fast path: parsing with mitmproxy's own parsers, and the hand-over ---------------
# The fast path (egress/fastpath/) reads a connection's first bytes itself. It parses
# them with the same functions mitmproxy uses, so a head or an SNI means the same on
# both paths, and hands what needs mitmproxy over inside the process, bytes replayed.
def read_request_head(lines: list[bytes]):
    """mitmproxy's HTTP/1 request-head parser (ValueError when malformed)."""
    from mitmproxy.net.http.http1 import read_request_head as _read
    return _read(lines)


def starts_like_tls(data: bytes) -> bool:
    from mitmproxy.net.tls import starts_like_tls_record
    return starts_like_tls_record(data)


def parse_client_hello(data: bytes):
    """A complete ClientHello (mitmproxy.tls.ClientHello), None while incomplete; ValueError when invalid."""
    from mitmproxy.proxy.layers.tls import parse_client_hello as _parse
    return _parse(data)


def hand_over(master, mode_spec: str, transport, replay: bytes, eof: bool):
    """Give an accepted connection to mitmproxy as if its own listener had accepted it, with
    `replay` (the bytes already read) delivered first. Returns the handler's coroutine.

    The same steps as mitmproxy's AsyncioServerInstance.handle_stream (a StreamReader over
    the transport, a ProxyConnectionHandler registered with the proxyserver addon): the
    connection runs every hook of the gate, exactly like one mitmproxy accepted."""
    import asyncio

    from mitmproxy.proxy import mode_servers, mode_specs

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2 ** 16, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    if replay:
        reader.feed_data(replay)
    if eof:
        reader.feed_eof()
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    instance = mode_servers.ServerInstance.make(mode_specs.ProxyMode.parse(mode_spec),
                                                master.addons.get("proxyserver"))
    transport.resume_reading()
    return instance.handle_stream(reader, writer)


def connection_count(master) -> int:
    ps = master.addons.get("proxyserver")
    return len(ps.connections) if ps is not None else 0


def original_destination(transport) -> tuple[str, int]:
    """Transparent mode: where the sandbox dialled before the switch steered it here
    (mitmproxy's SO_ORIGINAL_DST reader, the one its transparent mode uses)."""
    from mitmproxy import platform
    if platform.original_addr is None:
        raise RuntimeError("transparent mode is not supported on this platform")
    return platform.original_addr(transport.get_extra_info("socket"))


# -- bounded HTTP/1 heads ------------------------------------------------------------
# mitmproxy buffers an HTTP/1 head until its blank line, however long (its own FIXME):
# a sandbox (or an upstream) that never ends its head grows the gateway without bound.
def _head_complete(buf, limit: int) -> bool:
    head = bytes(buf)[:limit + 4]
    return b"\r\n\r\n" in head or b"\n\n" in head


def install_head_limit(limit: int) -> None:
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import ErrorCode, ResponseProtocolError

    def bounded(original, side: str):
        def read_headers(self, event):
            if isinstance(event, events.DataReceived) and len(self.buf) > limit \
                    and not _head_complete(self.buf, limit):
                if side == "client":        # the sandbox's side
                    yield commands.SendData(self.conn, _refusal_bytes(431, "head_too_large",
                                                                      f"request head over {limit} bytes"))
                    yield commands.CloseConnection(self.conn)
                else:                       # the upstream's answer
                    yield commands.CloseConnection(self.conn)
                    if self.stream_id is not None:
                        yield ReceiveHttp(ResponseProtocolError(self.stream_id, "upstream response head too large",
                                                                ErrorCode.GENERIC_SERVER_ERROR))
                self.buf = type(self.buf)()   # h11's ReceiveBuffer has no clear(): a new, empty one
                return
            yield from original(self, event)
        read_headers._cubegate_limit = limit
        return read_headers

    for cls, side in ((_http1.Http1Server, "client"), (_http1.Http1Client, "server")):
        original = getattr(cls.read_headers, "_cubegate_original", cls.read_headers)
        patched = bounded(original, side)
        patched._cubegate_original = original
        cls.read_headers = patched
    _http1.ChunkedReader = _bounded_chunked_reader(limit)


def _bounded_chunked_reader(limit: int):
    """h11's ChunkedReader (mitmproxy's for chunked bodies, both sides) buffers a chunk header line
    and the trailer section until they end, however long: refused past `limit` like a head."""
    import h11
    from h11._readers import ChunkedReader
    base = getattr(ChunkedReader, "_cubegate_base", ChunkedReader)

    class BoundedChunkedReader(base):
        _cubegate_base = base
        _cubegate_limit = limit

        def __call__(self, buf):
            event = super().__call__(buf)
            if event is None and len(buf) > limit:   # only a line still waiting for its end is left
                raise h11.LocalProtocolError(f"chunk header or trailer section over {limit} bytes")
            return event

    return BoundedChunkedReader


def head_limit_installed() -> int | None:
    a = getattr(_http1.Http1Server.read_headers, "_cubegate_limit", None)
    b = getattr(_http1.Http1Client.read_headers, "_cubegate_limit", None)
    c = getattr(_http1.ChunkedReader, "_cubegate_limit", None)
    return a if a == b == c else None


def _refusal_bytes(status: int, reason: str, detail: str) -> bytes:
    """Every refusal mitmproxy's layers send for us: the gate's deny shape (egress.records)."""
    from egress.fastpath import heads   # imports this module
    return heads.refusal_response(status, reason, detail)


# -- WebSocket control frames ------------------------------------------------------------
# mitmproxy relays ping/pong payloads and close reasons as they came; only data messages
# reach the websocket_message hook. They carry no application data we need, so they cross
# the gateway empty (a close keeps its code): neither direction can use them as a channel.
def install_websocket_control_scrub() -> None:
    import wsproto.events as wse
    from mitmproxy.proxy.layers import websocket as ws_layer

    cls = ws_layer.WebsocketConnection
    if getattr(cls.send2, "_cubegate", False):
        return
    original = cls.send2

    def send2(self, event):
        if isinstance(event, (wse.Ping, wse.Pong)) and event.payload:
            event = type(event)(payload=b"")
        elif isinstance(event, wse.CloseConnection) and event.reason:
            event = wse.CloseConnection(code=event.code, reason=None)
        return original(self, event)

    send2._cubegate = True
    cls.send2 = send2


def websocket_control_scrub_installed() -> bool:
    from mitmproxy.proxy.layers import websocket as ws_layer
    return getattr(ws_layer.WebsocketConnection.send2, "_cubegate", False)


# -- hook dispatch ------------------------------------------------------------------
class HookTableAddons(addonmanager.AddonManager):
    """mitmproxy's AddonManager, with each hook's implementers found once per addon set.

    The stock one walks every addon tree with getattr, in a coroutine per addon, for every
    event, and a second time for the UpdateHook that follows every flow event (~35 µs per
    hook with our seven addons, most of it for addons that do not implement it). Same
    order, same awaiting, same error handling (mitmproxy's safecall: an addon's exception
    is logged, AddonHalt stops the event); the table is rebuilt whenever the set changes.
    The gate's hooks never raise into that safecall: egress/hook_guard.py refuses their flow first.
    """

    def __init__(self, master) -> None:
        super().__init__(master)
        self._table: dict[str, tuple] = {}

    def register(self, addon):
        self._table = {}
        return super().register(addon)

    def add(self, *addons) -> None:
        super().add(*addons)
        self._table = {}

    def remove(self, addon) -> None:
        self._table = {}
        super().remove(addon)

    def clear(self) -> None:
        super().clear()
        self._table = {}

    def implementers(self, name: str) -> tuple:
        """((top-level addon, (hook functions of it and its sub-addons)), ...) for a hook name."""
        found = self._table.get(name)
        if found is None:
            found = []
            for top in self.chain:
                funcs = []
                for a in addonmanager.traverse([top]):
                    func = getattr(a, name, None)
                    if func and not isinstance(func, types.ModuleType):
                        if not callable(func):
                            raise exceptions.AddonManagerError(f"Addon handler {name} ({a}) not callable")
                        funcs.append(func)
                if funcs:
                    found.append((top, tuple(funcs)))
            found = self._table[name] = tuple(found)
        return found

    async def trigger_event(self, event: hooks.Hook) -> None:
        table = self.implementers(event.name)
        if not table:
            return
        args = event.args()
        for _, funcs in table:
            try:
                for func in funcs:
                    res = func(*args)
                    if res is not None and inspect.isawaitable(res):
                        await res
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception as e:  # noqa: BLE001 - mitmproxy's safecall: logged, the next addon runs
                addonmanager.logger.error(f"Addon error: {e}",
                                          exc_info=(type(e), e, addonmanager.cut_traceback(e.__traceback__,
                                                                                           "trigger_event")))

    async def handle_lifecycle(self, event: hooks.Hook) -> None:
        await self.trigger_event(event)
        message = event.args()[0]
        if isinstance(message, flow.Flow) and self.implementers(hooks.UpdateHook.name):
            await self.trigger_event(hooks.UpdateHook([message]))


def hook_dispatch_installed(master) -> bool:
    return isinstance(master.addons, HookTableAddons)


def install_hook_table(master) -> None:
    """Before any addon is added: the master dispatches hooks through HookTableAddons."""
    if master.addons.chain:
        raise RuntimeError("install the hook table before adding addons")
    master.options.changed.disconnect(master.addons._configure_all)
    master.addons = HookTableAddons(master)

