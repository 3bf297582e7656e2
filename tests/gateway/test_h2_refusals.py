"""Over HTTP/2 every refusal has one shape: the gate's own deny (policy) and the engine's
error answer (upstream failed) carry the same headers — X-Cubegate-Reason, a JSON
Content-Type — and nothing of mitmproxy's (no Server: mitmproxy, no text/html).
A real HTTP/2 client (curl --http2) through the explicit proxy, MITM'd hosts."""
from __future__ import annotations

import json

import pytest

from tests.gateway.harness import Gateway

pytestmark = pytest.mark.netns

DEAD_HOST, DEAD_IP = "dead.allowed.test", "198.18.0.58"   # an address with nothing listening
SECRET = "h2-refusal-key-3c5e7a9b"

POLICY = """\
name: h2
tenant: acme
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [echo.allowed.test, dead.allowed.test], ports: [443]}
  - name: no-admin
    action: deny
    match: {hosts: [echo.allowed.test], paths: [/admin]}
"""


@pytest.fixture(scope="module")
def hgw(lab, tmp_path_factory):
    lab.add_host(DEAD_HOST, DEAD_IP)
    gw = Gateway(lab, tmp_path_factory.mktemp("h2r"), {"h2.yaml": POLICY})
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "k", input=SECRET + "\n")
    for bid, host in (("b-echo", "echo.allowed.test"), ("b-dead", DEAD_HOST)):   # bound: intercepted
        gw.cli("vault", "binding", "add", "--id", bid, "--tenant", "acme", "--secret", "k",
               "--host", host, "--port", "443", "--header", "X-Api-Key", "--format", "{secret}")
    gw.start()
    yield gw
    gw.stop()


def _h2_answer(gw, url: str) -> tuple[str, int, dict[str, list[str]], dict]:
    r = gw.lab.curl("-x", gw.proxy_url(), "--http2", "--cacert", str(gw.ca_cert), "-s", "-D", "-",
                    "-o", "/dev/stdout", url, cacert=False, lab_dns=False, timeout=10)
    head, _, body = r.stdout.replace("\r\n", "\n").rpartition("\n\n")
    blocks = [b for b in head.split("\n\n") if b.strip()]
    lines = blocks[-1].splitlines()        # the last head: the CONNECT answer comes first
    version, status = lines[0].split()[:2]
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers.setdefault(k.strip().lower(), []).append(v.strip())
    return version, int(status), headers, json.loads(body)


def test_engine_error_answer_over_h2_is_our_deny_shape(hgw):
    version, status, headers, body = _h2_answer(hgw, f"https://{DEAD_HOST}/x")
    assert version == "HTTP/2" and status == 502, (version, status, headers)
    assert headers.get("x-cubegate-reason") == ["relay_failed"], headers
    assert headers.get("content-type") == ["application/json"], headers
    assert "server" not in headers, headers
    assert body["error"] == "refused_by_cubegate" and body["reason"] == "relay_failed", body


def test_h2_refusals_share_one_header_set(hgw):
    _, ps, policy_headers, _ = _h2_answer(hgw, "https://echo.allowed.test/admin")
    _, es, engine_headers, _ = _h2_answer(hgw, f"https://{DEAD_HOST}/y")
    assert (ps, es) == (403, 502)
    names = lambda h: sorted(set(h) - {"content-length", "date"})   # noqa: E731
    assert names(engine_headers) == names(policy_headers), (engine_headers, policy_headers)
