"""mitmproxy internals the gateway depends on: this fails when an upgrade moves them."""
from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Optional, Sequence

import pytest
from hypothesis import given, settings, strategies as st_
from mitmproxy import http as _mhttp, options, optmanager
from mitmproxy.addons import proxyserver
from mitmproxy.proxy import server
from mitmproxy.proxy.layers import websocket
from mitmproxy.proxy.layers.http import _http1
from mitmproxy.utils import typecheck as _typecheck

from egress import mitm_internals


def test_error_pages_never_quote_the_failing_bytes():
    mitm_internals.install_safe_error_pages()
    assert mitm_internals.safe_error_pages_installed()
    raw = _http1.make_error_response(502, "HTTP/1 protocol error: Invalid header name b'sk-live-secret'")
    assert b"sk-live-secret" not in raw and raw.startswith(b"HTTP/1.1 502")


def test_connection_handler_shape():
    # close_client/abort_now/cancel_server/wrap_reader reach these attributes.
    src = inspect.getsource(server.ConnectionHandler)
    for attr in ("self.transports", "def close_connection", "self.client"):
        assert attr in src, attr
    io_fields = {f for f in inspect.signature(server.ConnectionIO).parameters}
    assert {"handler", "reader", "writer"} <= io_fields
    assert "connections" in inspect.getsource(proxyserver.Proxyserver.__init__)


def test_streamed_bodies_go_through_a_callable_and_end_with_an_empty_call():
    from mitmproxy.proxy.layers import http as layers_http
    src = inspect.getsource(layers_http.HttpStream.state_stream_response_body)
    assert "self.flow.response.stream(event.data)" in src and 'stream(b"")' in src
    src = inspect.getsource(layers_http.HttpStream.state_stream_request_body)
    assert "self.flow.request.stream(event.data)" in src and 'stream(b"")' in src


def test_websocket_layer_appends_each_message_and_honours_drop():
    src = inspect.getsource(websocket.WebsocketLayer.relay_messages)
    assert "self.flow.websocket.messages.append(message)" in src and "message.dropped" in src


def test_listening_sockets_attribute_exists():
    from mitmproxy.proxy import mode_servers
    assert "_servers" in inspect.getsource(mode_servers.AsyncioServerInstance)


def test_http1_trailers_still_unsupported_upstream_and_our_refusal_is_installed():
    # If mitmproxy implements trailers, this patch (and the hang it prevents) can go.
    from pathlib import Path
    assert "HTTP trailers are not implemented yet" in Path(_http1.__file__).read_text()
    mitm_internals.install_trailer_refusal()
    assert mitm_internals.trailer_refusal_installed()


# -- the fast path's reach (egress/fastpath/) ------------------------------------------
def test_hand_over_follows_mitmproxys_own_accept_path():
    """hand_over repeats AsyncioServerInstance.handle_stream's steps: when mitmproxy changes
    how an accepted stream becomes a ProxyConnectionHandler, this fails."""
    from mitmproxy.proxy import mode_servers
    src = inspect.getsource(mode_servers.ServerInstance.handle_stream)
    assert "ProxyConnectionHandler(" in src and "register_connection" in src and "original_addr" in src
    assert list(inspect.signature(mode_servers.ServerInstance.handle_stream).parameters) == ["self", "reader", "writer"]
    assert list(inspect.signature(mode_servers.ServerInstance.make).parameters) == ["mode", "manager"]
    assert "register_connection" in dir(proxyserver.Proxyserver)


def test_parsers_the_fast_path_borrows_still_answer_the_same():
    head = mitm_internals.read_request_head([b"CONNECT Api.Example.test:443 HTTP/1.1\r\n",
                                             b"Proxy-Authorization: Basic eDp5\r\n"])
    assert (head.method, head.host, head.port) == ("CONNECT", "Api.Example.test", 443)
    assert head.headers.get_all("proxy-authorization") == ["Basic eDp5"]
    assert mitm_internals.starts_like_tls(b"\x16\x03\x01\x02\x00") and not mitm_internals.starts_like_tls(b"GET ")
    from tests.gateway.test_fastpath_units import client_hello
    hello = client_hello("sni.example.test")
    assert mitm_internals.parse_client_hello(hello).sni == "sni.example.test"
    assert mitm_internals.parse_client_hello(hello[:20]) is None   # incomplete


def test_original_destination_reader_exists():
    from mitmproxy import platform
    assert platform.original_addr is not None and callable(platform.original_addr)


