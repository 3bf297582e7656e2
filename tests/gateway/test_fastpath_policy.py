"""The fast path under the live policy (issue #11 with #13), in a real gateway with proxy.fast_path on.

A tunnel the fast path relays is registered for revocation: a policy change (an API
PUT, a grant revoked) that now denies it closes it at once, audited policy_revoked.
A grant approved through the API is what the fast path decides with (the same
effective policy as the gate), and cubegate.internal is still answered by the gate.
"""
from __future__ import annotations

import json
import re
import socket
import ssl
import time

import pytest

from tests.gateway.harness import Gateway
from tests.gateway.test_fastpath import FAST_PATH_OFF, Tunnel, _auth, _fast_outcomes
from tests.gateway.test_policy_api import MAIN, _api, _policy

pytestmark = [pytest.mark.netns,
              pytest.mark.skipif(FAST_PATH_OFF, reason="proxy.fast_path switched off from the environment")]


@pytest.fixture
def gw(lab, tmp_path):
    g = Gateway(lab, tmp_path / "gw", {"main.yaml": MAIN}, sandboxes={"sb-1": {"team": "a"}},
                settings_extra={"proxy": {"fast_path": True}})
    g.policy_api_port = g.proxy_port + 3
    g.start()
    yield g
    g.stop()


def _hold_then(gw, host: str, change) -> dict:
    """In the gw namespace: a TLS tunnel through the fast path, one keep-alive answer read,
    then change(); how long the tunnel stays open afterwards (bounded: 6 s)."""
    def run():
        t = Tunnel(gw.proxy_port, f"{host}:443", _auth(gw), host, str(gw.lab.ca.bundle_path), timeout=10)
        assert t.status == 200
        t.handshake()
        t.send(f"GET /held HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        first = b""
        while b'"path": "/held"' not in first:
            try:
                first += t.tls.read(65536)
            except ssl.SSLWantReadError:
                assert t._pull(), first
        status = change()
        t0 = time.monotonic()
        t.sock.settimeout(6)
        closed = False
        try:
            while time.monotonic() - t0 < 6:
                if not t._pull():
                    closed = True
                    break
        except socket.timeout:
            pass
        except OSError:                       # reset: revoked connections are reset
            closed = True
        t.sock.close()
        return {"status": status, "closed": closed, "after_s": time.monotonic() - t0}
    return gw.lab.call_gw(run)


def _relayed(gw) -> float:
    return _fast_outcomes(gw).get("relayed", 0)


def test_an_api_change_closes_a_fast_path_tunnel_it_now_denies(gw):
    r0 = _relayed(gw)
    out = _hold_then(gw, "passthrough.allowed.test",
                     lambda: _api(gw, "PUT", "/policies/main", content=_policy("api.allowed.test"))[0])
    assert out["status"] == 201 and out["closed"] and out["after_s"] < 2, out
    assert _relayed(gw) == r0 + 1                    # the fast path relayed it, not mitmproxy
    rev = gw.wait_record(lambda r: r.get("reason") == "policy_revoked")
    assert rev["host"] == "passthrough.allowed.test" and rev["sandbox"] == "sb-1"
    assert rev["extra"] == {"denied_by": "default_deny", "kind": "passthrough"}
    closed = gw.wait_record(lambda r: r["event"] == "connection_closed" and r.get("conn_id") == rev["conn_id"])
    assert closed["decision"] == "deny" and closed["reason"] == "policy_revoked", closed
    assert gw.curl("https://passthrough.allowed.test/").connect_status == 403   # and the next one
    # a tunnel the new policy still allows stays open
    kept = _hold_then(gw, "api.allowed.test",
                      lambda: _api(gw, "PUT", "/policies/main",
                                   content=_policy("api.allowed.test", "spare1.test"))[0])
    assert kept["status"] == 200 and not kept["closed"], kept   # 200: a replaced API policy
    assert len([r for r in gw.audit_records() if r["event"] == "decision" and r.get("reason") == "policy_revoked"]) == 1


def test_a_grant_is_decided_by_the_fast_path_and_revoking_it_closes_the_tunnel(gw):
    denied = gw.curl("https://spare1.test/")
    assert denied.connect_status == 403
    # the agent asks at cubegate.internal (plain HTTP: handed to the gate, answered there)
    h0 = _fast_outcomes(gw).get("handed_over", 0)
    r = gw.lab.curl("-s", "-x", gw.proxy_url(), "-H", "Content-Type: application/json",
                    "--data", json.dumps({"host": "spare1.test", "port": 443, "reason": "docs"}),
                    "http://cubegate.internal/v1/access-requests", cacert=False, lab_dns=False)
    filed = json.loads(r.stdout)["request"]
    assert re.fullmatch(r"ar_[0-9a-f]{16}", filed["id"]), filed
    assert _fast_outcomes(gw).get("handed_over", 0) == h0 + 1
    status, done = _api(gw, "POST", f"/access-requests/{filed['id']}/approve", json={"scope": "sandbox"})
    assert status == 200 and done["state"] == "approved", done
    r0 = _relayed(gw)
    assert gw.curl("https://spare1.test/").status == 200
    assert _relayed(gw) == r0 + 1                    # the grant, as the fast path decides it
    rec = gw.wait_record(lambda r: r["event"] == "decision" and r.get("host") == "spare1.test"
                         and r.get("decision") == "allow")
    assert rec["reason"] == "grant_allow", rec
    out = _hold_then(gw, "spare1.test", lambda: _api(gw, "DELETE", f"/grants/{done['grant']}")[0])
    assert out["status"] == 200 and out["closed"] and out["after_s"] < 2, out
    rev = gw.wait_record(lambda r: r.get("reason") == "policy_revoked")
    assert rev["host"] == "spare1.test" and rev["extra"]["kind"] == "passthrough"
