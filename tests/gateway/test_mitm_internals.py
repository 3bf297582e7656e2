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