def test_unbounded_head_patch_targets_mitmproxys_head_readers():
    mitm_internals.install_head_limit(48 * 1024)
    assert mitm_internals.head_limit_installed() == 48 * 1024
    mitm_internals.install_head_limit(48 * 1024)          # idempotent: wraps the original once
    assert mitm_internals.head_limit_installed() == 48 * 1024
    for cls in (_http1.Http1Server, _http1.Http1Client):
        src = inspect.getsource(cls.read_headers._cubegate_original)
        assert "self.buf.maybe_extract_lines()" in src, cls


def test_websocket_control_frames_are_sent_through_send2():
    mitm_internals.install_websocket_control_scrub()
    assert mitm_internals.websocket_control_scrub_installed()
    src = inspect.getsource(websocket.WebsocketLayer.relay_messages)
    assert "dst_ws.send2(ws_event)" in src and "wsproto.events.Ping" in src


def test_our_websocket_predicate_is_mitmproxys():
    from mitmproxy.proxy.layers import http as layers_http
    src = inspect.getsource(layers_http.HttpStream.send_response)
    for piece in ('status_code == 101', '"upgrade", "").lower() == "websocket"', '"Sec-WebSocket-Version"'):
        assert piece in src, piece


def test_hook_table_replicates_addonmanagers_dispatch():
    """HookTableAddons re-implements trigger_event and handle_lifecycle: when mitmproxy changes
    how it dispatches (error handling, the UpdateHook after flow events, the configure
    signal), this fails and the copy must follow."""
    from mitmproxy import addonmanager
    trigger = inspect.getsource(addonmanager.AddonManager.trigger_event)
    assert "for i in self.chain" in trigger and "safecall()" in trigger and "except exceptions.AddonHalt" in trigger
    invoke = inspect.getsource(addonmanager.AddonManager.invoke_addon)
    assert "func(*event.args())" in invoke and "inspect.isawaitable(res)" in invoke
    lifecycle = inspect.getsource(addonmanager.AddonManager.handle_lifecycle)
    assert "hooks.UpdateHook([message])" in lifecycle and "isinstance(message, flow.Flow)" in lifecycle
    safecall = inspect.getsource(addonmanager.safecall)
    assert "(exceptions.AddonHalt, exceptions.OptionsError)" in safecall and "logger.error" in safecall
    assert "master.options.changed.connect(self._configure_all)" in inspect.getsource(
        addonmanager.AddonManager.__init__)
    for name in ("register", "add", "remove", "clear"):       # every way the chain changes is overridden
        assert name in mitm_internals.HookTableAddons.__dict__, name
    changers = {n for n, f in vars(addonmanager.AddonManager).items() if inspect.isfunction(f)
                and any(w in inspect.getsource(f) for w in ("self.chain =", "self.chain.append(", "self.lookup["))}
    assert changers <= {"register", "add", "remove", "clear", "__init__"}, changers


