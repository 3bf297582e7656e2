"""Fail closed on our own bugs: any exception in a gate hook refuses its flow or connection.

egress/hook_guard.py wraps every hook of PolicyGate; PolicyGate.hook_failed refuses (a 503/502
in the deny shape where an answer can still be sent, else a reset), audits and counts
`internal_error`, and logs the exception's class and frames, never its text. Each unit test
makes one hook raise, with a secret in the exception's message, and reads what the sandbox,
the upstream side and the operator would see. The lab test makes a real part fail in a running
gateway (its identity database overwritten under it) and shows the upstream never got the request.
"""
from __future__ import annotations

import json
import logging
import os
import re

import pytest
from mitmproxy import http, tls
from mitmproxy.proxy import layers, server_hooks
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layer import NextLayer
from mitmproxy.test import tflow

from egress import hook_guard
from egress.gate import PolicyGate
from tests.gateway.test_gate_units import (Parts, connect_flow, connected, deny_doc, hello, inner_request,  # noqa: F401
                                           nameserver, parts, run, tunnel)

LEAKED = "sk-live-exception-text-7f3a9c2e"   # what a buggy part's exception message might quote


class Boom(RuntimeError):
    pass


def breaks(obj, name: str, monkeypatch) -> None:
    """From now on obj.name raises, its message carrying a secret."""
    def boom(*a, **k):
        raise Boom(f"failed on {LEAKED}")
    monkeypatch.setattr(obj, name, boom)


def failure_records(p: Parts, hook: str) -> list[dict]:
    return [r for r in p.records() if r.get("reason") == "internal_error" and r["extra"]["hook"] == hook]


def assert_refused(p: Parts, hook: str, caplog, error: str = "Boom") -> dict:
    recs = failure_records(p, hook)
    assert len(recs) == 1, p.records()
    rec = recs[0]
    assert rec["decision"] == "deny" and rec["extra"] == {"hook": hook, "error": error}
    assert LEAKED not in (p.audit_dir / "audit-current.jsonl").read_text()
    assert LEAKED not in caplog.text and f"gate hook {hook} raised {error}" in caplog.text
    assert sum(p.metrics.registry.get_sample_value(
        "cubegate_decisions_total", {"sandbox": sb, "action": "deny", "reason": "internal_error",
                                     "stage": "internal"}) or 0 for sb in ("sb-1", "-")) == 1
    return rec


@pytest.fixture(autouse=True)
def _log(caplog):
    caplog.set_level(logging.INFO)


# ------------------------------------------------------------ the guard itself
def test_every_hook_the_gate_implements_fails_closed():
    names = hook_guard.hook_names(PolicyGate)
    assert {"requestheaders", "request", "responseheaders", "response", "next_layer", "tls_clienthello",
            "server_connect", "websocket_message", "error"} <= set(names)
    assert hook_guard.guarded(PolicyGate)
    assert set(names) == set(CASES), "a gate hook without a fail-closed test"


def test_a_class_without_hook_failed_cannot_be_guarded():
    class Addon:
        def request(self, flow):
            pass
    with pytest.raises(TypeError):
        hook_guard.fail_closed(Addon)


def test_the_log_line_names_frames_not_the_message():
    try:
        raise Boom(LEAKED)
    except Boom as e:
        text = hook_guard.where(e)
    assert "test_the_log_line_names_frames_not_the_message" in text and LEAKED not in text


# ------------------------------------------------------------ each hook
def case_client_connected(p, monkeypatch, tctx):
    breaks(p.gate, "_wrap_reader", monkeypatch)
    client = connected(p)
    assert client.error          # mitmproxy closes it before reading a byte
    return p.gate.conns[client.id]


async def case_http_connect(p, monkeypatch, tctx):
    client = connected(p)
    p.gate.identities.close()    # a real failure: the identity database is gone under the gate
    f = connect_flow(client, "api.allowed.test", auth=p.auth())
    await p.gate.http_connect(f)
    assert f.response.status_code == 503 and deny_doc(f)["reason"] == "internal_error"
    return p.gate.conns[client.id]


