"""Issue #13 items 2-4 end to end: namespace sandboxes in transparent mode, the real daemon.

An agent reads its own denial at http://cubegate.internal, files an access request, the
webhook fires (a receiver in the lab's net namespace), an admin approves it for the
sandbox with an expiry, the same request then succeeds, and the expiry removes it again.
Another sandbox sees none of it. Per-sandbox network options narrow and never widen.
"""
from __future__ import annotations

import json
import sys
import time

import pytest

from tests.sandbox_runtime.daemonlab import policy_call as admin
from tests.sandbox_runtime.daemonlab import runtime_call as runtime
from tests.sandbox_runtime.daemonlab import sandbox_create as create
from tests.sandbox_runtime.daemonlab import sandbox_https as https
from tests.sandbox_runtime.daemonlab import sandbox_internal as internal
from tests.sandbox_runtime.daemonlab import sandbox_sh as sh
from tests.sandbox_runtime.daemonlab import runtime_daemon, runtime_settings

pytestmark = pytest.mark.netns

TPORT, API_PORT, POLICY_PORT, HOOK_PORT = 18274, 18273, 18275, 18276
POLICY = """\
name: acme
tenant: acme
applies_to: {labels: {tenant: acme}}
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [api.allowed.test, x.github.test], ports: [443]}
"""
RECEIVER = """
import http.server, sys
out = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(out, "ab") as f:
            f.write(body + b"\\n")
        self.send_response(204); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("198.18.0.2", int(sys.argv[2])), H).serve_forever()
"""


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("access")
    hook_file = tmp / "webhook.jsonl"
    receiver = lab.spawn_net([sys.executable, "-c", RECEIVER, str(hook_file), str(HOOK_PORT)])
    settings = {**runtime_settings(API_PORT, memory_mb=1024, cpus=1.0, max_sandboxes=4, host_reserve_mb=256),
                "policy_api": {"port": POLICY_PORT},
                "access": {"webhook_url": f"http://198.18.0.2:{HOOK_PORT}/hook", "grant_sweep_seconds": 0.5,
                           "requests_per_minute": 3}}
    try:
        with runtime_daemon(lab, tmp, POLICY, tport=TPORT, prefix="ca", settings=settings) as (gw, _):
            gw.hook_file = hook_file
            yield gw
    finally:
        receiver.kill()


