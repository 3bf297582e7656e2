"""A ClientHello that never completes, on the path where mitmproxy reads it (explicit CONNECT to a
host with a credential binding: the fast path replays the CONNECT to mitmproxy, which then waits for
the whole hello before it chooses a layer, keeping every byte and joining them again on each read).
Refused past the fast path's hello bound (16 KiB + one record header), not at the head timeout."""
from __future__ import annotations

import socket
import struct
import time

import pytest

from tests.gateway import hostile_env as he
from tests.gateway import rawclient

pytestmark = pytest.mark.netns

TPORT = 18111
RECORD = 16 * 1024
SENT_AT_MOST = 8 << 20          # what the sandbox offers; the gateway must stop long before
HEADER_TIMEOUT = 15.0           # proxy.header_timeout's default (cubegate/settings.py)


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    with he.hostile_env(lab, tmp_path_factory.mktemp("hello"), tport=TPORT, prefix="uh") as e:
        yield e


def _endless_hello_records():
    """A handshake message that says it is 16 MiB long, then full records of it."""
    first = b"\x01\xff\xff\xff" + b"\x03\x03" + b"\x00" * (RECORD - 6)
    yield b"\x16\x03\x01" + struct.pack("!H", len(first)) + first
    body = b"\x00" * RECORD
    while True:
        yield b"\x16\x03\x01" + struct.pack("!H", RECORD) + body


def test_a_client_hello_that_never_ends_is_refused_past_its_bound_on_mitmproxys_path(env):
    sb = env.sandbox("explicit")
    s = sb.connect(sb.proxy_addr)
    try:
        s.sendall(f"CONNECT {he.H}:443 HTTP/1.1\r\nHost: {he.H}:443\r\n{sb.auth}\r\n\r\n".encode())
        assert rawclient.connect_status(rawclient.read_head(s)) == 200
        s.settimeout(0.5)
        sent, started, closed = 0, time.monotonic(), False
        for record in _endless_hello_records():
            if sent >= SENT_AT_MOST or time.monotonic() - started > HEADER_TIMEOUT - 4:
                break
            try:
                s.sendall(record)
                sent += len(record)
            except socket.timeout:
                continue                 # not read: the gateway stopped reading (backpressure)
            except OSError:
                closed = True
                break
        if not closed:                    # the refusal may sit behind what the kernel buffered
            try:
                s.settimeout(5)
                closed = s.recv(1) == b""
            except OSError:
                closed = True
    finally:
        s.close()
    assert closed, f"the gateway still held the connection after {sent} bytes of an unfinished hello"
    rec = env.gw.wait_record(lambda r: r.get("reason") == "invalid_client_hello" and r.get("host") == he.H,
                             timeout=5)
    assert rec["decision"] == "deny"
    closed = env.gw.wait_record(lambda r: r.get("event") == "connection_closed" and r.get("conn_id") == rec["conn_id"],
                                timeout=5)
    assert closed["bytes_out"] < 1 << 20, f"the gateway read {closed['bytes_out']} bytes of an unfinished hello"
    assert time.monotonic() - started < HEADER_TIMEOUT, "the head timeout ended it, not the bound"