async def case_requestheaders(p, monkeypatch, tctx):
    client, _ = await tunnel(p, tctx, "api.allowed.test")
    breaks(p.gate.credentials, "on_request", monkeypatch)
    f = inner_request(client, "api.allowed.test")
    await p.gate.requestheaders(f)
    assert f.response.status_code == 503 and deny_doc(f)["reason"] == "internal_error"
    assert "Authorization" not in f.request.headers      # nothing was injected, nothing goes upstream
    return p.gate.conns[client.id]


async def case_request(p, monkeypatch, tctx):
    client, _ = await tunnel(p, tctx, "api.allowed.test")
    f = inner_request(client, "api.allowed.test")
    await p.gate.requestheaders(f)
    assert f.response is None
    breaks(p.gate, "_arm_upstream_timer", monkeypatch)
    await p.gate.request(f)
    assert f.response.status_code == 503 and deny_doc(f)["reason"] == "internal_error"
    return p.gate.conns[client.id]


async def _answered(p, tctx, **resp):
    client, _ = await tunnel(p, tctx, "api.allowed.test")
    f = inner_request(client, "api.allowed.test")
    await p.gate.requestheaders(f)
    await p.gate.request(f)
    f.response = http.Response.make(200, f"upstream body {p.gate.credentials}".encode(), resp or {})
    return client, f


async def case_responseheaders(p, monkeypatch, tctx):
    client, f = await _answered(p, tctx)
    breaks(p.gate.credentials, "injected_forms", monkeypatch)    # the scrub cannot be set up
    p.gate.responseheaders(f)
    assert f.response.status_code == 502 and deny_doc(f)["reason"] == "internal_error"
    assert f.response.stream is not True                          # the upstream's body is dropped, ours sent
    await p.gate.response(f)
    assert json.loads(f.response.raw_content)["reason"] == "internal_error"
    return p.gate.conns[client.id]


async def case_response(p, monkeypatch, tctx):
    client, f = await _answered(p, tctx)
    f.response.trailers = http.Headers(x_t=b"1")
    breaks(p.gate.credentials, "scrub_trailers", monkeypatch)    # the trailer scrub fails
    await p.gate.response(f)
    assert f.response.status_code == 502 and deny_doc(f)["reason"] == "internal_error"
    assert f.response.trailers is None
    return p.gate.conns[client.id]


async def case_error(p, monkeypatch, tctx):
    client, f = await _answered(p, tctx)
    breaks(p.gate, "_refused_answered", monkeypatch)
    f.error = tflow.terr()
    p.gate.error(f)
    return p.gate.conns[client.id]


async def case_websocket_message(p, monkeypatch, tctx):
    client, _ = await tunnel(p, tctx, "api.allowed.test")
    f = tflow.twebsocketflow()
    f.client_conn = client
    f.websocket.messages = f.websocket.messages[:1]
    assert f.websocket.messages[-1].from_client
    breaks(p.gate.credentials, "request_needles", monkeypatch)   # the outbound leak check fails
    p.gate.websocket_message(f)
    assert f.websocket.messages[-1].dropped                         # never relayed
    return p.gate.conns[client.id]


async def case_websocket_end(p, monkeypatch, tctx):
    from egress import mitm_internals
    client, _ = await tunnel(p, tctx, "api.allowed.test")
    f = tflow.twebsocketflow()
    f.client_conn = client
    breaks(mitm_internals, "websocket_message_refused", monkeypatch)   # was a message too large? unknown
    p.gate.websocket_end(f)
    return p.gate.conns[client.id]


async def case_next_layer(p, monkeypatch, tctx):
    client = connected(p, transparent=True)
    st = p.gate.conns[client.id]
    ctx_ = Context(client, tctx.options)
    ctx_.server.address = ("198.18.0.10", 443)
    nl = NextLayer(ctx_)
    nl.layer = layers.TCPLayer(ctx_)
    breaks(p.gate, "_kill_client", monkeypatch)     # raw TCP on 443 is refused, and the refusal fails
    p.gate.next_layer(nl)
    return st


