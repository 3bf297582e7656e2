"""An upstream that sends endless 1xx heads before its answer is refused after a bounded
number of them, on the fast plain path (HTTP/1.1 on :80) and on mitmproxy's path (an
intercepted host, HTTP/1.1 and HTTP/2 to the upstream) — not only when upstream_timeout
runs out. The flood upstream is testbed/informational_flood.py (5000 x 103, then 200)."""
from __future__ import annotations

import re

import pytest

from testbed.hostile import ensure_in_lab
from tests.gateway import rawclient
from tests.gateway.harness import Gateway

pytestmark = pytest.mark.netns

FLOOD_HOST, FLOOD_IP = "flood.allowed.test", "198.18.0.59"
FLOODED = 5000
BOUND = 32              # egress: at most this many 1xx heads before one response

POLICY = """\
name: flood
tenant: acme
default: deny
rules:
  - name: flood
    action: allow
    match: {hosts: [flood.allowed.test], ports: [80, 443]}
"""


@pytest.fixture(scope="module")
def fgw(lab, tmp_path_factory):
    ensure_in_lab(lab, "_informational_flood", {FLOOD_HOST: FLOOD_IP}, "testbed.informational_flood",
                  ["--bind", FLOOD_IP, "--count", str(FLOODED)])
    gw = Gateway(lab, tmp_path_factory.mktemp("flood"), {"flood.yaml": POLICY})
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "k", input="flood-key-0a1b2c3d4e\n")
    gw.cli("vault", "binding", "add", "--id", "b-flood", "--tenant", "acme", "--secret", "k",
           "--host", FLOOD_HOST, "--port", "443", "--header", "X-Api-Key", "--format", "{secret}")  # intercepted
    gw.start()
    yield gw
    gw.stop()


def test_plain_http_1xx_flood_is_cut_after_a_bound(fgw, lab):
    auth = rawclient.auth_header("sb-1", fgw.tokens["sb-1"])
    req = (f"GET http://{FLOOD_HOST}/x HTTP/1.1\r\nHost: {FLOOD_HOST}\r\n{auth}\r\n"
           "Connection: close\r\n\r\n").encode()
    wire = lab.call_gw(rawclient.send_raw, fgw.proxy_port, req, 10)
    heads = re.findall(rb"HTTP/1\.1 (\d{3}) ", wire)
    informational = [h for h in heads if h.startswith(b"1")]
    assert heads, wire[:300]
    assert len(informational) <= BOUND, f"{len(informational)} 1xx heads reached the sandbox"
    assert heads[-1] == b"502" and b"X-Cubegate-Reason: upstream_invalid_response" in wire, wire[-400:]
    fgw.wait_record(lambda r: r.get("reason") == "upstream_invalid_response" and r.get("host") == FLOOD_HOST
                    and "informational" in str(r.get("extra", {}).get("error", "")))


def _intercepted(fgw, proto: str, path: str):
    r = fgw.curl(f"https://{FLOOD_HOST}{path}", proto, "--cacert", str(fgw.ca_cert), "-D", "-", timeout=5)
    heads = re.findall(r"^HTTP/[\d.]+ (\d{3})", r.body, re.M)[1:]    # after the CONNECT's 200
    return r, heads


@pytest.mark.parametrize("proto", ["--http1.1", "--http2"])
def test_intercepted_1xx_flood_is_refused(fgw, proto):
    r, heads = _intercepted(fgw, proto, "/y")
    assert heads[-1:] == ["502"] and "x-cubegate-reason: relay_failed" in r.body.lower(), r
    assert "final" not in r.body, f"the answer behind {FLOODED} 1xx heads reached the sandbox: {r}"


@pytest.mark.parametrize("proto", ["--http1.1", "--http2"])
def test_intercepted_few_1xx_then_the_answer_arrives(fgw, proto):
    # mitmproxy's HTTP/1 took the first 1xx for the answer: the sandbox got a 103 and waited
    r, heads = _intercepted(fgw, proto, "/z?n=3")
    assert heads == ["200"] and r.body.endswith("final\n"), r    # 1xx are swallowed, as over HTTP/2
