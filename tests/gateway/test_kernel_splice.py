"""proxy.kernel_splice=auto in a real gateway: passthrough tunnels are joined in the kernel (cubevs
sockmap) once decided, and everything userspace owned still holds — exact byte counts in the
audit, half-close, resets, idle timeout, a reader that does not read holding the upstream back.

The whole passthrough suite runs spliced with CUBEGATE_PROXY__KERNEL_SPLICE=auto; this file
checks that splicing happens at all and what only a splice can get wrong.
"""
from __future__ import annotations

import os
import socket
import ssl
import struct
import time

import pytest

from tests.faults.helpers import eventually
from tests.gateway.conftest import MAIN_POLICY
from tests.gateway.harness import Gateway
from tests.gateway.test_fastpath import FAST_PATH_OFF, Tunnel, _active, _auth, _fast_outcomes

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(FAST_PATH_OFF, reason="proxy.fast_path switched off from the environment")]

IDLE_TIMEOUT = 2
HOST = "passthrough.allowed.test"
SPLICE_TPORT = 18067      # transparent listener of this file (unique among the daemon tests)


@pytest.fixture(scope="module", params=["auto", "off"])
def sgw(request, lab, tmp_path_factory):
    gw = Gateway(lab, tmp_path_factory.mktemp(f"splicegw-{request.param}"), {"main.yaml": MAIN_POLICY},
                 settings_extra={"proxy": {"idle_timeout": IDLE_TIMEOUT, "fast_path": True, "workers": 1,
                                           "kernel_splice": request.param}})
    gw.start()
    gw.splice = os.environ.get("CUBEGATE_PROXY__KERNEL_SPLICE", request.param)   # the environment wins
    yield gw
    gw.stop()


def _tunnel(gw, lab) -> Tunnel:
    t = Tunnel(gw.proxy_port, f"{HOST}:443", _auth(gw), HOST, str(lab.ca.bundle_path), timeout=10)
    assert t.status == 200
    t.handshake()
    return t


def _closed(gw, pred, timeout=10.0) -> dict:
    return gw.wait_record(lambda r: r["event"] == "connection_closed" and r.get("extra", {}).get("kind")
                          == "passthrough" and pred(r), timeout=timeout)


def _read_to_eof(t: Tunnel) -> bytes:
    """All plaintext until the TCP EOF, read fast (Tunnel.read_all copies quadratically: a slow reader
    would still be draining its own receive buffer when the short test idle timeout ends the tunnel)."""
    out = bytearray()
    while True:
        try:
            chunk = t.tls.read(1 << 20)
            if not chunk:
                return bytes(out)
            out += chunk
        except ssl.SSLWantReadError:
            t._pull()            # at EOF it tells the TLS object, whose next read ends the loop
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return bytes(out)


