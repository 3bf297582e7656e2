"""The fast path in a real gateway: what it answers itself, what it relays, what it hands over.

Every other gateway test runs against it too (proxy.fast_path is on by default; set
CUBEGATE_PROXY__FAST_PATH=false to run them against mitmproxy alone).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import struct
import threading
import time

import pytest

from tests.faults.helpers import eventually, proc_rss_kib
from tests.gateway import rawclient
from tests.gateway.conftest import MAIN_POLICY
from tests.gateway.harness import Gateway

pytestmark = pytest.mark.netns

IDLE_TIMEOUT = 2

# CUBEGATE_PROXY__FAST_PATH=false runs the whole suite against mitmproxy alone (settings from the
# environment win over the file): the tests below that look at the fast path itself are skipped then.
FAST_PATH_OFF = os.environ.get("CUBEGATE_PROXY__FAST_PATH", "").lower() in ("false", "0", "no")
fast_path_only = pytest.mark.skipif(FAST_PATH_OFF, reason="proxy.fast_path switched off from the environment")


@pytest.fixture(scope="module")
def fgw(lab, tmp_path_factory):
    gw = Gateway(lab, tmp_path_factory.mktemp("fastgw"), {"main.yaml": MAIN_POLICY},
                 settings_extra={"proxy": {"idle_timeout": IDLE_TIMEOUT, "fast_path": True}})
    gw.start()
    yield gw
    gw.stop()


def _auth(gw, sb="sb-1"):
    return rawclient.auth_header(sb, gw.tokens[sb])


def _fast_outcomes(gw) -> dict[str, float]:
    code, body = gw.ops_status("/metrics")
    assert code == 200
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^cubegate_fast_path_connections_total\{outcome="(\w+)"\} (\S+)$', body, re.M)}


def _active(gw) -> float:
    _, body = gw.ops_status("/metrics")
    return float(re.search(r"^cubegate_active_connections (\S+)$", body, re.M).group(1))


class Tunnel:
    """CONNECT + TLS over a memory BIO: every raw byte in and out is counted by the test."""

    def __init__(self, port: int, target: str, auth: str, sni: str, cafile: str, timeout: float = 5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n\r\n".encode()
        self.sock.sendall(head)
        self.sent, self.received = len(head), 0
        answer = rawclient.read_head(self.sock)
        self.status = rawclient.connect_status(answer)
        self.extra = answer.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in answer else b""
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        if self.extra:
            self.received += len(self.extra)
            self.inc.write(self.extra)
        ctx = ssl.create_default_context(cafile=cafile)
        self.tls = ctx.wrap_bio(self.inc, self.out, server_hostname=sni)

    def _flush(self) -> None:
        data = self.out.read()
        if data:
            self.sock.sendall(data)
            self.sent += len(data)

    def _pull(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            self.inc.write_eof()
            return False
        self.received += len(data)
        self.inc.write(data)
        return True

    def handshake(self) -> None:
        while True:
            try:
                self.tls.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
                if not self._pull():
                    raise ConnectionError("EOF during the handshake")

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    def read_all(self, limit: int = 1 << 26) -> bytes:
        out = b""
        while len(out) < limit:
            try:
                chunk = self.tls.read(65536)
                if not chunk:
                    break
                out += chunk
            except ssl.SSLWantReadError:
                if not self._pull():
                    break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break
        return out

    def close_notify_and_close(self) -> None:
        try:
            self.tls.unwrap()
        except ssl.SSLError:
            pass
        self._flush()
        self.sock.close()


def _closed_record(gw, **match) -> dict:
    return gw.wait_record(lambda r: r["event"] == "connection_closed" and all(r.get(k) == v for k, v in match.items()))


# ---------------------------------------------------------------------- deny
@fast_path_only
def test_deny_at_connect_is_answered_by_the_fast_path_not_mitmproxy(fgw, lab):
    before = _fast_outcomes(fgw)
    s, head = lab.call_gw(rawclient.connect_tunnel, fgw.proxy_port, "denied.test:443", _auth(fgw))
    s.close()
    assert rawclient.connect_status(head) == 403 and b"X-Cubegate-Reason: " in head, head
    after = _fast_outcomes(fgw)
    assert after.get("refused", 0) == before.get("refused", 0) + 1
    assert after.get("handed_over", 0) == before.get("handed_over", 0)    # mitmproxy never saw it
    rec = fgw.wait_record(lambda r: r["event"] == "decision" and r.get("host") == "denied.test")
    # one record for a connection refused at its first decision: the decision carries the close
    assert rec["decision"] == "deny" and rec["reason"] in ("default_deny", "rule_deny") and rec["status"] == 403
    assert rec["extra"] == {"kind": "denied", "requests": 0, "closed": True}, rec
    assert rec["bytes_in"] == 0 and rec["bytes_out"] > len("CONNECT denied.test:443 HTTP/1.1\r\n\r\n")
    assert rec["duration_ms"] >= 0 and rec["method"] == "CONNECT"
    time.sleep(0.3)                      # a connection_closed record would be written by now
    assert [r["event"] for r in fgw.audit_records() if r.get("conn_id") == rec["conn_id"]] == ["decision"]


def test_missing_credentials_get_407_from_the_fast_path(fgw, lab):
    out = lab.call_gw(rawclient.send_raw, fgw.proxy_port, b"CONNECT api.allowed.test:443 HTTP/1.1\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 407 ") and b'Proxy-Authenticate: Basic realm="cubegate"' in out, out


# --------------------------------------------------------------- passthrough
@fast_path_only
def test_passthrough_is_relayed_with_exact_byte_counts_in_the_audit(fgw, lab):
    before = _fast_outcomes(fgw)

    def go():
        t = Tunnel(fgw.proxy_port, "passthrough.allowed.test:443", _auth(fgw), "passthrough.allowed.test",
                   str(lab.ca.bundle_path))
        assert t.status == 200
        t.handshake()
        t.send(b"GET /bytes?n=300000 HTTP/1.1\r\nHost: passthrough.allowed.test\r\nConnection: close\r\n\r\n")
        body = t.read_all()
        t.close_notify_and_close()
        return t.sent, t.received, body

    sent, received, body = lab.call_gw(go)
    assert body.endswith(b"x" * 300000), body[:200]
    assert _fast_outcomes(fgw).get("relayed", 0) == before.get("relayed", 0) + 1
    closed = fgw.wait_record(lambda r: r["event"] == "connection_closed" and r.get("bytes_in") == received)
    assert closed["bytes_out"] == sent, (closed, sent)           # CONNECT head included, as the gate counts
    assert closed["extra"]["kind"] == "passthrough" and closed["upstream"] == "198.18.0.11:443"
    assert [r["event"] for r in fgw.audit_records() if r.get("conn_id") == closed["conn_id"]] == \
        ["decision", "connection_closed"]


@fast_path_only
def test_half_closed_client_still_gets_its_answer(fgw, lab):
    # (mitmproxy alone closes a passthrough tunnel when the client half-closes it)
    def go():
        t = Tunnel(fgw.proxy_port, "passthrough.allowed.test:443", _auth(fgw), "passthrough.allowed.test",
                   str(lab.ca.bundle_path))
        t.handshake()
        t.send(b"GET /half HTTP/1.1\r\nHost: passthrough.allowed.test\r\nConnection: close\r\n\r\n")
        t.sock.shutdown(socket.SHUT_WR)     # no more from us; the answer must still come back
        body = t.read_all()
        t.sock.close()
        return body

    body = lab.call_gw(go)
    assert b'"path": "/half"' in body, body[-300:]


def test_aborted_client_mid_transfer_is_closed_and_recorded(fgw, lab):
    def go():
        t = Tunnel(fgw.proxy_port, "passthrough.allowed.test:443", _auth(fgw), "passthrough.allowed.test",
                   str(lab.ca.bundle_path))
        t.handshake()
        t.send(b"GET /bytes?n=50000000 HTTP/1.1\r\nHost: passthrough.allowed.test\r\n\r\n")
        t._pull()
        t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        t.sock.close()                      # RST
        return t.sent

    sent = lab.call_gw(go)
    closed = fgw.wait_record(lambda r: r["event"] == "connection_closed" and r.get("bytes_out") == sent
                             and r.get("extra", {}).get("kind") == "passthrough", timeout=10)
    assert closed["bytes_in"] < 50_000_000
    assert eventually(lambda: _active(fgw) == 0, timeout=10), "the upstream side was not closed"


def test_a_client_that_does_not_read_does_not_grow_the_gateway(fgw, lab):
    pid = fgw.proc.pid
    rss0 = proc_rss_kib(pid)

    def go():
        t = Tunnel(fgw.proxy_port, "passthrough.allowed.test:443", _auth(fgw), "passthrough.allowed.test",
                   str(lab.ca.bundle_path))
        t.handshake()
        t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        t.send(b"GET /bytes?n=200000000 HTTP/1.1\r\nHost: passthrough.allowed.test\r\n\r\n")
        time.sleep(1.5)                     # read nothing: the upstream keeps sending
        rss = proc_rss_kib(pid)
        t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        t.sock.close()
        return rss

    rss1 = lab.call_gw(go)
    assert rss1 - rss0 < 16 * 1024, f"gateway RSS grew {rss1 - rss0} KiB for one stalled reader"


def test_idle_tunnel_is_closed_after_idle_timeout(fgw, lab):
    def go():
        t = Tunnel(fgw.proxy_port, "passthrough.allowed.test:443", _auth(fgw), "passthrough.allowed.test",
                   str(lab.ca.bundle_path))
        t.handshake()
        t.sock.settimeout(IDLE_TIMEOUT * 4 + 5)
        last = time.monotonic()
        try:
            while t.sock.recv(65536):       # session tickets come after the handshake: then silence
                last = time.monotonic()
            data = b""
        except ConnectionResetError:
            data = b""
        except socket.timeout:
            data = b"(still open)"
        waited = time.monotonic() - last
        t.sock.close()
        return data, waited

    data, waited = lab.call_gw(go)
    assert data == b"" and IDLE_TIMEOUT * 0.9 <= waited <= IDLE_TIMEOUT + 1.0, (data, waited)


# ----------------------------------------------------------------- hand-over
@fast_path_only
def test_flows_with_path_rules_are_handed_to_mitmproxy_and_decided_once(fgw, lab):
    """echo.allowed.test has a path rule: the CONNECT is replayed to mitmproxy; one decision, by the gate."""
    n0 = len(fgw.audit_records())
    before = _fast_outcomes(fgw)
    r = fgw.curl("https://echo.allowed.test/admin", "--cacert", str(fgw.ca_cert))
    assert r.status == 403 and r.connect_status == 200, r
    assert _fast_outcomes(fgw).get("handed_over", 0) == before.get("handed_over", 0) + 1
    fgw.wait_record(lambda r: r["event"] == "connection_closed" and r.get("host") == "echo.allowed.test")
    new = [x for x in fgw.audit_records()[n0:] if x.get("host") == "echo.allowed.test"]
    assert [x["event"] for x in new] == ["decision", "request", "connection_closed"], new
    assert len({x["conn_id"] for x in new}) == 1


@fast_path_only
@pytest.mark.skipif(os.environ.get("CUBEGATE_PROXY__FAST_PLAIN_HTTP", "").lower() in ("false", "0", "no"),
                    reason="proxy.fast_plain_http switched off from the environment")
def test_plain_http_is_decided_by_the_fast_path(fgw, lab):
    # proxy.fast_plain_http (on by default): egress/fastpath/plain.py; tests/gateway/test_fast_plain.py has the rest
    before = _fast_outcomes(fgw)
    r = fgw.curl("http://api.allowed.test/plain")
    assert r.status == 200 and r.json()["path"] == "/plain", r
    after = _fast_outcomes(fgw)
    assert after.get("plain_http", 0) == before.get("plain_http", 0) + 1
    assert after.get("handed_over", 0) == before.get("handed_over", 0)


# ---------------------------------------------------------------------- drain
def test_sigterm_drains_open_tunnels_and_refuses_new_ones(lab, tmp_path):
    gw = Gateway(lab, tmp_path / "draingw", {"main.yaml": MAIN_POLICY},
                 settings_extra={"proxy": {"drain_seconds": 4}})
    gw.start()
    try:
        out: dict = {}
        ready = threading.Event()

        def client():
            t = Tunnel(gw.proxy_port, "passthrough.allowed.test:443", _auth(gw), "passthrough.allowed.test",
                       str(lab.ca.bundle_path))
            t.handshake()
            ready.set()
            time.sleep(1.0)                 # SIGTERM arrives meanwhile
            t.send(b"GET /during-drain HTTP/1.1\r\nHost: passthrough.allowed.test\r\nConnection: close\r\n\r\n")
            out["body"] = t.read_all()
            t.sock.close()

        th = threading.Thread(target=lambda: lab.call_gw(client))
        th.start()
        assert ready.wait(10)
        gw.proc.send_signal(signal.SIGTERM)

        def refused_soon() -> bool:      # the listeners close once the signal is handled (under load: later)
            deadline = time.monotonic() + 2.5    # well inside drain_seconds (4) and the tunnel's 1 s wait
            while time.monotonic() < deadline:
                if _connect_refused(gw.proxy_port):
                    return True
                time.sleep(0.1)
            return False
        refused = lab.call_gw(refused_soon)
        th.join(15)
        assert refused, "a new connection was accepted during the drain"
        assert b'"path": "/during-drain"' in out.get("body", b""), out
        gw.proc.wait(15)
        assert any(r["event"] == "connection_closed" and r.get("extra", {}).get("kind") == "passthrough"
                   for r in gw.audit_records())
    finally:
        gw.stop()


def _connect_refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True