async def case_tls_clienthello(p, monkeypatch, tctx):
    client = connected(p, transparent=True)
    breaks(p.gate, "_destination", monkeypatch)
    data = hello(tctx, client, "api.allowed.test")
    await p.gate.tls_clienthello(data)
    assert not data.ignore_connection
    st = p.gate.conns[client.id]
    # and the upstream is never dialled
    sd = server_hooks.ServerConnectionHookData(server=data.context.server, client=client)
    data.context.server.address = ("198.18.0.10", 443)
    await p.gate.server_connect(sd)
    assert sd.server.error
    return st


async def case_tls_start_client(p, monkeypatch, tctx):
    client = connected(p)
    p.gate.conns[client.id].kind = "denied"
    breaks(p.gate, "_kill_client", monkeypatch)      # the refusal itself fails
    p.gate.tls_start_client(tls.TlsData(client, Context(client, tctx.options)))
    return p.gate.conns[client.id]


async def _server_hook(p, tctx):
    client, data = await tunnel(p, tctx, "other.allowed.test")
    server = data.context.server
    server.address = ("other.allowed.test", 443)
    return client, server_hooks.ServerConnectionHookData(server=server, client=client)


async def case_server_connect(p, monkeypatch, tctx):
    client, sd = await _server_hook(p, tctx)
    breaks(p.gate, "_claim_upstream", monkeypatch)
    await p.gate.server_connect(sd)
    assert sd.server.error == "cubegate: internal error"    # mitmproxy does not dial
    return p.gate.conns[client.id]


async def case_server_connected(p, monkeypatch, tctx):
    client, sd = await _server_hook(p, tctx)
    sd.server.peername = ("198.18.0.11", 443)
    breaks(p.gate, "_wrap_reader", monkeypatch)
    p.gate.server_connected(sd)
    return p.gate.conns[client.id]


async def case_server_connect_error(p, monkeypatch, tctx):
    client, sd = await _server_hook(p, tctx)
    breaks(p.gate, "_connect_done", monkeypatch)
    p.gate.server_connect_error(sd)
    return p.gate.conns[client.id]


async def case_server_disconnected(p, monkeypatch, tctx):
    client, sd = await _server_hook(p, tctx)
    breaks(p.gate, "_release_upstream", monkeypatch)
    p.gate.server_disconnected(sd)
    return p.gate.conns[client.id]


async def case_client_disconnected(p, monkeypatch, tctx):
    client, _ = await tunnel(p, tctx, "other.allowed.test")
    breaks(p.gate, "_release_connection", monkeypatch)
    p.gate.client_disconnected(client)
    assert client.id not in p.gate.conns
    return None


def case_cubegate_head_timeout(p, monkeypatch, tctx):
    client = connected(p)
    breaks(p.gate, "_count", monkeypatch)
    p.gate.cubegate_head_timeout(client)     # a later head timed out inside mitmproxy (egress.mitm_internals)
    return p.gate.conns[client.id]


CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


@pytest.mark.parametrize("hook", sorted(CASES))
def test_an_exception_in_the_hook_refuses_audits_and_counts_internal_error(parts, monkeypatch, caplog, hook):
    async def scenario(tctx):
        out = CASES[hook](parts, monkeypatch, tctx)
        return await out if hasattr(out, "__await__") else out
    st = run(parts, scenario)
    error = "ProgrammingError" if hook == "http_connect" else "Boom"
    rec = assert_refused(parts, hook, caplog, error)
    if st is not None:
        assert (st.kind, st.denied_reason) == ("denied", "internal_error")
        assert rec["conn_id"] == st.conn_id
    if hook in ("http_connect", "requestheaders", "request"):
        assert rec["status"] == 503
    elif hook in ("responseheaders", "response"):
        assert rec["status"] == 502
    else:
        assert rec.get("status") is None


