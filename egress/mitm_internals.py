"""Every reach into mitmproxy's private parts, in one place.

mitmproxy has no public API for these; tests/gateway/test_mitm_internals.py
fails when an upgrade moves any of them, instead of the gateway silently
losing a guarantee (a reset that does not happen, an error page that quotes
upstream bytes again).
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import time
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


def note_on_server(server: connection.Server, key: str, value) -> None:
    """Keep `value` on the Server itself (read back once by take_server_note): held by no table,
    so a dial mitmproxy cancels before any further hook (its handler waiting for one of the 5
    slots per address when the client leaves or the connect timer fires) leaves nothing behind."""
    server.__dict__["_cubegate_" + key] = value


def take_server_note(server: connection.Server, key: str, default=None):
    return server.__dict__.pop("_cubegate_" + key, default)


def name_the_dialled_server(server: connection.Server, address: tuple[str, int]) -> None:
    """server_connect pins the upstream to a guarded address (server.address = (ip, port)); once
    connected, the connection is given its name back. mitmproxy reuses an upstream connection only
    for a request whose (host, port) equals connection.address: left at the ip, every keep-alive
    request opened a new upstream connection, and the sixth waited forever for mitmproxy's 5 slots
    per address. Server.__setattr__ refuses a new address on an open connection: set it under it."""
    server.__dict__["address"] = address


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


# A server_connect refusal of ours (a policy deny found at connect time) as the server's error:
# mitmproxy answers the request with it instead of its 502 (nothing else starts with this).
_CONNECT_REFUSED = "cubegate refused the upstream connection: "


def connect_refusal(status: int, reason: str, detail: str) -> str:
    """The `server.error` whose answer to the sandbox is this refusal (status, X-Cubegate-Reason, page)."""
    return f"{_CONNECT_REFUSED}{status} {reason} {detail}"


def _answer_for(status_code: int, message: str) -> tuple[int, str, str]:
    """(status, reason, detail) mitmproxy's error answer is sent as: our connect refusal (which
    mitmproxy's server passes on as "Connection killed: <server.error>"), else relay_failed."""
    for prefix in (_CONNECT_REFUSED, "Connection killed: " + _CONNECT_REFUSED):
        if message.startswith(prefix):
            status, reason, detail = message[len(prefix):].split(" ", 2)
            return int(status), reason, detail
    reason = "relay_failed"   # mitmproxy's own failures: protocol errors, upstream failures
    return status_code, reason, _RELAY_FAILED


def _format_error(status_code: int, message: str) -> bytes:
    """The body of an HTTP/2 or HTTP/3 error answer (mitmproxy writes its headers)."""
    from egress import records
    return records.deny_body(*_answer_for(status_code, message))


def _make_error_response(status_code: int, message: str = "") -> bytes:
    """A whole HTTP/1 error answer: the same bytes as every other refusal."""
    return _refusal_bytes(*_answer_for(status_code, message))


def install_safe_error_pages() -> None:
    for mod in _ERROR_MODULES:
        mod.format_error = _format_error
    _http1.make_error_response = _make_error_response
    _install_h2_error_head()


def safe_error_pages_installed() -> bool:
    return all(getattr(mod, "format_error", None) is _format_error for mod in _ERROR_MODULES) \
        and _http1.make_error_response is _make_error_response \
        and getattr(_http2.Http2Connection._handle_event, "_cubegate", False)


def _h2_error_head(status: int, reason: str, body_len: int) -> list[tuple[bytes, bytes]]:
    """The head of an HTTP/2 error answer: the deny shape's headers (egress.records), without
    the ones HTTP/2 forbids (Connection), instead of mitmproxy's Server and text/html."""
    from egress import records
    fields = [(k.encode(), v.encode()) for k, v in records.deny_headers(reason).items()]
    return _http2.normalize_h1_headers([(b":status", b"%d" % status), *fields,
                                        (b"content-length", b"%d" % body_len)], False)


def _install_h2_error_head() -> None:
    """mitmproxy answers an HTTP/2 stream whose upstream failed with its own head (Server:
    mitmproxy, text/html) around our body: this sends the whole answer ourselves, on the
    same condition mitmproxy does (a response error, stream open, no head sent yet)."""
    from mitmproxy.proxy.commands import SendData
    from mitmproxy.proxy.layers.http import ResponseProtocolError

    cls = _http2.Http2Connection
    if getattr(cls._handle_event, "_cubegate", False):
        return
    original = cls._handle_event

    def _handle_event(self, event):
        if isinstance(event, ResponseProtocolError) and not self.is_closed(event.stream_id) \
                and self.is_open_for_us(event.stream_id) \
                and not self.h2_conn.streams[event.stream_id].state_machine.headers_sent:
            status = event.code.http_status_code()
            if status is not None:
                status, reason, _ = _answer_for(status, event.message)
                body = _format_error(status, event.message)
                self.h2_conn.send_headers(event.stream_id, _h2_error_head(status, reason, len(body)))
                self.h2_conn.send_data(event.stream_id, body, end_stream=True)
                yield SendData(self.conn, self.h2_conn.data_to_send())
                return
        yield from original(self, event)

    _handle_event._cubegate = True
    cls._handle_event = _handle_event


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


