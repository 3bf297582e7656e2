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
                tls.sendall(b"GET /n%d HTTP/1.1\r\nHost: echo.allowed.test\r\n\r\n" % i)
                heads.append(rawclient.read_head(tls))
                rawclient.recv_all(tls, 0.3)
                time.sleep(HEADER_TIMEOUT + 0.5)
        return heads

    heads = lab.call_gw(run, timeout=60)
    assert [h[:12] for h in heads] == [b"HTTP/1.1 200"] * 3, [h[:60] for h in heads]
