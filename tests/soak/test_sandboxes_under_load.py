"""Real sandboxes under concurrent load, end to end: 20 namespace sandboxes created at once
through the daemon's API, each running a loop of allowed and denied HTTPS requests from
inside (no proxy settings: the switch steers them), all audited per sandbox, then destroyed
at once with nothing left behind."""
from __future__ import annotations

import base64
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from testbed.netns import call_in_netns
from tests.gateway.switchlab import HUB_IP, switch_lab

pytestmark = pytest.mark.netns

N = 20
ROUNDS = 10
TPORT, API_PORT = 18072, 18071
POLICY = """\
name: load
tenant: acme
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [api.allowed.test], ports: [443]}
"""


def _api(lab, gw, calls):
    """Run [(method, path, json)] concurrently from the gw namespace; returns responses in order."""
    token = (gw.state_dir / "runtime" / "api.token").read_text().strip()

    def run():
        with httpx.Client(base_url=f"http://127.0.0.1:{API_PORT}/v1", timeout=120,
                          headers={"Authorization": f"Bearer {token}"}) as c, ThreadPoolExecutor(len(calls)) as ex:
            return list(ex.map(lambda call: c.request(call[0], call[1], json=call[2]), calls))
    return call_in_netns(lab.gw_ns, run, timeout=300)


def test_twenty_sandboxes_under_load_are_isolated_audited_and_leave_nothing(lab, tmp_path):
    settings = {"dns": {"listen_host": HUB_IP, "port": 53},
                "runtime": {"enabled": True, "api_port": API_PORT, "memory_mb": 4096, "cpus": 8.0}}
    with switch_lab(lab, tmp_path, POLICY, sandbox=None, tport=TPORT, prefix="cl",
                    settings_extra=settings) as (gw, sw, _):
        ca = base64.b64encode(Path(lab.ca.bundle_path).read_bytes()).decode()
        ids = [f"ld-{i:02d}" for i in range(N)]
        made = _api(lab, gw, [("POST", "/sandboxes", {"id": sid, "tenant": "acme", "files": {"ca.pem": ca},
                                                      "limits": {"memory_mb": 64, "cpus": 0.25}}) for sid in ids])
        try:
            assert [r.status_code for r in made] == [201] * N, [r.text for r in made if r.status_code != 201]
            script = ("for i in $(seq %d); do "
                      "curl -s -o /dev/null -w '%%{http_code} ' --max-time 5 --cacert /workspace/ca.pem "
                      "https://api.allowed.test/; "
                      "curl -s -o /dev/null -w '%%{http_code} ' --max-time 5 https://denied.test/; done" % ROUNDS)
            runs = _api(lab, gw, [("POST", f"/sandboxes/{sid}/exec", {"argv": ["sh", "-c", script], "timeout": 120})
                                  for sid in ids])
            for sid, r in zip(ids, runs):
                codes = r.json()["stdout"].split()
                assert codes == ["200", "000"] * ROUNDS, (sid, r.json())
            # Every allowed connection has its own decision record under the right sandbox,
            # every denied name its dns record: nothing attributed to another sandbox.
            def audited():
                recs = gw.audit_records()
                allow = {sid: sum(1 for x in recs if x.get("sandbox") == sid and x["event"] == "decision"
                                  and x.get("host") == "api.allowed.test" and x["decision"] == "allow")
                         for sid in ids}
                dns = {sid: sum(1 for x in recs if x.get("sandbox") == sid and x["event"] == "dns"
                                and x.get("host") == "denied.test" and x["decision"] == "deny") for sid in ids}
                return allow, dns
            allow, dns = audited()
            for _ in range(50):
                if all(v == ROUNDS for v in allow.values()) and all(v >= ROUNDS for v in dns.values()):
                    break
                __import__("time").sleep(0.1)
                allow, dns = audited()
            assert all(v == ROUNDS for v in allow.values()), allow
            assert all(v >= ROUNDS for v in dns.values()), dns
            metrics = gw.ops("/metrics").stdout
            assert f'cubegate_sandboxes_live{{backend="namespace",state="running"}} {float(N)}' in metrics
        finally:
            gone = _api(lab, gw, [("DELETE", f"/sandboxes/{sid}", None) for sid in ids])
        assert [r.status_code for r in gone] == [204] * N, [r.text for r in gone]
        assert sw.sandboxes() == []
        listing = json.loads(subprocess.run(["ip", "-j", "netns", "list"], capture_output=True, text=True).stdout or "[]")
        assert not [n for n in listing if n["name"].startswith(sw.netns_prefix)]
        assert not list(Path("/sys/fs/cgroup/memory").glob("cubegate/**/ld-*"))
        assert subprocess.run(["pgrep", "-f", "ld-[0-9][0-9]"], capture_output=True).returncode == 1