def unread_server_name(hello) -> bool:
    """A ClientHello (mitmproxy.tls.ClientHello) carrying a server_name that mitmproxy's .sni does
    not stand for: two server_name extensions, or one whose list is not exactly one valid host_name
    (.sni is then None, or another extension's). A server reads a name of its own choice from it
    (Go's crypto/tls skips other name types), so the SNI checked would not be the one routed by."""
    count = sum(1 for ext_type, _ in hello.extensions if ext_type == 0)
    return count > 1 or (count == 1 and hello.sni is None)


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


# mitmproxy's own prefix for an unreadable hello: its on_handshake_error passes the text on unchanged
CLIENT_HELLO_TOO_LARGE = "Cannot parse ClientHello: over the gateway's bound"


def install_client_hello_bound(limit: int) -> None:
    """mitmproxy's ClientTLSLayer keeps every byte until the ClientHello is whole, joining its
    records again on each read: a hello that says it is 16 MiB long grew the gateway by all the
    sandbox sent until the head timeout. Past `limit` bytes the handshake fails with
    CLIENT_HELLO_TOO_LARGE as the client's error (the gate audits it as invalid_client_hello)."""
    from mitmproxy.proxy.layers.tls import ClientTLSLayer

    original = getattr(ClientTLSLayer.receive_handshake_data, "_cubegate_original",
                       ClientTLSLayer.receive_handshake_data)

    def receive_handshake_data(self, data: bytes):
        if not self.client_hello_parsed and len(self.recv_buffer) + len(data) > limit:
            self.recv_buffer.clear()
            return False, CLIENT_HELLO_TOO_LARGE
        return (yield from original(self, data))

    receive_handshake_data._cubegate_original = original
    receive_handshake_data._cubegate_limit = limit
    ClientTLSLayer.receive_handshake_data = receive_handshake_data


def install_head_limit(limit: int, head_timeout: float | None = None) -> None:
    """head_timeout: every request head's deadline from its first byte (None: none)."""
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import ErrorCode, ResponseProtocolError

    def bounded(original, side: str):
        def read_headers(self, event):
            if side == "client" and head_timeout and (yield from _head_deadline(self, event, head_timeout)):
                return
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
            if side == "server" and isinstance(event, events.DataReceived):
                if (yield from _swallow_h1_informational(self, limit)):
                    return
            yield from original(self, event)
            if side == "client" and head_timeout:
                yield from _after_read_headers(self, head_timeout)
        read_headers._cubegate_limit = limit
        read_headers._cubegate_head_timeout = head_timeout if side == "client" else None
        return read_headers

    for cls, side in ((_http1.Http1Server, "client"), (_http1.Http1Client, "server")):
        original = getattr(cls.read_headers, "_cubegate_original", cls.read_headers)
        patched = bounded(original, side)
        patched._cubegate_original = original
        cls.read_headers = patched
    _install_wait_limit(limit + PIPELINED_SLACK_BYTES)
    _install_head_wakeup(head_timeout)
    _install_h2_head_deadline(head_timeout)
    _install_h2_informational_limit(limit)
    _http1.ChunkedReader = _bounded_chunked_reader(limit)


# While a message is in flight mitmproxy's HTTP/1 connections sit in `wait` and append every
# byte the peer sends to self.buf, parsed only when the flow is done: a sandbox pipelining
# without end behind a slow request (or an upstream talking out of turn) grew us without
# bound. One full head and a socket read of slack may wait; past that the connection is closed.
PIPELINED_SLACK_BYTES = 64 << 10


def _install_wait_limit(max_bytes: int) -> None:
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import ErrorCode

    cls = _http1.Http1Connection
    original = getattr(cls.wait, "_cubegate_original", cls.wait)

    def wait(self, event):
        if isinstance(event, events.DataReceived) and len(self.buf) > max_bytes:
            self.buf = type(self.buf)()
            self.state = self.done
            yield commands.CloseConnection(self.conn)
            code = ErrorCode.CLIENT_DISCONNECTED if isinstance(self, _http1.Http1Server) \
                else ErrorCode.GENERIC_SERVER_ERROR
            yield ReceiveHttp(self.ReceiveProtocolError(self.stream_id, f"over {max_bytes} bytes sent "
                                                        "while a message was in flight", code=code))
            return
        yield from original(self, event)

    wait._cubegate_original = original
    wait._cubegate_limit = max_bytes
    cls.wait = wait


