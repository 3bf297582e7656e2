"""Fault 6: many idle connections to the proxy port (2,000 in CI, 10,000 with CUBEGATE_SLOW=1).

What must hold: the daemon's open-files limit is high enough (it raises its soft
limit to the hard limit at start), a new request still succeeds with bounded
latency while they are open, and the gateway's fds drop back once the clients
close. Reported: gateway RSS per idle connection, fds, request latency.
"""
from __future__ import annotations

import asyncio
import resource
import time

import pytest

from tests.faults.helpers import eventually, proc_fds, proc_nofile, proc_rss_kib, report
from tests.gateway.harness import Gateway

POLICY = """\
name: idle
default: deny
rules:
  - name: api
    action: allow
    match: {hosts: [api.allowed.test], ports: [80, 443]}
"""
NOFILE = 65536


async def _hold(port: int, n: int, hold: "asyncio.Event | None", ready_cb, release_cb) -> int:
    """Open n idle TCP connections to the proxy, call ready_cb, wait for release_cb() -> True, close."""
    sem = asyncio.Semaphore(256)
    writers = []

    async def one():
        async with sem:
            for attempt in range(5):
                try:
                    _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
                    writers.append(w)
                    return
                except (OSError, asyncio.TimeoutError):
                    await asyncio.sleep(0.2)

    await asyncio.gather(*(one() for _ in range(n)))
    ready_cb(len(writers))
    deadline = time.monotonic() + 120
    while not release_cb() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for w in writers:
        w.close()
    await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
    return len(writers)


@pytest.fixture
def igw(lab, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:   # inherited by the daemon (which raises its own soft limit to the hard one anyway)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, NOFILE), max(hard, NOFILE)))
    except (ValueError, OSError):  # no CAP_SYS_RESOURCE (containers): the hard limit is the ceiling
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    gw = Gateway(lab, tmp_path, {"p.yaml": POLICY}, sandboxes={"sb-idle": {}},
                 settings_extra={"proxy": {"header_timeout": 120, "idle_timeout": 600}})
    try:
        gw.start()
        yield gw
    finally:
        gw.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _run(igw, lab, n: int) -> None:
    pid = igw.proc.pid
    assert proc_nofile(pid) >= n + 1000, proc_nofile(pid)
    assert igw.curl("https://api.allowed.test/warm", sandbox="sb-idle").status == 200
    # Listen backlog (ss: Send-Q of a listening socket): asyncio's 100 drops bursts of connects.
    ss = lab.run_gw(["ss", "-Hltn", f"sport = :{igw.proxy_port}"], lab_dns=False).stdout.split()
    assert ss and int(ss[2]) >= 1024, ss
    time.sleep(0.5)
    fds0, rss0 = proc_fds(pid), proc_rss_kib(pid)
    state = {"opened": None, "release": False}
    t0 = time.monotonic()
    import threading
    th = threading.Thread(target=lambda: state.update(closed=lab.call_gw(
        lambda: asyncio.run(_hold(igw.proxy_port, n, None, lambda k: state.update(opened=k),
                                  lambda: state["release"])), timeout=300)), daemon=True)
    th.start()
    try:
        assert eventually(lambda: state["opened"] is not None, 120), "clients did not finish connecting"
        open_s = time.monotonic() - t0
        assert state["opened"] == n, state
        # A client's connect() returns once the handshake is done, which may be before the
        # gateway's accept() (listen backlog): wait until the gateway holds them all.
        assert eventually(lambda: proc_fds(pid) >= fds0 + n, 90, 0.5), (proc_fds(pid), fds0)
        accepted_s = time.monotonic() - t0
        fds1, rss1 = proc_fds(pid), proc_rss_kib(pid)
        lat = []
        for i in range(5):
            t = time.monotonic()
            r = igw.curl(f"https://api.allowed.test/with-idle-{i}", sandbox="sb-idle")
            lat.append(time.monotonic() - t)
            assert r.status == 200, r
        assert max(lat) < 3.0, lat
    finally:
        state["release"] = True
        th.join(120)
    assert eventually(lambda: proc_fds(pid) <= fds0 + 10, 30), (proc_fds(pid), fds0)
    fds2 = proc_fds(pid)
    report(f"idle-connections-{n}", connections=n, open_all_s=round(open_s, 2), all_accepted_s=round(accepted_s, 2), gateway_fds_before=fds0,
           gateway_fds_held=fds1, gateway_fds_after_close=fds2, rss_before_mib=round(rss0 / 1024, 1),
           rss_held_mib=round(rss1 / 1024, 1), rss_per_conn_kib=round((rss1 - rss0) / n, 1),
           request_max_ms=round(max(lat) * 1000), request_p50_ms=round(sorted(lat)[2] * 1000),
           daemon_nofile=proc_nofile(pid))


def test_2k_idle_connections(igw, lab):
    _run(igw, lab, 2000)


@pytest.mark.slow
def test_10k_idle_connections(igw, lab):
    _run(igw, lab, 10000)
