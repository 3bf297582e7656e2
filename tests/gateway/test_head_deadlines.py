"""Every request head on an intercepted (mitmproxy) connection has header_timeout from its first byte,
not only the first one: a second keep-alive head trickled byte by byte inside a tunnel is refused
408 header_timeout and closed, like the fast plain path does (egress/fastpath/plain.py)."""
from __future__ import annotations

import ssl
import time

import pytest

from tests.gateway import rawclient
from tests.gateway.harness import Gateway

HEADER_TIMEOUT = 2.0
SLACK = 2.0
POLICY = """\
name: heads
default: deny
rules:
  - name: echo
    action: allow
    match: {hosts: [echo.allowed.test], ports: [443]}
  - name: echo-admin          # a path rule: the tunnel is intercepted, each request decided
    action: deny
    match: {hosts: [echo.allowed.test], paths: [/admin]}
"""


@pytest.fixture(scope="module")
def hgw(lab, tmp_path_factory):
    gw = Gateway(lab, tmp_path_factory.mktemp("heads"), {"p.yaml": POLICY}, sandboxes={"sb-1": {}},
                 settings_extra={"proxy": {"header_timeout": HEADER_TIMEOUT, "idle_timeout": 60}})
    gw.start()
    yield gw
    gw.stop()


def _second_head_trickled(gw) -> dict:
    s, head = rawclient.connect_tunnel(gw.proxy_port, "echo.allowed.test:443",
                                       rawclient.auth_header("sb-1", gw.tokens["sb-1"]))
    assert rawclient.connect_status(head) == 200, head
    ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
    ctx.set_alpn_protocols(["http/1.1"])
    out: dict = {}
    with ctx.wrap_socket(s, server_hostname="echo.allowed.test") as tls:
        tls.sendall(b"GET /first HTTP/1.1\r\nHost: echo.allowed.test\r\n\r\n")
        out["first"] = rawclient.read_head(tls)
        time.sleep(0.3)                      # whatever body the echo sends is read below
        tls.settimeout(0.5)
        second = b"GET /second HTTP/1.1\r\nHost: echo.allowed.test\r\nX-Pad: " + b"a" * 200 + b"\r\n\r\n"
        t0 = time.monotonic()
        got = b""
        for b in second[:-4]:               # never the blank line: the head stays open
            if time.monotonic() - t0 > HEADER_TIMEOUT + SLACK + 2:
                break
            try:
                tls.sendall(bytes([b]))
            except OSError:
                break
            try:
                data = tls.recv(65536)
            except (TimeoutError, ssl.SSLWantReadError):
                continue
            except (OSError, ssl.SSLError):
                out["reset"] = True
                break
            if not data:
                break
            got += data
            if b"X-Cubegate-Reason: header_timeout" in got or b"HTTP/1.1 408" in got:
                # the refusal: read to the close
                try:
                    while (data := tls.recv(65536)):
                        got += data
                except (OSError, ssl.SSLError):
                    pass
                break
        out["cut_after"] = time.monotonic() - t0
        out["second"] = got
    return out


def test_a_second_keepalive_head_trickled_in_a_tunnel_is_cut_at_header_timeout(hgw, lab):
    out = lab.call_gw(_second_head_trickled, hgw, timeout=60)
    assert out["first"].startswith(b"HTTP/1.1 200"), out["first"][:200]
    refusal = out["second"].split(b"HTTP/1.1 408", 1)
    assert len(refusal) == 2, out["second"][-400:]
    assert b"header_timeout" in refusal[1], refusal[1][:400]
    assert out["cut_after"] < HEADER_TIMEOUT + SLACK, out["cut_after"]
    assert out["cut_after"] >= HEADER_TIMEOUT - 0.3, out["cut_after"]   # its own head's deadline, not earlier
    rec = hgw.wait_record(lambda r: r.get("event") == "connection_closed" and r.get("reason") == "header_timeout")
    assert rec.get("sandbox") in ("sb-1", None) or rec.get("sandbox_id") == "sb-1", rec


