"""Fault 4: upstreams that hang, reset, send garbage instead of TLS/HTTP, or trickle 1 byte/s.

What must hold: the sandbox gets an error within the gateway's timeouts (never
waits forever), and while those requests are stuck, other sandboxes' requests
are served with normal latency (the event loop is not starved).

mitmproxy 12 has only `tcp_timeout` (inactivity; every byte resets it, so a
trickle never trips it). cubegate adds proxy.upstream_timeout (connect +
response head, else 502) and sets proxy.idle_timeout as tcp_timeout.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.faults.helpers import bad_upstreams, report
from tests.gateway.harness import Gateway

UPSTREAM_TIMEOUT = 2.0
IDLE_TIMEOUT = 3
CONNECT_TIMEOUT = 1.5
BLACKHOLE = ("blackhole.bad.test", "198.18.0.44")   # in DNS, on no interface: SYNs vanish in the net ns
SERVERS = {
    "hang.bad.test": ("198.18.0.40", "hang"),
    "reset.bad.test": ("198.18.0.41", "reset"),
    "garbage.bad.test": ("198.18.0.42", "garbage"),
    "trickle.bad.test": ("198.18.0.43", "trickle"),
}
POLICY = """\
name: bad-upstreams
default: deny
rules:
  - name: all-lab
    action: allow
    match: {hosts: [api.allowed.test, "*.bad.test"], ports: [80, 443]}
"""


@pytest.fixture(scope="module")
def bgw(lab, tmp_path_factory):
    with bad_upstreams(lab, SERVERS):
        gw = Gateway(lab, tmp_path_factory.mktemp("badup"), {"p.yaml": POLICY},
                     sandboxes={"sb-bad": {}, "sb-good": {}},
                     settings_extra={"proxy": {"upstream_timeout": UPSTREAM_TIMEOUT, "idle_timeout": IDLE_TIMEOUT,
                                               "connect_timeout": CONNECT_TIMEOUT}})
        lab.set_zone(BLACKHOLE[0], [BLACKHOLE[1]])
        gw.start()
        try:
            yield gw
        finally:
            gw.stop()
            lab.set_zone(BLACKHOLE[0], None)


def _timed(gw, url, sandbox, max_time):
    t0 = time.monotonic()
    r = gw.curl(url, sandbox=sandbox, timeout=max_time)
    return r, time.monotonic() - t0


def _good_requests_while(gw, fn):
    """Run fn() in a thread; meanwhile send good requests from another sandbox; return fn's result, latencies."""
    lat = []
    with ThreadPoolExecutor(8) as ex:
        fut = fn(ex)
        deadline = time.monotonic() + 30
        while not all(f.done() for f in fut) and time.monotonic() < deadline:
            r, dt = _timed(gw, "http://api.allowed.test/good", "sb-good", 10)
            assert r.status == 200, r
            lat.append(dt)
        return [f.result() for f in fut], lat


def test_plain_http_bad_upstreams_get_a_timely_502_and_others_are_served(bgw):
    names = list(SERVERS)

    def start(ex):
        # two concurrent stuck requests per bad upstream
        return [ex.submit(_timed, bgw, f"http://{n}/stuck", "sb-bad", 20) for n in names for _ in range(2)]

    results, lat = _good_requests_while(bgw, start)
    bound = UPSTREAM_TIMEOUT + 2.0
    for name, (r, dt) in zip([n for n in names for _ in range(2)], results):
        assert r.status in (502, 504) or r.rc != 0, (name, r)
        assert r.status != 200, (name, r)
        assert dt < bound, (name, dt, r)
    assert lat, "no good request completed during the fault"
    assert max(lat) < 2.0, lat
    recs = [x for x in bgw.audit_records() if x.get("reason") == "upstream_timeout"]
    assert {x["host"] for x in recs} >= {"hang.bad.test", "trickle.bad.test"}, recs
    per = {n: round(max(dt for nn, (_, dt) in zip([m for m in names for _ in range(2)], results) if nn == n), 2)
           for n in names}
    report("bad-upstreams-http", **{f"{n.split('.')[0]}_s": v for n, v in per.items()},
           good_requests=len(lat), good_max_ms=round(max(lat) * 1000), upstream_timeout=UPSTREAM_TIMEOUT)


def test_tls_passthrough_bad_upstreams_fail_within_the_idle_timeout(bgw):
    names = list(SERVERS)

    def start(ex):
        return [ex.submit(_timed, bgw, f"https://{n}/stuck", "sb-bad", 20) for n in names]

    results, lat = _good_requests_while(bgw, start)
    for name, (r, dt) in zip(names, results):
        assert r.rc != 0 and r.status != 200, (name, r)
        # hang: the gateway closes after idle_timeout; the others fail at the client's TLS layer at once.
        assert dt < IDLE_TIMEOUT + 3, (name, dt, r)
    assert lat and max(lat) < 2.0, lat
    report("bad-upstreams-tls", **{f"{n.split('.')[0]}_s": round(dt, 2) for n, (_, dt) in zip(names, results)},
           good_requests=len(lat), good_max_ms=round(max(lat) * 1000), idle_timeout=IDLE_TIMEOUT)


def test_black_holed_upstream_fails_at_the_connect_timeout(bgw):
    """mitmproxy dials without a timeout (the kernel retries SYNs for ~2 min): proxy.connect_timeout."""
    results = {}
    for scheme in ("https", "http"):
        r, dt = _timed(bgw, f"{scheme}://{BLACKHOLE[0]}/void", "sb-bad", 20)
        assert r.status != 200 and dt < CONNECT_TIMEOUT + 2.0, (scheme, dt, r)
        results[scheme] = round(dt, 2)
    rec = bgw.wait_record(lambda x: x.get("host") == BLACKHOLE[0] and x.get("reason") == "upstream_connect_timeout")
    assert rec["decision"] == "deny"
    report("bad-upstreams-blackhole", connect_timeout=CONNECT_TIMEOUT, https_fail_s=results["https"],
           http_fail_s=results["http"])
