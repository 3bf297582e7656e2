"""While a hook of the mitmproxy path waits (here requestheaders on a DNS answer the lab holds back),
the gateway stops reading that client past egress.gate.HOOK_QUEUE_BYTES instead of queueing all it
sends: memory stays bounded, the request is then handled as it would have been, other connections
are served meanwhile."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.gateway import rawclient
from tests.gateway.harness import Gateway
from tests.gateway.test_exhaustion import RssWatch

DELAY = 1.6                  # the held name's DNS answer (under the resolver's 2 s per try)
BODY = 64 << 20              # sent in full, as fast as the gateway takes it (the upstream takes 64 MiB)
RSS_BOUND = 24 << 20         # the gateway's growth while the hook waits (unbounded: the whole body)
SENT_BOUND = 16 << 20        # what the sandbox gets in while the hook waits (the bound + socket buffers)
POLICY = """\
name: hookq
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [api.allowed.test, held.allowed.test], ports: [80, 443]}
"""


@pytest.fixture(scope="module")
def qgw(lab, tmp_path_factory):
    lab.set_zone("held.allowed.test", {"addrs": [lab.hosts["api.allowed.test"]], "ttl": 0, "delay": DELAY})
    gw = Gateway(lab, tmp_path_factory.mktemp("hookq"), {"p.yaml": POLICY}, sandboxes={"sb-1": {}},
                 settings_extra={"proxy": {"fast_plain_http": False}})   # plain HTTP: the mitmproxy path
    gw.start()
    yield gw
    gw.stop()
    lab.set_zone("held.allowed.test", None)


def _post(gw, host: str, during=None) -> dict:
    """A POST of BODY bytes; how much of it got in during the first DELAY * 0.75 s, and the answer."""
    head = (f"POST http://{host}/upload HTTP/1.1\r\nHost: {host}\r\nContent-Length: {BODY}\r\n"
            f"{rawclient.auth_header('sb-1', gw.tokens['sb-1'])}\r\nConnection: close\r\n\r\n").encode()
    out = {"sent": 0}
    s = socket.create_connection(("127.0.0.1", gw.proxy_port), timeout=20)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)

    def send():
        block = b"a" * 65536
        try:
            s.sendall(head)
            while out["sent"] < BODY:
                s.sendall(block)
                out["sent"] += len(block)
        except OSError as e:
            out["send_error"] = type(e).__name__

    t = threading.Thread(target=send, daemon=True)
    t0 = time.monotonic()
    t.start()
    if during is not None:
        out["during"] = during()
    time.sleep(max(0.0, DELAY * 0.75 - (time.monotonic() - t0)))
    out["sent_while_held"] = out["sent"]
    t.join(30)
    out["answer"] = rawclient.read_head(s)
    s.close()
    return out


def test_a_client_is_not_read_past_the_bound_while_its_hook_waits(qgw, lab):
    ref = lab.call_gw(_post, qgw, "api.allowed.test", timeout=90)        # not held: the answer to expect
    assert ref["answer"].startswith(b"HTTP/1.1 "), ref

    def other():                                       # another connection, served meanwhile
        r = rawclient.send_raw(qgw.proxy_port, (
            f"GET http://api.allowed.test/other HTTP/1.1\r\nHost: api.allowed.test\r\n"
            f"{rawclient.auth_header('sb-1', qgw.tokens['sb-1'])}\r\nConnection: close\r\n\r\n").encode(), 3)
        return r[:12]

    with RssWatch(qgw, RSS_BOUND) as watch:
        held = lab.call_gw(_post, qgw, "held.allowed.test", other, timeout=90)
    assert held["during"] == b"HTTP/1.1 200", held["during"]
    assert watch.growth <= RSS_BOUND, f"the gateway grew by {watch.growth >> 20} MiB"
    assert held["sent_while_held"] <= SENT_BOUND, f"{held['sent_while_held'] >> 20} MiB got in while the hook waited"
    assert held["answer"].split(b"\r\n", 1)[0] == ref["answer"].split(b"\r\n", 1)[0], (held, ref)
    assert held["sent"] == ref["sent"], (held["sent"], ref["sent"])   # the connection was not stalled