def test_heads_that_arrive_whole_are_served_on_a_kept_alive_connection(hgw, lab):
    def run():
        s, head = rawclient.connect_tunnel(hgw.proxy_port, "echo.allowed.test:443",
                                           rawclient.auth_header("sb-1", hgw.tokens["sb-1"]))
        ctx = ssl.create_default_context(cafile=str(hgw.ca_cert))
        ctx.set_alpn_protocols(["http/1.1"])
        heads = []
        with ctx.wrap_socket(s, server_hostname="echo.allowed.test") as tls:
            for i in range(3):               # more than header_timeout of idle keep-alive between them
                if i:
                    time.sleep(HEADER_TIMEOUT + 0.5)
                tls.sendall(b"GET /n%d HTTP/1.1\r\nHost: echo.allowed.test\r\n\r\n" % i)
                heads.append(rawclient.read_head(tls))
                rawclient.recv_all(tls, 0.3)
        return heads

    heads = lab.call_gw(run, timeout=60)
    assert [h[:12] for h in heads] == [b"HTTP/1.1 200"] * 3, [h[:60] for h in heads]


def _h2_second_head_trickled(gw) -> dict:
    """h2 in the tunnel: stream 1 answered, then stream 3's HEADERS (no END_HEADERS) and its
    CONTINUATION frames one header-block byte at a time: GOAWAY and closed at the deadline."""
    import h2.config
    import h2.connection
    import h2.events
    from hyperframe.frame import ContinuationFrame, HeadersFrame

    s, head = rawclient.connect_tunnel(gw.proxy_port, "echo.allowed.test:443",
                                       rawclient.auth_header("sb-1", gw.tokens["sb-1"]))
    assert rawclient.connect_status(head) == 200, head
    ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
    ctx.set_alpn_protocols(["h2"])
    out: dict = {"events": []}
    with ctx.wrap_socket(s, server_hostname="echo.allowed.test") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        hdrs = [(":method", "GET"), (":scheme", "https"), (":authority", "echo.allowed.test")]
        conn.send_headers(1, [*hdrs, (":path", "/first")], end_stream=True)
        tls.sendall(conn.data_to_send())
        tls.settimeout(5)
        ended = False
        while not ended:
            data = tls.recv(65536)
            assert data, "closed before the first answer"
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    out["first"] = dict(ev.headers).get(":status")
                ended = ended or isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset))
            tls.sendall(conn.data_to_send())
        block = conn.encoder.encode([*hdrs, (":path", "/second"), ("x-pad", "a" * 200)])
        tls.sendall(HeadersFrame(3, data=block[:1], flags=["END_STREAM"]).serialize())
        tls.settimeout(0.5)
        t0 = time.monotonic()
        for i in range(1, len(block) - 1):          # never the last byte (END_HEADERS)
            if time.monotonic() - t0 > HEADER_TIMEOUT + SLACK + 2:
                break
            try:
                tls.sendall(ContinuationFrame(3, data=block[i:i + 1]).serialize())
            except OSError:
                break
            try:
                data = tls.recv(65536)
            except (TimeoutError, ssl.SSLWantReadError):
                continue
            except (OSError, ssl.SSLError):
                break
            if not data:
                break
            try:
                out["events"] += [type(ev).__name__ for ev in conn.receive_data(data)]
            except Exception as e:      # noqa: BLE001 - the test only records what came
                out["events"].append(type(e).__name__)
            if "ConnectionTerminated" in out["events"]:
                break
        out["cut_after"] = time.monotonic() - t0
    return out


def _timed_out(gw) -> int:
    return sum(1 for r in gw.audit_records()
               if r.get("event") == "connection_closed" and r.get("reason") == "header_timeout")


def test_a_second_h2_head_trickled_in_continuations_is_cut_at_header_timeout(hgw, lab):
    before = _timed_out(hgw)
    out = lab.call_gw(_h2_second_head_trickled, hgw, timeout=60)
    assert out.get("first") == "200", out
    assert "ConnectionTerminated" in out["events"], out
    assert HEADER_TIMEOUT - 0.3 <= out["cut_after"] < HEADER_TIMEOUT + SLACK, out["cut_after"]
    deadline = time.monotonic() + 5
    while _timed_out(hgw) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _timed_out(hgw) == before + 1
