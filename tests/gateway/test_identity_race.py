"""A connection authenticated just before its token is re-issued, but still being decided (its
name resolving) when the identity follow-up looks, was invisible to that look (no destination
decided yet) and never looked at again (the table's generation had not changed since): a
tunnel opened with a revoked token lived on. The follow-up keeps re-checking for a while
after each change, so connections that finish their decision later are caught too."""
from __future__ import annotations

import threading
import time

import pytest

from tests.gateway import rawclient
from tests.gateway.harness import Gateway

HELD = "review6-held.test"        # answered late by the lab DNS: the CONNECT is mid-decision
DNS_DELAY = 1.5
POLICY = f"""\
name: race
default: deny
rules:
  - name: held
    action: allow
    match: {{hosts: [{HELD}], ports: [443]}}
"""


@pytest.fixture
def rgw(lab, tmp_path):
    lab.set_zone(HELD, {"addrs": ["198.18.0.11"], "delay": DNS_DELAY})
    gw = Gateway(lab, tmp_path / "race", {"p.yaml": POLICY}, sandboxes={"sb-1": {}})
    gw.start()
    yield gw
    gw.stop()
    lab.set_zone(HELD, None)


def test_a_tunnel_mid_decision_when_its_token_is_reissued_is_closed(rgw, lab):
    token = rgw.tokens["sb-1"]

    def connect_and_watch() -> dict:
        s, head = rawclient.connect_tunnel(rgw.proxy_port, f"{HELD}:443", rawclient.auth_header("sb-1", token),
                                           timeout=DNS_DELAY + 5)
        out = {"status": rawclient.connect_status(head), "closed": False}
        s.settimeout(0.5)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0 and not out["closed"]:
            try:
                out["closed"] = s.recv(65536) == b""
            except TimeoutError:
                pass
            except OSError:
                out["closed"] = True
        s.close()
        return out

    result: dict = {}
    t = threading.Thread(target=lambda: result.update(lab.call_gw(connect_and_watch, timeout=30)))
    t.start()
    time.sleep(0.8)                           # authenticated, its name still resolving
    rgw.cli("identity", "add", "sb-1", "--replace")
    t.join(30)
    assert result.get("status") == 200, result       # it was allowed when decided...
    assert result["closed"], result                  # ...and closed: its token is no longer valid
    rec = rgw.wait_record(lambda r: r.get("reason") == "policy_revoked"
                          and (r.get("extra") or {}).get("denied_by") == "identity_changed")
    assert rec["decision"] == "deny"
