"""A connection whose only refusal was counted (past its source's budget, egress.refusal_budget)
skips its connection_closed record: the count stands for it. That must hold only for a
connection refused at its first decision: one that carried an allowed request first (its bytes
are in connection_closed alone) keeps its record, however its last request was refused."""
from __future__ import annotations

import socket
import time

import pytest

from tests.gateway import rawclient
from tests.gateway.harness import Gateway

POLICY = """\
name: counted
default: deny
rules:
  - name: api
    action: allow
    match: {hosts: [api.allowed.test], ports: [80]}
"""


@pytest.fixture(scope="module")
def cgw(lab, tmp_path_factory):
    gw = Gateway(lab, tmp_path_factory.mktemp("counted"), {"p.yaml": POLICY}, sandboxes={"sb-1": {}},
                 settings_extra={"audit": {"refusals_written_per_interval": 0}})   # every refusal counted
    gw.start()
    yield gw
    gw.stop()


def test_an_allowed_request_then_a_counted_refusal_keeps_connection_closed(cgw, lab):
    auth = rawclient.auth_header("sb-1", cgw.tokens["sb-1"])

    def run() -> bytes:
        s = socket.create_connection(("127.0.0.1", cgw.proxy_port), timeout=5)
        # the second, pipelined behind a slow first: one the fast path hands to mitmproxy (HTTP/1.0),
        # too long to replay by the time it is reached: refused pipelined_request_refused, counted
        s.sendall(f"GET http://api.allowed.test/slow?ms=800 HTTP/1.1\r\nHost: api.allowed.test\r\n{auth}\r\n\r\n"
                  f"POST http://api.allowed.test/r6-second HTTP/1.0\r\nHost: api.allowed.test\r\n{auth}\r\n"
                  f"Content-Length: 400000\r\n\r\n".encode() + b"x" * 400000)
        first = rawclient.read_head(s)
        rawclient.recv_all(s, 1.5)
        s.close()
        return first

    first = lab.call_gw(run, timeout=30)
    assert first.startswith(b"HTTP/1.1 200"), first[:200]
    req = cgw.wait_record(lambda r: r.get("event") == "request" and r.get("path") == "/slow")
    closed = cgw.wait_record(lambda r: r.get("event") == "connection_closed" and r.get("conn_id") == req["conn_id"],
                             timeout=5.0)
    assert closed["sandbox"] == "sb-1", closed
