"""While a response is pending, mitmproxy's Http1Server appends every byte the sandbox sends
to its buffer (its `wait` state only parses them later): a sandbox that pipelines without end
behind a slow request would grow the gateway without bound. The buffer is capped; past it the
connection is closed."""
from __future__ import annotations

import ssl
import time

import pytest

from tests.gateway import rawclient
from tests.gateway.harness import Gateway

POLICY = """\
name: pipelined
default: deny
rules:
  - name: echo
    action: allow
    match: {hosts: [echo.allowed.test], ports: [443]}
  - name: echo-admin          # a path rule: the tunnel is intercepted, each request decided
    action: deny
    match: {hosts: [echo.allowed.test], paths: [/admin]}
"""
SENT_MAX = 48 << 20          # what the sandbox tries to pipeline behind the slow request
CUT_BY = 8 << 20             # the gateway must have closed long before this


@pytest.fixture(scope="module")
def pgw(lab, tmp_path_factory):
    gw = Gateway(lab, tmp_path_factory.mktemp("pipelined"), {"p.yaml": POLICY}, sandboxes={"sb-1": {}},
                 settings_extra={"proxy": {"idle_timeout": 60}})
    gw.start()
    yield gw
    gw.stop()


def _pipeline_behind_a_slow_request(pgw) -> int:
    s, head = rawclient.connect_tunnel(pgw.proxy_port, "echo.allowed.test:443",
                                       rawclient.auth_header("sb-1", pgw.tokens["sb-1"]))
    assert rawclient.connect_status(head) == 200, head
    ctx = ssl.create_default_context(cafile=str(pgw.ca_cert))
    ctx.set_alpn_protocols(["http/1.1"])
    sent = 0
    with ctx.wrap_socket(s, server_hostname="echo.allowed.test") as tls:
        tls.sendall(b"GET /slow?ms=8000 HTTP/1.1\r\nHost: echo.allowed.test\r\n\r\n")
        time.sleep(0.3)                       # the request is upstream: the server side waits
        tls.settimeout(3)
        chunk = b"x" * 65536                 # never a complete head: only buffered
        t0 = time.monotonic()
        try:
            while sent < SENT_MAX and time.monotonic() - t0 < 20:
                tls.sendall(chunk)
                sent += len(chunk)
        except (OSError, ssl.SSLError):
            pass
    return sent


def test_bytes_pipelined_behind_a_pending_response_are_bounded(pgw, lab):
    sent = lab.call_gw(_pipeline_behind_a_slow_request, pgw, timeout=60)
    assert sent < CUT_BY, f"the gateway took {sent} pipelined bytes behind a pending response"