# -- 1xx heads from an upstream -------------------------------------------------------------
# mitmproxy swallows an HTTP/2 upstream's informational responses without a count (a flood
# ends only with upstream_timeout), and over HTTP/1 takes the first 1xx for the answer itself
# (the sandbox gets a 103 and then waits). Both now swallow them, at most MAX_INFORMATIONAL
# heads (egress.fastpath.http1.ResponseReader, the fast path's bound) and `max_bytes` of them
# per response; more is the upstream's protocol error (502 relay_failed to the sandbox).
_INFORMATIONAL_HEAD = re.compile(rb"HTTP/1\.[01] 1(?!01)\d\d[ \r\n]")
_HEAD_END = re.compile(rb"\r?\n\r?\n")
TOO_MANY_INFORMATIONAL = "upstream sent too many informational (1xx) responses"


def _informational_bound() -> int:
    from egress.fastpath.http1 import ResponseReader
    return ResponseReader.MAX_INFORMATIONAL


def _count_informational(conn, stream_id: int, size: int, max_bytes: int, *, one_stream: bool = False) -> bool:
    """Count one 1xx head of `stream_id` on an upstream connection; False past the bound.
    one_stream: HTTP/1 answers one request at a time, so only the current one is kept."""
    seen = conn.__dict__.setdefault("_cubegate_1xx", {})
    n, total = seen.get(stream_id, (0, 0))
    n, total = n + 1, total + size
    if one_stream:
        seen.clear()
    seen[stream_id] = (n, total)
    return n <= _informational_bound() and total <= max_bytes


def _swallow_h1_informational(self, max_bytes: int):
    """Drop the complete 1xx heads at the front of an HTTP/1 upstream's buffer (h11's
    ReceiveBuffer: its bytes are `_data`). Yields the refusal and returns True past the bound."""
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._events import ErrorCode, ResponseProtocolError

    while self.request is not None and self.stream_id is not None:
        data = self.buf._data
        if not _INFORMATIONAL_HEAD.match(data):
            return False
        end = _HEAD_END.search(data)
        if end is None:
            return False      # incomplete: wait (the head limit bounds it)
        if not _count_informational(self, self.stream_id, end.end(), max_bytes, one_stream=True):
            yield commands.CloseConnection(self.conn)
            yield ReceiveHttp(ResponseProtocolError(self.stream_id, TOO_MANY_INFORMATIONAL,
                                                    ErrorCode.GENERIC_SERVER_ERROR))
            self.buf = type(self.buf)()
            return True
        self.buf.maybe_extract_at_most(end.end())
    return False


def _install_h2_informational_limit(max_bytes: int) -> None:
    import h2.events

    cls = _http2.Http2Client
    original = getattr(cls.handle_h2_event, "_cubegate_original", cls.handle_h2_event)

    def handle_h2_event(self, event):
        if isinstance(event, h2.events.InformationalResponseReceived):
            size = sum(len(k) + len(v) + 32 for k, v in event.headers)   # RFC 9113 6.5.2's header size
            if not _count_informational(self, event.stream_id, size, max_bytes):
                yield from self.protocol_error(TOO_MANY_INFORMATIONAL)
                return True
        elif isinstance(event, (h2.events.ResponseReceived, h2.events.StreamReset, h2.events.StreamEnded)):
            self.__dict__.get("_cubegate_1xx", {}).pop(event.stream_id, None)
        return (yield from original(self, event))

    handle_h2_event._cubegate_original = original
    handle_h2_event._cubegate_limit = max_bytes
    cls.handle_h2_event = handle_h2_event


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
    c = getattr(_http2.Http2Client.handle_h2_event, "_cubegate_limit", None)
    d = getattr(_http1.ChunkedReader, "_cubegate_limit", None)
    return a if a == b == c == d else None


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


# -- HTTP/2 header table ----------------------------------------------------------------
# h2 hands the peer's SETTINGS_HEADER_TABLE_SIZE (up to 2^32-1) to its HPACK encoder as it comes,
# and the encoder indexes what it sends: a sandbox announcing a huge table would make us keep
# every response header of a connection, never evicting. The encoder may use less than the peer
# allows (RFC 7541 4.2); ours uses at most the protocol's default, as Go's http2 does.
HPACK_TABLE_MAX = 4096


def install_hpack_table_cap(limit: int = HPACK_TABLE_MAX) -> None:
    import hpack

    prop = hpack.Encoder.header_table_size
    if getattr(prop.fset, "_cubegate", False):
        return

    def fset(self, value: int) -> None:
        prop.fset(self, min(value, limit))

    fset._cubegate = True
    hpack.Encoder.header_table_size = property(prop.fget, fset, doc=prop.__doc__)


# -- WebSocket message size ---------------------------------------------------------------
# mitmproxy assembles each message whole before the websocket_message hook (which checks it
# whole), appending every piece wsproto emits to an immutable bytes: memory without bound, and
# copying that grows with the square of the message, on the loop every connection shares. Here
# the pieces of a frame are joined once (mitmproxy then sees one piece per frame), and a message
# past the limit closes the connection: 1009 (message too big) to both sides, nothing of it sent.
WEBSOCKET_TOO_LARGE = 1009
_ws_limit = [16 << 20]
_ws_refused: set[str] = set()     # connection ids whose message was too large (the gate audits them)


