"""proxy.workers (issue #11 item 3), against the real daemon in the lab: two data-plane processes
on the same ports, supervised, ready together, counted together, told of every change together.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import time

import pytest

from tests.faults.helpers import eventually
from tests.gateway import rawclient
from tests.gateway.harness import Gateway
from tests.gateway.test_fastpath import FAST_PATH_OFF, Tunnel, _auth
from tests.gateway.test_policy_api import MAIN, _api, _policy

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(FAST_PATH_OFF, reason="more than one worker needs proxy.fast_path")]

HELD = 16      # tunnels held at once: all on one worker of two has odds 2 * 2**-16


def _two_worker_gateway(lab, workdir):
    g = Gateway(lab, workdir, {"main.yaml": MAIN},
                settings_extra={"proxy": {"workers": 2, "drain_seconds": 3, "max_connections_per_sandbox": HELD},
                                "policy_poll_seconds": 3600})   # only SIGHUP and the daemon's word
    g.policy_api_port = g.proxy_port + 3
    g.start()
    return g


@pytest.fixture
def wgw(lab, tmp_path):
    """A gateway of its own: for tests that change its policy."""
    g = _two_worker_gateway(lab, tmp_path / "wgw")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def shared_wgw(lab, tmp_path_factory):
    """One gateway for the tests that leave its policy as it was: the metrics sum (counts relative
    to before), then the dead worker (the module's only worker restart), then the rolling restart
    (last: it replaces every process)."""
    g = _two_worker_gateway(lab, tmp_path_factory.mktemp("wgw"))
    yield g
    g.stop()


def _workers(gw) -> list[int]:
    code, body = gw.ops_status("/readyz")
    assert code == 200, body
    m = re.search(r"2 worker\(s\) ready \(pids (\d+), (\d+)\)", body)
    assert m, body
    return [int(m.group(1)), int(m.group(2))]


def _metric(gw, name: str, **labels) -> float:
    """The sum of every series of `name` with these labels (among others)."""
    _, body = gw.ops_status("/metrics")
    total = 0.0
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", body, re.M):
        if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _owners(gw, pids: list[int]) -> set[int]:
    """Which worker processes hold established connections on the proxy port (ss -p)."""
    r = gw.lab.run_gw(["ss", "-Htnp", "state", "established", f"( sport = :{gw.proxy_port} )"], lab_dns=False)
    return {int(p) for p in re.findall(r"pid=(\d+)", r.stdout)} & set(pids)


def _hold_tunnels(gw, n: int):
    """n TLS tunnels through the proxy, each with one answer read; returned open."""
    out = []
    for _ in range(n):
        t = Tunnel(gw.proxy_port, "passthrough.allowed.test:443", _auth(gw), "passthrough.allowed.test",
                   str(gw.lab.ca.bundle_path))
        assert t.status == 200
        t.handshake()
        out.append(t)
    return out


def _closed(t: Tunnel, timeout: float) -> bool:
    t.sock.settimeout(timeout)
    try:
        while t._pull():
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True


def test_both_workers_serve_one_port_share_the_cap_and_a_policy_change_revokes_in_each(wgw):
    pids = _workers(wgw)

    def go():
        tunnels = _hold_tunnels(wgw, HELD)
        owners = _owners(wgw, pids)
        s, head = rawclient.connect_tunnel(wgw.proxy_port, "passthrough.allowed.test:443", _auth(wgw))
        s.close()
        over = rawclient.connect_status(head)   # the cap counts both workers' connections
        status = _api(wgw, "PUT", "/policies/main", content=_policy("api.allowed.test"))[0]
        t0 = time.monotonic()
        closed = [_closed(t, 3) for t in tunnels]
        for t in tunnels:
            t.sock.close()
        return owners, over, status, closed, time.monotonic() - t0

    owners, over, status, closed, took = wgw.lab.call_gw(go)
    assert over == 429, over
    assert owners == set(pids), f"connections held by {owners}, workers {pids}"
    assert status == 201 and all(closed) and took < 3, (closed, took)
    revoked = eventually(lambda: [r for r in wgw.audit_records()
                                  if r["event"] == "decision" and r.get("reason") == "policy_revoked"], timeout=5)
    assert len(revoked) == HELD
    assert wgw.curl("https://passthrough.allowed.test/").connect_status == 403   # in whichever worker


def test_metrics_are_the_sum_over_the_workers(shared_wgw):
    wgw = shared_wgw
    before = _metric(wgw, "cubegate_decisions_total", reason="default_deny", stage="connect")
    for _ in range(20):
        s, head = wgw.lab.call_gw(rawclient.connect_tunnel, wgw.proxy_port, "denied.test:443", _auth(wgw))
        s.close()
        assert rawclient.connect_status(head) == 403
    assert eventually(lambda: _metric(wgw, "cubegate_decisions_total", reason="default_deny",
                                      stage="connect") == before + 20, timeout=3)
    assert _metric(wgw, "cubegate_workers_ready") == 2


def test_sighup_reaches_every_worker(wgw):
    (wgw.policy_dir / "main.yaml").write_text(MAIN.replace("passthrough.allowed.test", "spare1.test"))
    before = _metric(wgw, "cubegate_policy_reloads_total", result="ok")
    wgw.proc.send_signal(signal.SIGHUP)
    pids = _workers(wgw)
    # reloads parse off the loops (the daemon's, each worker's): done once each of the 3 counted one
    assert eventually(lambda: _metric(wgw, "cubegate_policy_reloads_total", result="ok") >= before + 1 + len(pids),
                      timeout=10)

    def go():
        codes, owners = [], set()
        for _ in range(HELD):   # spread over both workers by the kernel
            s, head = rawclient.connect_tunnel(wgw.proxy_port, "spare1.test:443", _auth(wgw))
            owners |= _owners(wgw, pids)
            codes.append(rawclient.connect_status(head))
            s.close()
        return codes, owners

    codes, _ = wgw.lab.call_gw(go)
    assert codes == [200] * HELD, codes
    assert wgw.curl("https://passthrough.allowed.test/").connect_status == 403


def test_a_dead_worker_is_replaced_at_once_and_readyz_fails_meanwhile(shared_wgw):
    wgw = shared_wgw
    pids = _workers(wgw)
    os.kill(pids[0], signal.SIGKILL)
    seen_503 = eventually(lambda: wgw.ops_status("/readyz")[0] == 503, timeout=10, interval=0.02)  # returns when seen
    assert seen_503, "readyz stayed 200 with a dead worker"
    assert eventually(lambda: wgw.ops_status("/readyz")[0] == 200, timeout=30)
    now = _workers(wgw)
    assert pids[0] not in now and pids[1] in now
    assert _metric(wgw, "cubegate_worker_restarts_total") == 1
    assert wgw.curl("https://passthrough.allowed.test/").status == 200


def test_rolling_restart_refuses_no_connection(shared_wgw):
    """SIGUSR2 under a bounded connect loop: every connect answered, none refused or reset."""
    wgw = shared_wgw
    pids = _workers(wgw)

    def load():
        results, t0, restarted_at = [], time.monotonic(), None
        wgw.proc.send_signal(signal.SIGUSR2)
        while time.monotonic() - t0 < 30 and len(results) < 3000:
            try:
                s, head = rawclient.connect_tunnel(wgw.proxy_port, "denied.test:443", _auth(wgw))
                s.close()
                results.append(rawclient.connect_status(head))
            except OSError as e:
                results.append(type(e).__name__)
            if restarted_at is None and len(results) % 20 == 0:
                code, body = wgw.ops_status("/readyz")
                if code == 200 and not any(str(p) in body for p in pids):
                    restarted_at = time.monotonic()
            if restarted_at is not None and time.monotonic() - restarted_at > 1.0:
                break
        return results, restarted_at is not None

    results, done = wgw.lab.call_gw(load, timeout=90)
    assert done, "the rolling restart did not finish within 30 s"
    bad = [r for r in results if r != 403]
    assert not bad and len(results) > 50, (len(results), bad[:10])
    assert set(_workers(wgw)).isdisjoint(pids)