def test_a_streamed_response_whose_hook_fails_is_cut_not_completed(parts, monkeypatch, caplog):
    async def scenario(tctx):
        client, f = await _answered(parts, tctx)
        f.response.stream = True                 # its body is with the sandbox already: only a reset is left
        f.response.trailers = http.Headers(x_t=b"1")
        breaks(parts.gate.credentials, "scrub_trailers", monkeypatch)
        await parts.gate.response(f)
        return f
    f = run(parts, scenario)
    assert f.error is not None and f.response.status_code == 200    # killed: the trailers never go
    assert assert_refused(parts, "response", caplog).get("status") is None


# ------------------------------------------------------------ one deny shape
def _sent_by_http1_server(tctx, data: bytes) -> bytes:
    """What mitmproxy's HTTP/1 server side (with our patches) writes back for `data`."""
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http import _http1
    client = tflow.tclient_conn()
    layer = _http1.Http1Server(Context(client, tctx.options))
    out = b""
    for ev in (events.Start(), events.DataReceived(client, data)):
        for cmd in layer.handle_event(ev):
            if isinstance(cmd, commands.SendData):
                out += cmd.data
    return out


def _deny_shape(raw: bytes) -> tuple[int, dict]:
    from mitmproxy.net.http.http1 import read_response_head
    head, _, body = raw.partition(b"\r\n\r\n")
    resp = read_response_head(head.split(b"\r\n"))
    assert resp.headers["Content-Type"] == "application/json" and resp.headers["Connection"] == "close"
    doc = json.loads(body)
    assert doc["error"] == "refused_by_cubegate" and resp.headers["X-Cubegate-Reason"] == doc["reason"]
    assert int(resp.headers["Content-Length"]) == len(body)
    return resp.status_code, doc


def test_refusals_mitmproxy_sends_for_us_are_the_gates_deny_shape(parts):
    from egress import mitm_internals
    previous = mitm_internals.head_limit_installed()
    mitm_internals.install_trailer_refusal()
    mitm_internals.install_safe_error_pages()
    mitm_internals.install_head_limit(1024)
    try:
        async def scenario(tctx):
            trailers = _sent_by_http1_server(tctx, b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                                                   b"1\r\nx\r\n0\r\nX-T: " + LEAKED.encode() + b"\r\n\r\n")
            big = _sent_by_http1_server(tctx, b"GET / HTTP/1.1\r\nX: " + b"a" * 4000)
            garbage = _sent_by_http1_server(tctx, b"GET / HTTP/1.1\r\nBad Header " + LEAKED.encode() + b"\r\n\r\n")
            return trailers, big, garbage
        trailers, big, garbage = run(parts, scenario)
    finally:
        if previous:
            mitm_internals.install_head_limit(previous)
    assert _deny_shape(trailers)[0] == 400 and _deny_shape(trailers)[1]["reason"] == "trailers_refused"
    assert _deny_shape(big)[0] == 431 and _deny_shape(big)[1]["reason"] == "head_too_large"
    status, doc = _deny_shape(garbage)   # mitmproxy's own error answer, never quoting what was sent
    assert status == 400 and doc["reason"] == "relay_failed"
    assert all(LEAKED.encode() not in raw for raw in (trailers, big, garbage))


# ------------------------------------------------------------ consistency
def test_ssrf_refusal_at_server_connected_is_counted(parts):
    async def scenario(tctx):
        client, sd = await _server_hook(parts, tctx)
        sd.server.peername = ("10.1.2.3", 443)     # dialled a private address after all
        parts.gate.server_connected(sd)
        return parts.gate.conns[client.id]
    st = run(parts, scenario)
    assert st.denied_reason == "ssrf_private"
    assert parts.records()[-1]["reason"] == "ssrf_private"
    assert parts.counted("deny", "ssrf_private", "upstream") == 1