def install_websocket_message_bound(limit: int) -> None:
    import wsproto.events as wse
    from mitmproxy.proxy.layers import websocket as ws_layer

    _ws_limit[0] = limit
    cls = ws_layer.WebsocketConnection
    if getattr(cls.events, "_cubegate", False):
        return
    original = cls.events

    def events(self):
        if getattr(self, "_cubegate_refused", False):
            return
        if not hasattr(self, "_cubegate_pieces"):
            self._cubegate_pieces, self._cubegate_size = [], 0
        pieces = self._cubegate_pieces
        for ev in original(self):
            if not isinstance(ev, wse.Message):
                yield ev
                continue
            data = ev.data
            self._cubegate_size += len(data.encode() if isinstance(data, str) else data)
            if self._cubegate_size > _ws_limit[0]:
                self._cubegate_refused = True
                pieces.clear()
                if len(_ws_refused) > 4096:       # bounded: the gate's websocket_end takes them out
                    _ws_refused.clear()
                _ws_refused.add(self.conn.id)
                yield wse.CloseConnection(code=WEBSOCKET_TOO_LARGE)
                return
            pieces.append(data)
            if ev.frame_finished or ev.message_finished:
                joined = "".join(pieces) if isinstance(data, str) else b"".join(pieces)
                pieces.clear()
                if ev.message_finished:
                    self._cubegate_size = 0
                yield type(ev)(data=joined, frame_finished=ev.frame_finished, message_finished=ev.message_finished)

    events._cubegate = True
    cls.events = events


def websocket_message_refused(*conn_ids: str) -> bool:
    """One of these connections had a WebSocket message past the limit (asked once, at its end)."""
    hit = [c for c in conn_ids if c in _ws_refused]
    _ws_refused.difference_update(hit)
    return bool(hit)


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



# -- every request head has a deadline ---------------------------------------------------
# mitmproxy has only tcp_timeout, which every byte resets, and the gate's own timer covers a
# connection's first head: a second keep-alive head (or one inside a tunnel) could be trickled
# for ever. Like the fast path (egress/fastpath/plain.py), each HTTP/1 request head must end
# `seconds` after its first byte, else 408 header_timeout and the connection is closed.
# The check runs on every byte of a head and on one wakeup per incomplete head: a head that
# arrives whole costs a clock read, no timer.
from mitmproxy.proxy import commands as _commands, events as _events   # noqa: E402


@dataclasses.dataclass
class CubegateHeadTimeoutHook(_commands.StartHook):
    """A request head on this client connection did not end in time (already refused 408).
    Not blocking: the gate only records it (st.denied_reason, the connection_closed audit)."""
    client: connection.Client
    blocking = False


def _head_deadline(self, event, seconds: float):
    """Before mitmproxy's read_headers on the sandbox's side: True (refusal yielded) when the
    head in progress is past its deadline. Starts the head's clock at its first byte."""
    started = self.__dict__.get("_cubegate_head_since")
    if started is None:
        if isinstance(event, _events.DataReceived) and len(self.buf):
            self._cubegate_head_since = time.monotonic()
        return False
    if time.monotonic() - started < seconds:
        return False
    yield from _refuse_head_timeout(self, seconds)
    return True


def _refuse_head_timeout(self, seconds: float):
    self._cubegate_head_since = None
    self.buf = type(self.buf)()
    yield _commands.SendData(self.conn, _refusal_bytes(408, "header_timeout",
                                                       f"request head not complete within {seconds:g}s"))
    yield CubegateHeadTimeoutHook(self.context.client)
    yield _commands.CloseConnection(self.conn)
    self.state = self.done


def _after_read_headers(self, seconds: float):
    """After mitmproxy's read_headers: the head ended (clock stopped) or is still open (one wakeup)."""
    started = self.__dict__.get("_cubegate_head_since")
    if started is None:
        return
    if self.state != self.read_headers or not len(self.buf):
        self._cubegate_head_since = None
    elif self.__dict__.get("_cubegate_head_wakeup") is None:
        wake = self._cubegate_head_wakeup = _commands.RequestWakeup(max(0.0, seconds - (time.monotonic() - started)))
        yield wake


def _install_head_wakeup(seconds: float | None) -> None:
    """Http1Server gets our wakeup in any state (mitmproxy's states refuse an unexpected event)."""
    cls = _http1.Http1Server
    original = getattr(cls._handle_event, "_cubegate_original", cls._handle_event)

    def _handle_event(self, event):
        if isinstance(event, _events.Wakeup) and event.command is self.__dict__.get("_cubegate_head_wakeup"):
            self._cubegate_head_wakeup = None
            started = self.__dict__.get("_cubegate_head_since")
            if started is not None and seconds and self.state == self.read_headers:
                if time.monotonic() - started >= seconds:
                    yield from _refuse_head_timeout(self, seconds)
                else:
                    yield from _after_read_headers(self, seconds)
            return
        yield from original(self, event)

    _handle_event._cubegate_original = original
    _handle_event._cubegate_head_timeout = seconds
    cls._handle_event = _handle_event


