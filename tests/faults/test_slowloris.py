"""Fault 5: slowloris clients (request head at 1 byte/s, many connections).

What must hold: the gateway closes each of them once proxy.header_timeout has
passed since it connected (mitmproxy's own tcp_timeout never fires: every
byte counts as activity), and serves other sandboxes meanwhile.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.faults.helpers import report
from tests.gateway.harness import Gateway

HEADER_TIMEOUT = 2.0
POLICY = """\
name: slowloris
default: deny
rules:
  - name: api
    action: allow
    match: {hosts: [api.allowed.test], ports: [80, 443]}
"""


async def _slow_clients(port: int, n: int, heads: list[bytes], max_seconds: float) -> list[float | None]:
    """n connections each sending its head one byte per second; seconds until the gateway closed it."""

    async def one(i: int) -> float | None:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = heads[i % len(heads)]
        try:
            for b in head:
                if time.monotonic() - t0 > max_seconds:
                    return None
                writer.write(bytes([b]))
                await writer.drain()
                try:
                    data = await asyncio.wait_for(reader.read(1024), 1.0)
                except asyncio.TimeoutError:
                    continue
                if data == b"" or data:
                    return time.monotonic() - t0  # closed (or answered) before the head was done
            return None
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
        finally:
            writer.close()

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.fixture(scope="module")
def sgw(lab, tmp_path_factory):
    gw = Gateway(lab, tmp_path_factory.mktemp("slowloris"), {"p.yaml": POLICY}, sandboxes={"sb-1": {}},
                 settings_extra={"proxy": {"header_timeout": HEADER_TIMEOUT}})
    gw.start()
    yield gw
    gw.stop()


def test_slowloris_clients_are_cut_at_the_header_timeout_and_others_served(sgw, lab):
    n = 200
    long_head = (b"GET http://api.allowed.test/ HTTP/1.1\r\nHost: api.allowed.test\r\nX-Pad: "
                 + b"a" * 40 + b"\r\n\r\n")
    connect_head = b"CONNECT api.allowed.test:443 HTTP/1.1\r\nHost: api.allowed.test:443\r\nX-Pad: " + b"a" * 40
    lat = []
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(lab.call_gw, lambda: asyncio.run(
            _slow_clients(sgw.proxy_port, n, [long_head, connect_head], max_seconds=HEADER_TIMEOUT + 8)),
            timeout=60)
        time.sleep(0.5)
        while not fut.done():
            t0 = time.monotonic()
            r = sgw.curl("https://api.allowed.test/during-slowloris")
            assert r.status == 200, r
            lat.append(time.monotonic() - t0)
        closed = fut.result()
    assert all(c is not None for c in closed), f"{closed.count(None)} of {n} slow clients never cut"
    assert max(closed) < HEADER_TIMEOUT + 2.0, max(closed)
    assert min(closed) >= HEADER_TIMEOUT - 0.2, min(closed)
    assert lat and max(lat) < 2.0, lat
    recs = [x for x in sgw.audit_records() if x.get("event") == "connection_closed" and x.get("reason") == "header_timeout"]
    assert len(recs) >= n, len(recs)
    report("slowloris", clients=n, header_timeout=HEADER_TIMEOUT, cut_after_max_s=round(max(closed), 2),
           good_requests=len(lat), good_max_ms=round(max(lat) * 1000))


def test_tunnel_client_hello_must_follow_the_connect_in_time(sgw, lab):
    """A CONNECT answered 200, then a ClientHello at 1 byte/s: cut too."""
    from tests.gateway import rawclient

    def run():
        s, head = rawclient.connect_tunnel(sgw.proxy_port, "api.allowed.test:443",
                                           rawclient.auth_header("sb-1", sgw.tokens["sb-1"]))
        assert rawclient.connect_status(head) == 200, head
        t0 = time.monotonic()
        s.settimeout(1.0)
        try:
            for b in b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 20:
                s.sendall(bytes([b]))
                try:
                    if s.recv(1024) == b"":
                        return time.monotonic() - t0
                except TimeoutError:
                    pass
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
        finally:
            s.close()
        return None

    cut = lab.call_gw(run, timeout=60)
    assert cut is not None and cut < HEADER_TIMEOUT + 2.0, cut