def test_upstream_failure_records_carry_their_status(parts):
    async def scenario(tctx):
        client, sd = await _server_hook(parts, tctx)
        sd.server.error = "Connection refused"
        parts.gate.server_connect_error(sd)
    run(parts, scenario)
    rec = parts.records()[-1]
    assert (rec["reason"], rec["status"]) == ("upstream_connect_failed", 502)


def test_invalid_host_is_400_as_a_policy_decision_too():
    from egress import records
    from egress.policy import Decision
    from egress.reasons import REASONS
    def decision(reason):
        return Decision(action="deny", reason=reason, rule=None, policy=None, mode="enforce", would_deny=False,
                        needs_inspection=False, tenant=None)
    assert records.policy_refusal(decision("invalid_host")).status == 400
    assert REASONS["invalid_host"].status == (400,)
    assert records.policy_refusal(decision("rule_deny")).status == 403


# ------------------------------------------------------------ a real failure in a running gateway
LAB_POLICY = """\
name: failclosed
default: deny
rules:
  - name: sink
    action: allow
    match: {hosts: [sink.allowed.test], ports: [443, 80]}
"""


@pytest.fixture(params=[False, True], ids=["mitmproxy", "fast_path"])
def broken_gw(request, lab, tmp_path):
    """A running gateway whose identity database loses its table under it (another process's
    migration gone wrong): every identity lookup raises sqlite3.OperationalError from then on."""
    import sqlite3

    from testbed.hostile import ensure_hostile
    from tests.gateway.harness import Gateway
    hostile = ensure_hostile(lab)
    gw = Gateway(lab, tmp_path / "gw", {"main.yaml": LAB_POLICY},
                 settings_extra={"proxy": {"fast_path": request.param}})
    gw.start()
    gw.hostile = hostile

    def break_identities():
        db = sqlite3.connect(gw.state_dir / "identities.db")
        try:
            db.execute("ALTER TABLE identities RENAME TO identities_gone")
            db.commit()
        finally:
            db.close()
    gw.break_identities = break_identities
    yield gw
    gw.stop()


@pytest.mark.netns
def test_a_failing_part_in_a_running_gateway_refuses_and_nothing_goes_upstream(broken_gw):
    import uuid
    gw = broken_gw
    ok = "fc-ok-" + uuid.uuid4().hex[:8]
    r = gw.curl(f"http://sink.allowed.test/{ok}")
    assert r.status == 200, r              # the lab works: the refusals below are the failure's
    assert len(gw.hostile.requests(ok)) == 1
    gw.break_identities()
    plain, tls = ("fc-" + uuid.uuid4().hex[:8] for _ in range(2))
    rp = gw.curl(f"http://sink.allowed.test/{plain}")
    rt = gw.curl(f"https://sink.allowed.test/{tls}", "--cacert", str(gw.lab.ca.bundle_path))
    fast = "fast_path" in os.environ.get("PYTEST_CURRENT_TEST", "")
    if fast:   # the fast path resets: it cannot know what it already wrote
        assert rp.status == 0 and rt.status == 0 and rt.connect_status == 0, (rp, rt)
    else:      # the gate answers before any byte went upstream
        assert rp.status == 503 and rp.json()["reason"] == "internal_error", rp
        assert rt.connect_status == 503, rt
    for marker in (plain, tls):
        assert gw.hostile.requests(marker) == [], "the upstream received a request the gateway failed to check"
    recs = [r for r in gw.audit_records() if r.get("reason") == "internal_error" and r.get("event") == "decision"]
    assert len(recs) >= 2, gw.audit_records()[-6:]
    assert {r["extra"]["error"] for r in recs} == {"OperationalError"}
    if not fast:
        assert {r["extra"]["hook"] for r in recs} == {"requestheaders", "http_connect"}
    code, metrics = gw.ops_status("/metrics")
    assert code == 200 and re.search(r'cubegate_decisions_total\{[^}]*reason="internal_error"[^}]*\} [2-9]', metrics)
    # the exception's text is in no record and no log line: only its class and where it was raised
    assert "no such table" not in (gw.audit_dir / "audit-current.jsonl").read_text()
    assert "no such table" not in gw.log_path.read_text(errors="replace")
    assert "OperationalError" in gw.log_path.read_text(errors="replace")