# HTTP/2: a request head is a HEADERS frame and its CONTINUATIONs. h2 holds an unfinished header
# block in its FrameBuffer (_headers_buffer), a frame not all in yet in its _data (type at byte 3).
_H2_HEAD_FRAME_TYPES = (0x1, 0x9)    # HEADERS, CONTINUATION


def _h2_head_open(self) -> bool:
    buf = self.h2_conn.incoming_buffer
    return bool(buf._headers_buffer) or (len(buf._data) >= 4 and buf._data[3] in _H2_HEAD_FRAME_TYPES)


def _h2_head_clock(self, seconds: float):
    """After each event: start, stop or enforce the open head's deadline (one wakeup at a time)."""
    import h2.errors
    if "_handle_event" in self.__dict__:          # mitmproxy closed it (self._handle_event = self.done)
        return
    if not _h2_head_open(self):
        self._cubegate_head_since = None
        return
    started = self.__dict__.setdefault("_cubegate_head_since", None) or time.monotonic()
    self._cubegate_head_since = started
    left = seconds - (time.monotonic() - started)
    if left <= 0:
        self._cubegate_head_since = None
        yield CubegateHeadTimeoutHook(self.context.client)
        yield from self.protocol_error(f"request head not complete within {seconds:g}s",
                                       error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
    elif self.__dict__.get("_cubegate_head_wakeup") is None:
        wake = self._cubegate_head_wakeup = _commands.RequestWakeup(left)
        yield wake


def _install_h2_head_deadline(seconds: float | None) -> None:
    cls = _http2.Http2Server
    original = getattr(cls.__dict__["_handle_event"], "_cubegate_original", cls.__dict__["_handle_event"])

    def _handle_event(self, event):
        if seconds and isinstance(event, _events.Wakeup) and event.command is self.__dict__.get("_cubegate_head_wakeup"):
            self._cubegate_head_wakeup = None
            yield from _h2_head_clock(self, seconds)
            return
        yield from original(self, event)
        if seconds and isinstance(event, _events.DataReceived):
            yield from _h2_head_clock(self, seconds)

    _handle_event._cubegate_original = original
    _handle_event._cubegate_head_timeout = seconds
    cls._handle_event = _handle_event


def head_deadline_installed() -> float | None:
    a = getattr(_http1.Http1Server.read_headers, "_cubegate_head_timeout", None)
    b = getattr(_http1.Http1Server._handle_event, "_cubegate_head_timeout", None)
    c = getattr(_http2.Http2Server.__dict__["_handle_event"], "_cubegate_head_timeout", None)
    return a if a == b == c else None


# -- bytes queued while a hook runs ---------------------------------------------------------
# A layer that waits on a hook (requestheaders on DNS, next_layer, server_connect, ...) queues
# every event behind it (Layer._paused_event_queue, NextLayer.events), and mitmproxy's handler
# keeps reading the client meanwhile: every byte limit of ours is checked only after the hook,
# so a sandbox could park GBs in those seconds. While a blocking hook or an upstream open is
# pending on a connection, the bytes read from its client count as queued; past the bound the
# handler stops reading that client (TCP backpressure, never a drop) until nothing is pending,
# when mitmproxy has replayed the queue. No hook of ours waits on the client's bytes, so the
# wait ends. A wait for one of mitmproxy's 5 upstream slots per address is not counted: it can
# end only when another stream of the same client finishes, which may need the client's bytes.
class HookQueueBound:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0
        self.queued = 0
        self.opening: set = set()           # OpenConnection commands not yet answered
        self._room = None

    def begin(self) -> None:
        self.pending += 1

    def end(self) -> None:
        self.pending = max(0, self.pending - 1)
        if not self.pending:
            self.queued = 0                 # mitmproxy replayed everything it held
            if self._room is not None and not self._room.done():
                self._room.set_result(None)

    def read(self, n: int) -> None:
        if self.pending:
            self.queued += n

    async def room(self) -> None:
        import asyncio
        while self.pending and self.queued > self.limit:
            self._room = asyncio.get_running_loop().create_future()
            await self._room


class _BoundedReader:
    """The client's reader: waits for room before each read (ConnectionHandler.handle_connection)."""

    def __init__(self, inner, bound: HookQueueBound) -> None:
        self._inner = inner
        self._bound = bound

    async def read(self, n: int = -1) -> bytes:
        bound = self._bound
        if bound.pending and bound.queued > bound.limit:   # room()'s own test, without a coroutine per read
            await bound.room()
        data = await self._inner.read(n)
        self._bound.read(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _SlotWait:
    """One of mitmproxy's per-address upstream semaphores: its wait is not counted as pending."""

    def __init__(self, sem, bound: HookQueueBound) -> None:
        self._sem = sem
        self._bound = bound

    async def __aenter__(self):
        if not self._sem.locked():
            return await self._sem.acquire()
        self._bound.end()
        try:
            return await self._sem.acquire()
        finally:
            self._bound.begin()

    async def __aexit__(self, *exc):
        self._sem.release()


def _queue_bound(handler) -> HookQueueBound | None:
    return handler.__dict__.get("_cubegate_queue")


def install_hook_queue_bound() -> None:
    from mitmproxy.proxy import server

    cls = server.ConnectionHandler
    if getattr(cls.hook_task, "_cubegate", False):
        return
    hook_task, open_connection, server_event = cls.hook_task, cls.open_connection, cls.server_event

    def counted_hook_task(self, hook):
        # called synchronously by server_event: pending from the moment the layer paused
        bound = _queue_bound(self)
        if not hook.blocking:
            return hook_task(self, hook)
        if bound is not None:
            bound.begin()

        async def run():
            # mitmproxy's hook_task (handle the hook, then report HookCompleted), except that a hook
            # done inside the event that started it is reported through that event's holder
            try:
                await self.handle_hook(hook)
                if not hook_completed_by_holder(self, hook):
                    await self.server_event(_events.HookCompleted(hook))
            finally:
                if bound is not None:
                    bound.end()           # its HookCompleted handled, or queued for this very stretch
        return run()

    def counted_open_connection(self, command):
        bound = _queue_bound(self)
        if bound is None:
            return open_connection(self, command)
        bound.begin()
        bound.opening.add(command)

        async def run():
            try:
                await open_connection(self, command)
            finally:
                if command in bound.opening:   # cancelled before its answer
                    bound.opening.discard(command)
                    bound.end()
        return run()

    async def counted_server_event(self, event):
        await server_event(self, event)
        bound = _queue_bound(self)
        if bound is not None and bound.opening and isinstance(event, _events.OpenConnectionCompleted) \
                and event.command in bound.opening:
            bound.opening.discard(event.command)
            bound.end()

    for f, original in ((counted_hook_task, hook_task), (counted_open_connection, open_connection),
                        (counted_server_event, server_event)):
        f._cubegate = True
        f._cubegate_original = original   # what the pinning tests read, installed or not
    cls.hook_task, cls.open_connection, cls.server_event = counted_hook_task, counted_open_connection, \
        counted_server_event


def hook_queue_bound_installed() -> bool:
    from mitmproxy.proxy import server
    cls = server.ConnectionHandler
    return all(getattr(f, "_cubegate", False) for f in (cls.hook_task, cls.open_connection, cls.server_event))


def bound_hook_queue(client_id: str, limit: int) -> HookQueueBound | None:
    """From the client_connected hook (before mitmproxy starts reading that client)."""
    import collections

    handler = _handler(client_id)
    if handler is None:
        return None
    bound = handler._cubegate_queue = HookQueueBound(limit)
    slot = handler.max_conns.default_factory
    handler.max_conns = collections.defaultdict(lambda: _SlotWait(slot(), bound))
    wrap_reader(client_id, handler.client, lambda reader: _BoundedReader(reader, bound))
    return bound


# -- message construction: the same type check, without its per-field cost ------------------
# mitmproxy checks every field of every Request/Response it builds (MessageData.__post_init__,
# unless Python runs with -O) through typecheck.check_option_type, which formats a TypeError
# for each field before it looks (typing's repr of `bytes | None` and friends) and recurses into
# unions: ~45 µs per message, two messages per request. The fields are plain classes or unions
# of them, so each is checked with one isinstance against the classes it allows; a value that
# fails goes to mitmproxy's check, which raises its own TypeError. A field whose type is more
# than that (none today) is checked by mitmproxy's function as before.
def _allowed_classes(typeinfo) -> tuple | None:
    """The classes one isinstance needs for this field type; None: not that simple."""
    import typing
    origin = typing.get_origin(typeinfo)
    if origin is typing.Union or origin is types.UnionType:
        out = []
        for arg in typing.get_args(typeinfo):
            one = _allowed_classes(arg)
            if one is None:
                return None
            out.extend(one)
        return tuple(out)
    if typeinfo is type(None):
        return (type(None),)
    if isinstance(typeinfo, type) and origin is None and typeinfo is not typing.Any:
        return (float, int) if typeinfo is float else (typeinfo,)   # check_option_type takes an int for a float
    return None


def _message_checker(cls):
    from mitmproxy.utils import typecheck
    plan = tuple((f.name, f.type, _allowed_classes(f.type)) for f in dataclasses.fields(cls))

    def check(self) -> None:
        for name, typeinfo, allowed in plan:
            value = getattr(self, name)
            if allowed is None or not isinstance(value, allowed):
                typecheck.check_option_type(name, value, typeinfo)   # raises, as mitmproxy would
    return check


def install_fast_message_check() -> None:
    """RequestData and ResponseData get a __post_init__ with the same answers (see above)."""
    if not hasattr(http.MessageData, "__post_init__"):
        return        # python -O: mitmproxy checks nothing, neither do we
    for cls in (http.RequestData, http.ResponseData):
        if "__post_init__" not in cls.__dict__:
            check = _message_checker(cls)
            check._cubegate = True
            cls.__post_init__ = check


def fast_message_check_installed() -> bool:
    return all(getattr(cls.__dict__.get("__post_init__"), "_cubegate", False)
               for cls in (http.RequestData, http.ResponseData))


# -- option reads ------------------------------------------------------------------------------
# Every ctx.options.X read deep-copies the value (twice when it is the default), and mitmproxy's
# HTTP layer reads several per request (body_size_limit, validate_inbound_headers, ...). A copy of
# a str, int, float, bool, bytes or None is that same object: those are returned as they are,
# anything else is still copied.
_IMMUTABLE_OPTION_TYPES = frozenset({str, int, float, bool, bytes, type(None)})


def install_cheap_option_reads() -> None:
    from mitmproxy import optmanager
    cls = optmanager._Option
    if getattr(cls.current, "_cubegate", False):
        return
    original, unset, deepcopy = cls.current, optmanager.unset, __import__("copy").deepcopy

    def current(self):
        v = self._default if self.value is unset else self.value
        return v if type(v) in _IMMUTABLE_OPTION_TYPES else deepcopy(v)

    current._cubegate = True
    current._cubegate_original = original
    cls.current = current


def cheap_option_reads_installed() -> bool:
    from mitmproxy import optmanager
    return getattr(optmanager._Option.current, "_cubegate", False)


# -- one write per connection per event ----------------------------------------------------------
# mitmproxy writes each SendData its layers yield as it comes (ConnectionHandler.server_event):
# a response's head and its body are two TLS records and two send() calls, on loopback each one
# running the receiver's TCP path too. Everything a handler writes while it holds its
# server_event lock (one synchronous stretch: "no await beyond this point") is queued per
# connection and written at once when the lock is released, before any other task runs: the same
# bytes in the same order, in fewer system calls. Whoever reaches past the writer to its transport
# (close_client, abort_now, mitmproxy's close/write_eof/drain) gets what is queued written first.
import asyncio   # noqa: E402
import collections   # noqa: E402
import logging   # noqa: E402

_cork_log = logging.getLogger("cubegate.mitm")


class _WriteCork:
    __slots__ = ("active", "dirty", "completed")

    def __init__(self) -> None:
        self.active = False
        self.dirty: list[_CorkedWriter] = []
        self.completed: collections.deque = collections.deque()   # HookCompleted events (see _CorkingLock)

    def flush(self) -> None:
        self.active = False
        dirty, self.dirty = self.dirty, []
        for writer in dirty:
            try:
                writer.flush()
            except Exception:   # noqa: BLE001 - as mitmproxy's server_event treats a failed write
                _cork_log.error("a queued write failed", exc_info=True)


class _CorkedWriter:
    """A StreamWriter whose writes wait while its handler's cork is active."""

    def __init__(self, inner: asyncio.StreamWriter, cork: _WriteCork) -> None:
        self._inner = inner
        self._cork = cork
        self._queued: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._cork.active:
            self.flush()
            self._inner.write(data)
            return
        if not self._queued:
            self._cork.dirty.append(self)
        self._queued.append(data)

    def flush(self) -> None:
        if not self._queued:
            return
        data = self._queued[0] if len(self._queued) == 1 else b"".join(self._queued)
        self._queued = []
        if not self._inner.is_closing():   # mitmproxy's own check before each write
            self._inner.write(data)

    @property
    def transport(self):
        self.flush()
        return self._inner.transport

    def write_eof(self) -> None:
        self.flush()
        self._inner.write_eof()

    def close(self) -> None:
        self.flush()
        self._inner.close()

    async def drain(self) -> None:
        self.flush()
        await self._inner.drain()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _CorkingLock(asyncio.Lock):
    """The handler's server_event lock: its holder's writes are queued and sent on release.

    A blocking hook that its holder started (eagerly) and that finished without waiting would
    ask for the lock again to report HookCompleted, and wait for a later loop iteration; its
    event is queued on the cork instead and handled by the holder itself once its own event is
    done (the layers' generators finished: never re-entered mid-event, mitmproxy#7027), before
    it releases the lock, as the next holder would have done."""

    def __init__(self, cork: _WriteCork, handler) -> None:
        super().__init__()
        self._cork = cork
        self._handler = handler
        self._owner = None            # the task holding the lock
        self._draining = False

    async def __aenter__(self) -> None:
        if self._draining and asyncio.current_task() is self._owner:
            self._cork.active = True  # the holder handling a queued HookCompleted: the lock is its own
            return
        await self.acquire()
        self._owner = asyncio.current_task()
        self._cork.active = True

    async def __aexit__(self, *exc) -> None:
        if self._draining and asyncio.current_task() is self._owner:
            return
        try:
            self._draining = True
            completed = self._cork.completed
            while completed:
                await self._handler.server_event(completed.popleft())
        finally:
            self._draining = False
            self._owner = None
            left = list(self._cork.completed)      # only if handling one raised: reported the usual way
            self._cork.completed.clear()
            self._cork.flush()
            self.release()
            for event in left:
                asyncio.get_running_loop().create_task(self._handler.server_event(event))


def hook_completed_by_holder(handler, hook) -> bool:
    """From the hook's task, the hook done: True when its HookCompleted is queued for the lock's
    holder (the hook ran to its end inside the holder's event); False: report it as mitmproxy does."""
    cork = handler.__dict__.get("_cubegate_cork")
    if cork is None or not cork.active or hook.name not in _REPORTED_BY_HOLDER:
        return False
    cork.completed.append(_events.HookCompleted(hook))
    return True


# The hooks of an HTTP message (four per request). Not next_layer: while no layer is decided,
# NextLayer keeps every byte the client sends and asks again on each read; only the lock wait
# between two asks paces that reading today (bounded in time by the head timer, in size by nothing).
_REPORTED_BY_HOLDER = frozenset({"requestheaders", "request", "responseheaders", "response"})


def cork_writes(client_id: str, conn: connection.Connection) -> bool:
    """Queue `conn`'s writes while its handler runs an event (see above). The client's first, from
    client_connected (before mitmproxy's first event: nothing holds or waits for the lock), then
    each upstream's from server_connected. False where it cannot (not a stream writer, the lock
    already in use, no cork for the client): that connection is written as before."""
    handler = _handler(client_id)
    io = handler.transports.get(conn) if handler is not None else None
    if io is None or not isinstance(io.writer, asyncio.StreamWriter):
        return False
    cork = handler.__dict__.get("_cubegate_cork")
    if cork is None:
        lock = handler._server_event_lock
        if conn is not handler.client or type(lock) is not asyncio.Lock or lock.locked() or lock._waiters:
            return False
        cork = handler._cubegate_cork = _WriteCork()
        handler._server_event_lock = _CorkingLock(cork, handler)
    io.writer = _CorkedWriter(io.writer, cork)
    return True


def writes_corked(client_id: str, conn: connection.Connection) -> bool:
    io = connection_io(client_id, conn)
    return isinstance(getattr(io, "writer", None), _CorkedWriter)


# -- header look-ups ------------------------------------------------------------------------------
# Each Headers look-up (get, `in`, get_all, [name]) goes through MutableMapping's mixins and
# _MultiDict, calling the _kconv staticmethod for every field and, for a name that is absent,
# raising and catching a KeyError; mitmproxy's HTTP layers and our hooks make ~90 of them per
# request. The same answers, with one lower() per field and no exception for "absent".
def _header_key(name) -> bytes:
    return name.encode("utf-8", "surrogateescape").lower() if type(name) is str else http._always_bytes(name).lower()


def _fast_get_all(self, name) -> list[str]:
    key = _header_key(name)
    return [v.decode("utf-8", "surrogateescape") for k, v in self.fields if k.lower() == key]


def _fast_contains(self, name) -> bool:
    key = _header_key(name)
    for k, _ in self.fields:
        if k.lower() == key:
            return True
    return False


def _fast_get(self, name, default=None):
    values = _fast_get_all(self, name)
    return ", ".join(values) if values else default   # Headers._reduce_values folds them so


def install_fast_header_lookups() -> None:
    cls = http.Headers
    if getattr(cls.get_all, "_cubegate", False):
        return
    originals = {"get_all": cls.get_all, "__contains__": cls.__contains__, "get": cls.get}
    for name, fast in (("get_all", _fast_get_all), ("__contains__", _fast_contains), ("get", _fast_get)):
        fast._cubegate = True
        fast._cubegate_original = originals[name]
        setattr(cls, name, fast)


def fast_header_lookups_installed() -> bool:
    return all(getattr(getattr(http.Headers, n), "_cubegate", False) for n in ("get_all", "__contains__", "get"))


# -- hook arguments -------------------------------------------------------------------------------
# Hook.args() lists a hook's dataclass fields with dataclasses.fields() on every call, and each hook
# is asked three times (the connection handler, the addon manager, the hook table). A hook class's
# fields never change: their names are read once per class.
_HOOK_ARG_NAMES: dict[type, tuple[str, ...]] = {}


def _cached_hook_args(self) -> list:
    names = _HOOK_ARG_NAMES.get(type(self))
    if names is None:
        names = _HOOK_ARG_NAMES[type(self)] = tuple(f.name for f in dataclasses.fields(self))
    return [getattr(self, n) for n in names]


def install_cached_hook_args() -> None:
    if getattr(hooks.Hook.args, "_cubegate", False):
        return
    _cached_hook_args._cubegate = True
    _cached_hook_args._cubegate_original = hooks.Hook.args
    hooks.Hook.args = _cached_hook_args


def cached_hook_args_installed() -> bool:
    return getattr(hooks.Hook.args, "_cubegate", False)