def test_a_large_download_is_spliced_with_exact_byte_counts(sgw, lab):
    if sgw.splice == "auto" and not os.environ.get("CUBEGATE_EXPERIMENTAL_SPLICE"):
        # Why `auto` stays off by default: under backpressure the kernel splice can lose bytes on
        # this kernel (bench/repro_splice_hold.py); a large spliced download then dies with a TLS
        # error or a reset (seen in a CI run). Opt in to run it.
        pytest.skip("kernel_splice=auto loses bytes under backpressure on this kernel "
                    "(bench/repro_splice_hold.py); set CUBEGATE_EXPERIMENTAL_SPLICE=1 to run")
    before = _fast_outcomes(sgw)
    n = 8 * 1024 * 1024

    def go():
        t = _tunnel(sgw, lab)
        t.send(f"GET /bytes?n={n} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        body = _read_to_eof(t)
        t.sock.close()           # no close_notify: it would race the gateway's close (either relay)
        return t.sent, t.received, body

    sent, received, body = lab.call_gw(go)
    assert body.endswith(b"x" * n), body[:200]
    after = _fast_outcomes(sgw)
    assert after.get("relayed", 0) == before.get("relayed", 0) + 1
    spliced = after.get("spliced", 0) - before.get("spliced", 0)
    assert spliced == (1 if sgw.splice == "auto" else 0)
    closed = _closed(sgw, lambda r: r.get("bytes_in") == received)
    assert closed["bytes_out"] == sent, (closed, sent)          # CONNECT head + ClientHello + the rest


def test_keep_alive_requests_pass_both_ways_in_order(sgw, lab):
    def go():
        t = _tunnel(sgw, lab)
        bodies = []
        for i in range(20):
            t.send(f"GET /bytes?n={1000 + i} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
            buf = b""
            while not buf.endswith(b"x" * (1000 + i)) or b"\r\n\r\n" not in buf:
                try:
                    chunk = t.tls.read(65536)
                except ssl.SSLWantReadError:
                    assert t._pull(), "EOF mid-response"
                    continue
                buf += chunk
            bodies.append(buf.split(b"\r\n\r\n", 1)[1])
        t.close_notify_and_close()
        return t.sent, bodies

    sent, bodies = lab.call_gw(go)
    assert [len(b) for b in bodies] == [1000 + i for i in range(20)]
    assert _closed(sgw, lambda r: r.get("bytes_out") == sent)


def test_half_closed_client_gets_its_answer_and_the_tunnel_ends(sgw, lab):
    def go():
        t = _tunnel(sgw, lab)
        t.send(f"GET /half HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        t.sock.shutdown(socket.SHUT_WR)          # the FIN goes through the splice to the upstream
        body = t.read_all()
        t.sock.close()
        return body

    body = lab.call_gw(go)
    assert b'"path": "/half"' in body, body[-300:]
    assert eventually(lambda: _active(sgw) == 0, timeout=10)


def test_a_client_that_does_not_read_holds_the_upstream_back(sgw, lab):
    """The kernel queues a redirect into a full socket without bound: the relay's flow control is
    what stops a fast upstream filling kernel memory behind a sandbox that does not read."""
    def go():
        t = _tunnel(sgw, lab)
        t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        t.send(f"GET /bytes?n=400000000 HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        time.sleep(2.0 * IDLE_TIMEOUT / 2)      # read nothing: the upstream keeps sending
        t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        t.sock.close()
        return t.sent

    sent = lab.call_gw(go)
    closed = _closed(sgw, lambda r: r.get("bytes_out") == sent)
    assert closed["bytes_in"] < 32 * 1024 * 1024, f"{closed['bytes_in']} bytes taken from the upstream"
    assert eventually(lambda: _active(sgw) == 0, timeout=10), "the upstream side was not closed"


def test_idle_spliced_tunnel_is_reset_after_idle_timeout(sgw, lab):
    def go():
        t = _tunnel(sgw, lab)
        t.sock.settimeout(IDLE_TIMEOUT * 4 + 5)
        last = time.monotonic()
        try:
            while t.sock.recv(65536):            # session tickets, then silence
                last = time.monotonic()
        except ConnectionResetError:
            pass
        waited = time.monotonic() - last
        t.sock.close()
        return waited

    waited = lab.call_gw(go)
    assert IDLE_TIMEOUT * 0.9 <= waited <= IDLE_TIMEOUT + 1.0, waited


def test_transparent_passthrough_is_spliced(lab, tmp_path):
    """Transparent mode: decided from the ClientHello, then spliced; the ClientHello the gateway
    read goes first, and the audit counts every byte."""
    from tests.gateway.switchlab import switch_lab
    from tests.gateway.test_transparent import POLICY, SANDBOX, sandbox_curl

    with switch_lab(lab, tmp_path, POLICY, sandbox=SANDBOX, tport=SPLICE_TPORT, prefix="cs",
                    settings_extra={"proxy": {"workers": 1, "kernel_splice": "auto"}}) as (gw, _, net):
        before = _fast_outcomes(gw).get("spliced", 0)
        r = sandbox_curl(lab, net, "https://api.allowed.test/bytes?n=3000000",
                         "--resolve", "api.allowed.test:443:198.18.0.10", timeout=20)
        assert r.returncode == 0 and r.stdout.rstrip().endswith("200"), (r.stderr, gw.log()[-2000:])
        assert r.stdout.count("x") >= 3_000_000
        assert _fast_outcomes(gw).get("spliced", 0) == before + 1
        closed = gw.wait_record(lambda x: x["event"] == "connection_closed" and x.get("sandbox") == SANDBOX
                                and x.get("extra", {}).get("kind") == "passthrough")
        assert closed["bytes_in"] > 3_000_000 and closed["bytes_out"] > 0