# ------------------------------------------------------------ the fast path's catch-alls
async def _fast_path(p: Parts):
    from egress.fastpath.server import FastPath
    fp = FastPath(gate=p.gate, master=None, listen_host="127.0.0.1", explicit_port=0, transparent_port=None,
                  idle_timeout=5.0)
    await fp.start()
    return fp, fp.listen_addrs()[0][1]


async def _exchange(port: int, first: bytes, then: bytes = b"", timeout: float = 5.0) -> bytes:
    """Send `first`, read the answer to it (if any), send `then`; everything read until the gateway closes."""
    import asyncio
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = b""
    try:
        writer.write(first)
        if then:
            out += await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
            writer.write(then)
        while True:
            try:
                data = await asyncio.wait_for(reader.read(65536), timeout)
            except ConnectionResetError:
                break
            if not data:
                break
            out += data
    finally:
        writer.close()
    return out


def _fast_failures(p: Parts) -> list[dict]:
    return [r for r in p.records() if r.get("reason") == "internal_error" and r.get("event") == "decision"]


def test_fast_path_connect_whose_identity_lookup_fails_is_reset_and_audited(parts, caplog):
    """server.py's catch-all: the identity store fails for real (its database closed)."""
    async def scenario(tctx):
        fp, port = await _fast_path(parts)
        try:
            parts.gate.identities.close()
            return await _exchange(port, f"CONNECT api.allowed.test:443 HTTP/1.1\r\nHost: api.allowed.test:443\r\n"
                                         f"Proxy-Authorization: {parts.auth()}\r\n\r\n".encode())
        finally:
            await fp.close_listeners()
    out = run(parts, scenario)
    assert out == b""                                   # reset: no 200, no tunnel
    recs = _fast_failures(parts)
    # refused at its first decision: one record, which also closes the connection (README, Audit)
    assert len(recs) == 1 and recs[0]["extra"] == {"error": "ProgrammingError", "kind": "denied", "requests": 0,
                                                   "closed": True}
    assert not [r for r in parts.records() if r["event"] == "connection_closed" and r["conn_id"] == recs[0]["conn_id"]]
    assert parts.counted("deny", "internal_error", "internal", sandbox="-") == 1
    assert "fast path: refusing connection" in caplog.text and "closed database" not in caplog.text


def test_fast_plain_path_protocol_callback_failure_is_reset_and_audited(parts, monkeypatch, caplog):
    """plain.py's catch-all: a bug in a protocol callback (data_received) of a plain-HTTP connection.
    asyncio alone would log it with its text and close without a record."""
    from egress.fastpath import plain

    def boom(self, data):
        raise Boom(f"failed on {LEAKED}")
    monkeypatch.setattr(plain._Discard, "feed", boom)   # the refused request's body, read after the 403

    async def scenario(tctx):
        fp, port = await _fast_path(parts)
        try:
            head = (f"POST http://denied.test/x HTTP/1.1\r\nHost: denied.test\r\nContent-Length: 5000\r\n"
                    f"Proxy-Authorization: {parts.auth()}\r\n\r\n").encode()
            return await _exchange(port, head, b"b" * 5000)
        finally:
            await fp.close_listeners()
    out = run(parts, scenario)
    assert out.startswith(b"HTTP/1.1 403") and b'"reason": "rule_deny"' in out
    recs = _fast_failures(parts)
    assert len(recs) == 1 and recs[0]["extra"] == {"error": "Boom"}, parts.records()
    assert parts.counted("deny", "internal_error", "internal") == 1
    assert LEAKED not in caplog.text and LEAKED not in (parts.audit_dir / "audit-current.jsonl").read_text()
    assert "Boom" in caplog.text
