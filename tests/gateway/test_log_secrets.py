"""No log line the daemon writes holds an injected secret, at any log level.

The hostile upstream (testbed/hostile.py) hands the injected key back in every shape
(echoed request, response headers, an invalid header name, a 103) over HTTP/1.1 and
HTTP/2; the gateway runs at DEBUG so every library logger under it speaks (hpack logs
each header it adds to its table, name and value). Then every log the daemon wrote is
scanned for the key in every recoverable form."""
from __future__ import annotations

import time

import pytest

from testbed.hostile import ensure_hostile
from tests.gateway.harness import Gateway
from tests.gateway.hostile_env import H, KEY_A, found_forms, new_marker

pytestmark = pytest.mark.netns

POLICY = """\
name: logs
tenant: acme
default: deny
rules:
  - name: hostile
    action: allow
    match: {hosts: [hostile.allowed.test], ports: [443]}
"""


@pytest.fixture(scope="module")
def dgw(lab, tmp_path_factory):
    ensure_hostile(lab)
    gw = Gateway(lab, tmp_path_factory.mktemp("logs"), {"logs.yaml": POLICY})
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "hkey", input=KEY_A + "\n")
    gw.cli("vault", "binding", "add", "--id", "b-hostile", "--tenant", "acme", "--secret", "hkey",
           "--host", H, "--port", "443", "--header", "Authorization", "--format", "Bearer {secret}")
    gw.start(log_level="DEBUG")
    yield gw
    gw.stop()


def _every_log(gw) -> bytes:
    """The daemon's stderr/stdout log and any *.log file it wrote under its state dir."""
    out = gw.log_path.read_bytes()
    for f in sorted(gw.state_dir.rglob("*.log")):
        out += f.read_bytes()
    return out


@pytest.mark.parametrize("proto", ["--http1.1", "--http2"])
@pytest.mark.parametrize("route", ["echo", "header", "badname", "early-hints"])
def test_debug_log_never_holds_the_injected_key(dgw, proto, route):
    marker = new_marker("lg")
    r = dgw.curl(f"https://{H}/{route}/{marker}", proto, "--cacert", str(dgw.ca_cert), timeout=5)
    assert r.connect_status == 200 and r.status, r   # through the tunnel; whatever the upstream made of it
    if route == "echo":
        assert r.status == 200 and "[REDACTED]" in r.body, r   # the key was injected (and scrubbed)
    time.sleep(0.3)   # the gateway logs asynchronously
    log = _every_log(dgw)
    assert b"DEBUG" in log, "the gateway did not log at DEBUG: the test proves nothing"
    hits = found_forms(log, KEY_A)
    assert not hits and KEY_A[:8].encode() not in log, f"the daemon log holds the key ({hits}, {route} {proto})"