def test_every_head_deadline_reaches_what_it_patches():
    """install_head_limit(..., head_timeout): the clock lives on Http1Server (its buf and state),
    its wakeup comes back through HttpLayer's command_sources, and the gate hears of a refusal
    through a non-blocking StartHook."""
    from mitmproxy import hooks
    from mitmproxy.proxy.layers import http as layers_http
    mitm_internals.install_head_limit(48 * 1024, 2.0)
    assert mitm_internals.head_deadline_installed() == 2.0
    handle = inspect.getsource(_http1.Http1Server._handle_event._cubegate_original)
    assert "self.buf += event.data" in handle and "yield from self.state(event)" in handle
    read = inspect.getsource(_http1.Http1Server.read_headers._cubegate_original)
    assert "self.state = self.read_body" in read and "self.state = self.done" in read
    assert "def done" in inspect.getsource(_http1.Http1Connection)
    route = inspect.getsource(layers_http.HttpLayer.event_to_child)
    assert "isinstance(command, commands.RequestWakeup)" in route and "self.command_sources[command] = child" in route
    assert "self.command_sources.pop(event.command)" in inspect.getsource(layers_http.HttpLayer._handle_event)
    hook_task = server.ConnectionHandler.hook_task
    assert "if hook.blocking:" in inspect.getsource(getattr(hook_task, "_cubegate_original", hook_task))
    assert hooks.all_hooks["cubegate_head_timeout"] is mitm_internals.CubegateHeadTimeoutHook
    assert mitm_internals.CubegateHeadTimeoutHook.blocking is False
    from egress.gate import PolicyGate
    from egress.hook_guard import hook_names
    assert "cubegate_head_timeout" in hook_names(PolicyGate)      # guarded: fails closed like every hook
    # HTTP/2: h2 holds an unfinished header block in its FrameBuffer, a partial frame in _data
    import h2.config
    import h2.connection
    from hyperframe.frame import HeadersFrame
    from mitmproxy.proxy.layers.http import _http2
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    h2c.initiate_connection()
    h2c.receive_data(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    frame = HeadersFrame(1, data=b"\x82", flags=[]).serialize()       # no END_HEADERS
    h2c.receive_data(frame)
    assert h2c.incoming_buffer._headers_buffer and not h2c.incoming_buffer._data
    h2c.receive_data(HeadersFrame(3, data=b"\x82").serialize()[:5])
    assert bytes(h2c.incoming_buffer._data[3:4]) == b"\x01"                # type byte of the partial frame
    assert "self.h2_conn.receive_data(event.data)" in inspect.getsource(_http2.Http2Connection)
    assert "def protocol_error" in inspect.getsource(_http2.Http2Connection)
    assert "self._handle_event = self.done" in inspect.getsource(_http2.Http2Connection.close_connection)
    mitm_internals.install_head_limit(48 * 1024)                  # none: back to no deadline
    assert mitm_internals.head_deadline_installed() is None


def test_hook_queue_bound_reaches_what_it_patches():
    """install_hook_queue_bound counts what ConnectionHandler starts for a paused layer (hook_task
    for a blocking hook, open_connection) and stops reading the client through its reader: when
    mitmproxy changes how it reads, pauses or opens, this fails."""
    mitm_internals.install_hook_queue_bound()
    mitm_internals.install_hook_queue_bound()                    # idempotent
    assert mitm_internals.hook_queue_bound_installed()
    original = inspect.getsource(server)          # the module's text: our patches replaced the methods
    for piece in ("self.hook_task(command)", "self.open_connection(command)", "await self.server_event(events.HookCompleted(hook))",
                  "events.OpenConnectionCompleted(command, None)", "reader = self.transports[connection].reader",
                  "data = await reader.read(65535)", "async with self.max_conns[command.connection.address]:",
                  "collections.defaultdict(lambda: asyncio.Semaphore(5))"):
        assert piece in original, piece
    from mitmproxy.proxy import layer
    paused = inspect.getsource(layer.Layer.handle_event)
    assert "command.blocking = self" in paused and "self._paused_event_queue.append(event)" in paused
    assert "while not self._paused and self._paused_event_queue:" in inspect.getsource(layer.Layer)


def test_a_pinned_upstream_gets_its_name_back_and_is_reused_for_it():
    """mitmproxy reuses an upstream connection for a request only when (host, port) equals its
    address, and refuses a new address on an open connection: both are why the gateway names a
    pinned connection under Server.__setattr__ (the MITM keep-alive hang otherwise)."""
    import pytest as _pytest
    from mitmproxy import connection
    from mitmproxy.proxy.layers.http import GetHttpConnection
    s = connection.Server(address=("198.18.0.10", 443))
    s.tls = True
    s.state = connection.ConnectionState.OPEN
    with _pytest.raises(RuntimeError, match="Cannot change server.address"):
        s.address = ("api.example.test", 443)
    mitm_internals.name_the_dialled_server(s, ("api.example.test", 443))
    assert s.address == ("api.example.test", 443)
    assert GetHttpConnection(("api.example.test", 443), True, None).connection_spec_matches(s)
    assert not GetHttpConnection(("198.18.0.10", 443), True, None).connection_spec_matches(s)


# -- the message type check and option reads (cheaper, same answers) -----------------------------

_ANY_VALUE = st_.one_of(st_.none(), st_.booleans(), st_.integers(), st_.floats(allow_nan=False), st_.binary(max_size=4),
                        st_.text(max_size=4), st_.just(_mhttp.Headers()), st_.just([b"x"]), st_.just((1, 2)))


def _mitmproxys_check(cls, obj) -> bool:
    """What MessageData.__post_init__ does, field by field: True when every field passes."""
    try:
        for f in dataclasses.fields(cls):
            _typecheck.check_option_type(f.name, getattr(obj, f.name), f.type)
    except TypeError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(cls=st_.sampled_from([_mhttp.RequestData, _mhttp.ResponseData]), data=st_.data())
def test_the_fast_message_check_answers_as_mitmproxys(cls, data):
    """Each field's value of any type, well typed or not: ours refuses exactly what mitmproxy's refuses,
    with mitmproxy's own TypeError."""
    good = {"http_version": b"HTTP/1.1", "headers": _mhttp.Headers(), "content": b"", "trailers": None,
            "timestamp_start": 1.0, "timestamp_end": None, "host": "h", "port": 443, "method": b"GET",
            "scheme": b"https", "authority": b"", "path": b"/", "status_code": 200, "reason": b"OK"}
    names = [f.name for f in dataclasses.fields(cls)]
    values = {n: good[n] for n in names}
    for n in data.draw(st_.lists(st_.sampled_from(names), max_size=3, unique=True)):
        values[n] = data.draw(_ANY_VALUE)
    obj = types.SimpleNamespace(**values)
    check = mitm_internals._message_checker(cls)
    if _mitmproxys_check(cls, obj):
        check(obj)
    else:
        with pytest.raises(TypeError, match="^Expected "):
            check(obj)


def test_the_fast_message_check_is_what_mitmproxy_builds_messages_with():
    """mitmproxy still checks each field in __post_init__ (else there would be nothing to keep), and
    once installed a message is checked by ours: a wrong type is refused, a right one built."""
    src = inspect.getsource(_mhttp.MessageData)
    assert "def __post_init__(self):" in src and "typecheck.check_option_type(field.name, val, field.type)" in src
    mitm_internals.install_fast_message_check()
    mitm_internals.install_fast_message_check()                  # idempotent
    assert mitm_internals.fast_message_check_installed()
    ok = _mhttp.Request("h", 443, b"GET", b"https", b"", b"/", b"HTTP/1.1", _mhttp.Headers(), b"", None, 1, None)
    assert ok.port == 443 and ok.timestamp_start == 1        # an int where a float goes: accepted, as before
    with pytest.raises(TypeError, match="Expected <class 'int'> for port"):
        _mhttp.Request("h", "443", b"GET", b"https", b"", b"/", b"HTTP/1.1", _mhttp.Headers(), b"", None, 1.0, None)
    with pytest.raises(TypeError, match="for reason"):
        _mhttp.ResponseData(http_version=b"HTTP/1.1", headers=_mhttp.Headers(), content=b"", trailers=None,
                            timestamp_start=1.0, timestamp_end=None, status_code=200, reason="OK")


def test_option_reads_copy_what_is_mutable_and_only_that():
    assert "copy.deepcopy(v)" in inspect.getsource(optmanager._Option.current._cubegate_original
                                                   if mitm_internals.cheap_option_reads_installed()
                                                   else optmanager._Option.current)
    mitm_internals.install_cheap_option_reads()
    mitm_internals.install_cheap_option_reads()                  # idempotent
    assert mitm_internals.cheap_option_reads_installed()
    o = options.Options()
    o.add_option("cg_seq", Sequence[str], ["a"], "")
    o.add_option("cg_limit", Optional[int], None, "")
    o.add_option("cg_name", str, "x", "")
    assert o.cg_limit is None and o.cg_name == "x"
    o.update(cg_limit=5, cg_seq=["b"])
    assert o.cg_limit == 5
    got = o.cg_seq
    got.append("mutated")                         # a copy: the option itself is unchanged
    assert o.cg_seq == ["b"] and o.cg_seq is not o.cg_seq
    o.reset()
    assert o.cg_seq == ["a"] and o.cg_limit is None


# -- corked writes --------------------------------------------------------------------------------
def test_server_event_still_writes_under_its_lock_and_the_cork_reaches_what_it_patches():
    """The cork relies on mitmproxy writing every SendData inside `async with self._server_event_lock`
    with no await in that body, and on the writer being reached through ConnectionIO each time."""
    src = inspect.getsource(server.ConnectionHandler.server_event._cubegate_original
                            if hasattr(server.ConnectionHandler.server_event, "_cubegate_original")
                            else server.ConnectionHandler.server_event)
    assert "async with self._server_event_lock:" in src and "# No `await` beyond this point." in src
    assert "writer = self.transports[command.connection].writer" in src and "writer.write(command.data)" in src
    assert "self._server_event_lock = asyncio.Lock()" in inspect.getsource(server.ConnectionHandler.__init__)
    for piece in ("writer.write_eof()", "writer.close()", "await transport.writer.drain()"):
        assert piece in inspect.getsource(server.ConnectionHandler), piece


async def _pair():
    import asyncio
    import socket
    a, b = socket.socketpair()
    b.setblocking(False)
    _, writer = await asyncio.open_connection(sock=a)
    return writer, b


def _received(sock) -> bytes:
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return b""


def test_writes_under_the_lock_go_out_at_its_release_in_order_in_one_send():
    import asyncio

    async def main():
        writer, peer = await _pair()
        cork = mitm_internals._WriteCork()
        corked = mitm_internals._CorkedWriter(writer, cork)
        lock = mitm_internals._CorkingLock(cork, handler=None)
        sends = []
        real_send = writer.transport._sock.send
        writer.transport._sock = types.SimpleNamespace(**{n: getattr(writer.transport._sock, n)
                                                          for n in ("fileno", "close", "shutdown")},
                                                       send=lambda d: sends.append(bytes(d)) or real_send(d))
        async with lock:
            for chunk in (b"head ", b"body ", b"end"):
                corked.write(chunk)
            assert _received(peer) == b"" and sends == []      # nothing left while the lock is held
        assert sends == [b"head body end"]                     # one send, the same bytes in order
        assert _received(peer) == b"head body end"
        corked.write(b"outside")                               # no lock held: written at once
        assert sends[-1] == b"outside"
        corked.close()
        peer.close()
    asyncio.run(main())


def test_who_reaches_past_the_writer_gets_the_queued_bytes_written_first():
    import asyncio

    async def main():
        writer, peer = await _pair()
        cork = mitm_internals._WriteCork()
        corked = mitm_internals._CorkedWriter(writer, cork)
        lock = mitm_internals._CorkingLock(cork, handler=None)
        async with lock:
            corked.write(b"a 403 page")
            transport = corked.transport                     # what close_client / abort_now use
            assert _received(peer) == b"a 403 page"
            transport.abort()
            corked.write(b"after the reset")                 # what a layer yields after abort_now
        await asyncio.sleep(0)
        assert _received(peer) == b""                        # never reaches the peer
        peer.close()

        writer, peer = await _pair()
        corked = mitm_internals._CorkedWriter(writer, cork)
        async with lock:
            corked.write(b"last bytes")
            corked.write_eof()                               # mitmproxy's half-close
        assert _received(peer) == b"last bytes"
        corked.close()
        peer.close()
    asyncio.run(main())


def test_a_failed_queued_write_is_logged_and_the_lock_is_released():
    import asyncio

    async def main():
        writer, peer = await _pair()
        cork = mitm_internals._WriteCork()
        corked = mitm_internals._CorkedWriter(writer, cork)
        lock = mitm_internals._CorkingLock(cork, handler=None)
        writer.write_eof()
        async with lock:
            corked.write(b"after eof")                       # asyncio refuses it at the flush
        assert not lock.locked() and not cork.active
        async with lock:                                     # and the next holder gets the lock
            pass
        corked.close()
        peer.close()
    asyncio.run(main())


# -- header look-ups (cheaper, same answers) -------------------------------------------------------
_NAME_BYTES = st_.sampled_from([b"Host", b"host", b"HOST", b"Content-Length", b"content-length", b"X-\xc3\xa9",
                                b"x-\xc3\xa9", b"X-\xff", b"Transfer-Encoding", b"", b"k"])
_FIELDS = st_.lists(st_.tuples(_NAME_BYTES, st_.binary(max_size=6) | st_.sampled_from([b"a, b", b"\xff\xfe"])),
                    max_size=6)
_LOOKUP = st_.one_of(_NAME_BYTES, _NAME_BYTES.map(lambda b: b.decode("utf-8", "surrogateescape")),
                     st_.sampled_from(["HoSt", "content-LENGTH", "x-\u00e9", "X-\u00c9", "absent", ""]))


@settings(max_examples=400, deadline=None)
@given(fields=_FIELDS, name=_LOOKUP)
def test_the_fast_header_lookups_answer_as_mitmproxys(fields, name):
    mitm_internals.install_fast_header_lookups()
    h = _mhttp.Headers(fields)
    stock = {n: getattr(getattr(_mhttp.Headers, n), "_cubegate_original") for n in ("get_all", "__contains__", "get")}
    assert h.get_all(name) == stock["get_all"](h, name)
    assert (name in h) == stock["__contains__"](h, name)
    assert h.get(name) == stock["get"](h, name) and h.get(name, "d") == stock["get"](h, name, "d")
    if stock["__contains__"](h, name):
        assert h[name] == ", ".join(stock["get_all"](h, name))
    else:
        with pytest.raises(KeyError):
            h[name]


def test_the_fast_header_lookups_are_installed_over_what_mitmproxy_inherits():
    """Headers still gets get / in from MutableMapping and get_all from _MultiDict (what ours stand in for)."""
    from mitmproxy.coretypes import multidict
    mitm_internals.install_fast_header_lookups()
    mitm_internals.install_fast_header_lookups()                 # idempotent
    assert mitm_internals.fast_header_lookups_installed()
    assert "return [_native(x) for x in super().get_all(name)]" in inspect.getsource(
        _mhttp.Headers.get_all._cubegate_original)
    assert "self._kconv(k) == key" in inspect.getsource(multidict._MultiDict.get_all)
    assert _mhttp.Headers._reduce_values(["a", "b"]) == "a, b"
    with pytest.raises(TypeError):
        _mhttp.Headers().get(5)                                  # neither str nor bytes: as before


def test_hook_args_are_each_hooks_fields_in_order_read_once_per_class():
    """Every hook mitmproxy defines: the cached args are what Hook.args gave (fields, in order)."""
    from mitmproxy import hooks
    mitm_internals.install_cached_hook_args()
    mitm_internals.install_cached_hook_args()                    # idempotent
    assert mitm_internals.cached_hook_args_installed()
    stock = hooks.Hook.args._cubegate_original
    assert "for field in fields(self):" in inspect.getsource(stock)
    seen = 0
    for name, cls in hooks.all_hooks.items():
        values = [object() for _ in dataclasses.fields(cls)]
        hook = cls(*values)
        assert hook.args() == stock(hook) == values, name
        assert hook.args() == values                              # the second call: from the cache
        seen += 1
    assert seen > 20                                              # every hook class, not a few


class _Handler:
    """What _CorkingLock needs of mitmproxy's ConnectionHandler: server_event under the lock."""

    def __init__(self):
        import asyncio
        self.handled = []
        self._cubegate_cork = mitm_internals._WriteCork()
        self._server_event_lock = mitm_internals._CorkingLock(self._cubegate_cork, self)
        self.on_event = lambda event: None
        self.loop = asyncio.get_running_loop()

    async def server_event(self, event):
        async with self._server_event_lock:
            self.handled.append(event)
            self.on_event(event)


def test_a_hook_done_inside_its_event_is_reported_by_the_holder_before_it_releases():
    import asyncio
    from mitmproxy.proxy import events
    from mitmproxy.proxy.layer import NextLayerHook
    from mitmproxy.proxy.layers.http import HttpRequestHook

    async def main():
        h = _Handler()
        hook = HttpRequestHook(None)

        def on_event(event):
            if event == "data":         # as mitmproxy starts a blocking hook: eagerly, inside the event
                assert mitm_internals.hook_completed_by_holder(h, hook)
                # next_layer is reported the usual way: its lock wait paces an undecided connection's reads
                assert not mitm_internals.hook_completed_by_holder(h, NextLayerHook(None))
        h.on_event = on_event
        await h._server_event_lock.acquire()              # held: "earlier" queues for it
        earlier = asyncio.ensure_future(h.server_event("earlier"))
        await asyncio.sleep(0)
        h._server_event_lock.release()
        await h.server_event("data")
        assert h.handled[:2] == ["earlier", "data"]        # the lock's order is kept
        assert isinstance(h.handled[2], events.HookCompleted) and h.handled[2].command is hook
        assert len(h.handled) == 3                          # handled once, in data's own hold
        await earlier
        assert not h._server_event_lock.locked() and not h._cubegate_cork.active
        assert not mitm_internals.hook_completed_by_holder(h, hook)   # no holder now: the usual way
    asyncio.run(main())


def test_counted_hook_task_still_reports_what_mitmproxys_hook_task_reports():
    """mitmproxy's hook_task: handle the hook, then HookCompleted for a blocking one. Ours does the
    same (through the holder when the hook ended inside its event)."""
    src = inspect.getsource(server.ConnectionHandler.hook_task._cubegate_original
                            if hasattr(server.ConnectionHandler.hook_task, "_cubegate_original")
                            else server.ConnectionHandler.hook_task)
    assert "await self.handle_hook(hook)" in src
    assert "if hook.blocking:" in src and "await self.server_event(events.HookCompleted(hook))" in src
