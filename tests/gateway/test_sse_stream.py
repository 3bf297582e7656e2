"""An LLM token stream on an injected flow reaches the sandbox event by event, scrubbed.

The gateway injects the key, so it scrubs the response as it streams (vault.scan.StreamScrubber).
It used to hold back ~34 KB before releasing anything: a text/event-stream of small events
reached the sandbox in lumps or only at its end. The upstream (testbed/sse.py) sends 20
small events 150 ms apart, echoes the injected key inside one event and splits it across
two writes 150 ms apart in another. The sandbox must get the first event long before the
last one is sent, the events in order and spread out, and never the key (nor the first
half of the split one: a needle prefix is held until it is resolved).
"""
from __future__ import annotations

import hashlib
import socket
import ssl
import time
import uuid

import pytest

from tests.waiting import wait_for

from testbed.sse import start_sse
from tests.gateway.hostile_env import MODES, Env, assert_never_leaked
from tests.gateway.switchlab import switch_lab

pytestmark = pytest.mark.netns

TPORT = 18085
NAME = "sse.allowed.test"
IP = "198.18.0.55"
SANDBOX = "sb-sse"
KEY = "sk-proj-Lab7/Qx9+stream-4e1f0c2b9a"
EVENTS, GAP, ECHO, SPLIT = 20, 0.15, 5, 8
LOG_LAG = 0.5                 # the upstream logs its last write this late: the test must wait for the line
REDACTED = b"[REDACTED]"
READ_DEADLINE = 30.0          # bounds one stream read, whatever the gateway does

POLICY = f"""\
name: sse
tenant: acme
default: deny
rules:
  - name: sse-lab
    action: allow
    match: {{hosts: [{NAME}], ports: [443]}}
"""


def _setup_vault(gw) -> None:
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "llmkey", input=KEY + "\n")
    gw.cli("vault", "binding", "add", "--id", "b-sse", "--tenant", "acme", "--secret", "llmkey",
           "--host", NAME, "--port", "443", "--header", "Authorization", "--format", "Bearer {secret}")


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    upstream = start_sse(lab, NAME, IP)
    try:
        with switch_lab(lab, tmp_path_factory.mktemp("sse"), POLICY, sandbox=SANDBOX, tport=TPORT, prefix="ce",
                        before_start=_setup_vault) as (gw, sw, net):
            yield Env(gw, sw, net, upstream, placeholder="")
    finally:
        upstream.stop()


def _read_stream(sock: ssl.SSLSocket) -> list[tuple[float, bytes]]:
    """Every read until the peer closes or the stream's end: (time.time() on arrival, bytes)."""
    reads: list[tuple[float, bytes]] = []
    deadline = time.monotonic() + READ_DEADLINE
    sock.settimeout(5.0)
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except (socket.timeout, ssl.SSLError, OSError):
            break
        if not data:
            break
        reads.append((time.time(), data))
        wire = b"".join(d for _, d in reads)
        # the last event whole (its pieces are written one by one: "[DONE]" may come before its
        # blank line, and closing then cuts the upstream's last write), or the end of the chunks
        if wire.endswith(b"0\r\n\r\n") or b"[DONE]\n\n" in _dechunk(wire[wire.find(b"\r\n\r\n") + 4:]):
            break
    return reads


def _dechunk(body: bytes) -> bytes:
    """The chunks complete so far."""
    out, i = bytearray(), 0
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            return bytes(out)
        size = int(body[i:j].split(b";")[0] or b"0", 16)
        if size == 0 or j + 2 + size > len(body):
            return bytes(out)
        out += body[j + 2:j + 2 + size]
        i = j + 2 + size + 2


def _sent(log: list[dict]) -> dict[int, float]:
    """Event index -> when its last write left the upstream (the split event logs each of its writes)."""
    return {e["index"]: e["t"] for e in log if e["event"] == "sent"}


def _arrivals(reads: list[tuple[float, bytes]]) -> tuple[bytes, bytes, list[float]]:
    """(response head, body, per complete event the time the read that completed it arrived)."""
    wire = b""
    times: list[float] = []
    head = b""
    for t, data in reads:
        wire += data
        end = wire.find(b"\r\n\r\n")
        if end < 0:
            continue
        head = wire[:end]
        events = _dechunk(wire[end + 4:]).count(b"\n\n")
        times += [t] * (events - len(times))
    body = _dechunk(wire[wire.find(b"\r\n\r\n") + 4:]) if head else b""
    return head, body, times


@pytest.mark.parametrize("mode", MODES)
def test_event_stream_reaches_the_sandbox_event_by_event_and_scrubbed(env, mode):
    marker = "m" + uuid.uuid4().hex[:10]
    sb = env.sandbox(mode, SANDBOX)
    sock = sb.tls(NAME if mode == "explicit" else IP, sni=NAME)
    try:
        query = f"n={EVENTS}&gap={GAP}&echo={ECHO}&split={SPLIT}&log_lag={LOG_LAG}"
        sock.sendall(f"GET /events/{marker}?{query} HTTP/1.1\r\n"
                     f"Host: {NAME}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n".encode())
        reads = _read_stream(sock)
    finally:
        sock.close()
    head, body, arrived = _arrivals(reads)
    wire = b"".join(data for _, data in reads)

    # The upstream logs a write after it returned, so the sandbox may read the last event before its
    # line exists (a loaded machine does this at random, LOG_LAG every time): wait for a line of every
    # event, not for as many lines as events (the split event has two).
    def logged():
        entries = env.hostile.entries(marker)
        return entries if len(_sent(entries)) == EVENTS + 1 else None
    try:
        log = wait_for(logged, 5.0, "the upstream's log of every event")
    except AssertionError:
        log = env.hostile.entries(marker)      # the assertions below say what is missing
    requests = [e for e in log if e["event"] == "request"]
    assert len(requests) == 1 and requests[0]["key_sha256"] == hashlib.sha256(KEY.encode()).hexdigest(), \
        "the key was not injected: the test would prove nothing"
    sent = _sent(log)
    closes = [r for r in env.gw.audit_records() if r.get("sandbox") == SANDBOX and r["event"] == "connection_closed"]
    failed = [e for e in log if e["event"] == "write_failed"]
    assert len(sent) == EVENTS + 1, (f"the upstream sent {len(sent)} of {EVENTS + 1} events: missing "
                                     f"{sorted(set(range(EVENTS + 1)) - set(sent))}; the sandbox read {len(wire)} bytes "
                                     f"ending {wire[-80:]!r}; upstream errors {failed}; last closes {closes[-2:]}")

    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head.lower(), head[:300]
    assert len(arrived) == EVENTS + 1, f"got {len(arrived)} events: {body[-300:]!r}"
    assert body.endswith(b"data: [DONE]\n\n")
    # Streamed, not gathered: the first event arrives long before the last one is sent
    # (about 3 s before), and the events come in many separate reads, in order.
    assert arrived[0] < sent[EVENTS] - 1.0, (arrived[0] - sent[0], sent[EVENTS] - sent[0])
    assert len(set(arrived)) >= EVENTS // 2, f"events arrived in {len(set(arrived))} lumps"
    assert arrived == sorted(arrived)
    assert arrived[EVENTS // 2] < sent[EVENTS] - 0.5

    events = body.split(b"\n\n")
    assert b"token0" in events[0] and b"token19" in events[19]
    assert REDACTED in events[ECHO] and REDACTED in events[SPLIT], (events[ECHO], events[SPLIT])
    assert KEY.encode()[:len(KEY) // 2] not in wire, "the split key's first half was released"
    assert_never_leaked(wire, KEY, what="event stream")