def test_agent_reads_its_denial_files_a_request_admin_approves_and_expiry_removes_it(env, lab):
    gw = env
    create(lab, gw, "sb-a")
    create(lab, gw, "sb-b")
    try:
        assert https(lab, gw, "sb-a", "api.allowed.test") == "200"
        assert https(lab, gw, "sb-a", "passthrough.allowed.test") != "200"      # DNS says NXDOMAIN
        code, own = internal(lab, gw, "sb-a", "/v1/denials")
        assert code == 200 and own["sandbox"] == "sb-a"
        assert any(d["host"] == "passthrough.allowed.test" and d["reason"] == "dns_not_allowed"
                   for d in own["denials"]), own
        code, filed = internal(lab, gw, "sb-a", "/v1/access-requests",
                               {"host": "passthrough.allowed.test", "port": 443, "reason": "docs mirror for the task"})
        assert code == 201, filed
        rid = filed["request"]["id"]
        # another sandbox sees none of it
        assert https(lab, gw, "sb-b", "denied.test") != "200"
        code, other = internal(lab, gw, "sb-b", "/v1/denials")
        assert {d["host"] for d in other["denials"]} == {"denied.test"}, other
        assert internal(lab, gw, "sb-b", "/v1/access-requests")[1]["requests"] == []
        # a sandbox can approve nothing, nor read policies
        assert internal(lab, gw, "sb-a", f"/v1/access-requests/{rid}/approve", {})[0] == 404
        assert internal(lab, gw, "sb-a", "/v1/policies")[0] == 404
        # the webhook fired
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (gw.hook_file.exists() and gw.hook_file.read_text().strip()):
            time.sleep(0.1)
        hook = json.loads(gw.hook_file.read_text().splitlines()[0])
        assert hook["event"] == "access_request" and hook["request"]["id"] == rid
        assert hook["request"]["sandbox"] == "sb-a" and hook["request"]["host"] == "passthrough.allowed.test"
        # an admin approves for this sandbox, 6 s
        status, pending = admin(lab, gw, "GET", "/access-requests", params={"state": "pending"})
        assert [r["id"] for r in pending["requests"]] == [rid]
        status, done = admin(lab, gw, "POST", f"/access-requests/{rid}/approve",
                             json={"scope": "sandbox", "expires_in_seconds": 6})
        assert status == 200 and done["state"] == "approved" and done["grant"] == f"grant.{rid}", done
        t_ok = time.monotonic()
        assert https(lab, gw, "sb-a", "passthrough.allowed.test") == "200", gw.log()[-3000:]
        assert https(lab, gw, "sb-b", "passthrough.allowed.test") != "200"      # scope: this sandbox only
        rec = gw.wait_record(lambda r: r.get("sandbox") == "sb-a" and r.get("host") == "passthrough.allowed.test"
                             and r.get("reason") == "grant_allow")
        assert rec["policy"] == f"grant.{rid}"
        # the expiry removes it again (versioned: create, expire)
        while time.monotonic() - t_ok < 9 and https(lab, gw, "sb-a", "passthrough.allowed.test") == "200":
            time.sleep(0.5)
        assert https(lab, gw, "sb-a", "passthrough.allowed.test") != "200"
        code, own = internal(lab, gw, "sb-a", "/v1/access-requests")
        assert own["requests"][0]["state"] == "approved"
        # the rate limit and size limit of filing
        codes = [internal(lab, gw, "sb-b", "/v1/access-requests", {"host": f"h{i}.test", "port": 443, "reason": "x"})[0]
                 for i in range(4)]
        assert codes == [201, 201, 201, 429], codes
        code, _ = internal(lab, gw, "sb-b", "/v1/access-requests", {"host": "big.test", "port": 443,
                                                                     "reason": "x" * 5000})
        assert code == 413
    finally:
        for sid in ("sb-a", "sb-b"):
            runtime(lab, gw, "DELETE", f"/sandboxes/{sid}")


def test_sandbox_network_options_narrow_and_cannot_widen(env, lab):
    gw = env
    create(lab, gw, "sb-n", network={"allow": ["api.allowed.test:443", "passthrough.allowed.test:443"]})
    try:
        assert https(lab, gw, "sb-n", "api.allowed.test") == "200"
        assert https(lab, gw, "sb-n", "passthrough.allowed.test") != "200"   # listed, but the admin denies it
        assert https(lab, gw, "sb-n", "x.github.test") != "200"              # the admin allows it; not listed
        rec = gw.wait_record(lambda r: r.get("sandbox") == "sb-n" and r.get("host") == "x.github.test")
        assert rec["decision"] == "deny" and rec["reason"] in ("dns_not_allowed", "sandbox_network_not_allowed")
        status, _ = runtime(lab, gw, "PUT", "/sandboxes/sb-n/network", json={"deny": ["api.allowed.test"]})
        assert status == 200
        assert https(lab, gw, "sb-n", "api.allowed.test") != "200"
        assert https(lab, gw, "sb-n", "x.github.test") == "200"
        status, bad = runtime(lab, gw, "PUT", "/sandboxes/sb-n/network", json={"allow": ["api.*.test"]})
        assert status == 400 and "/allow/0" in bad["message"], bad
        hist = admin(lab, gw, "GET", "/policies")[1]
        assert hist is not None
    finally:
        runtime(lab, gw, "DELETE", "/sandboxes/sb-n")
    # removed with the sandbox
    status, _ = admin(lab, gw, "POST", "/decide", json={"sandbox": "sb-n", "labels": {"tenant": "acme"},
                                                        "host": "api.allowed.test"})
    assert _["action"] == "allow"
