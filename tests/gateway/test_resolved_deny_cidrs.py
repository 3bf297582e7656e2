"""Deny CIDRs hold for names: a name a host rule allows, resolving into a range the policy's
global `denied_cidrs` or the sandbox's network-options `deny` address entries name, is refused
on every path (explicit CONNECT on the fast path and through mitmproxy, an intercepted host,
plain HTTP, transparent), audited resolved_global_deny / resolved_sandbox_network_deny, and
nothing reaches the lab upstream. A name resolving outside the range still works.

The lab's upstreams (198.18.0.0/24) are exempt from the SSRF guard (upstream.allow_cidrs), so
the refusal here can only come from the policy's deny ranges."""
from __future__ import annotations

import os
import socket
import subprocess

import pytest

from egress.policy.repo import PolicyRepo
from tests.gateway import rawclient
from tests.gateway.harness import Gateway
from tests.gateway.switchlab import switch_lab

pytestmark = pytest.mark.netns

DENIED_IP = "198.18.0.12"          # denied.test's upstream: in the global deny range below
SB_DENIED_IP = "198.18.0.19"       # spare1.test's upstream: in sb-2's network-options deny list
SNEAKY = "rdc-sneaky.allowed.test"          # -> DENIED_IP
INSPECTED = "rdc-inspected.allowed.test"    # -> DENIED_IP, a host with path rules (intercepted)
PINNED = "rdc-pinned.allowed.test"          # -> SB_DENIED_IP
ZONE = {SNEAKY: [DENIED_IP], INSPECTED: [DENIED_IP], PINNED: [SB_DENIED_IP]}

POLICY = f"""\
name: rdc
default: deny
rules:
  - name: lab
    action: allow
    match: {{hosts: ["*.allowed.test"], ports: [80, 443]}}
  - name: inspected
    action: allow
    match: {{hosts: [{INSPECTED}], ports: [443], paths: [/]}}
global: {{denied_cidrs: [{DENIED_IP}/32]}}
"""
SB2_NETWORK = {"allow": [], "deny": [f"{SB_DENIED_IP}/32"]}


@pytest.fixture(scope="module")
def zone(lab):
    for name, addrs in ZONE.items():
        lab.set_zone(name, addrs)
    yield
    for name in ZONE:
        lab.set_zone(name, None)


@pytest.fixture(scope="module", params=[True, False], ids=["fast_path", "mitmproxy"])
def gw(request, lab, zone, tmp_path_factory):
    g = Gateway(lab, tmp_path_factory.mktemp("rdc"), {"rdc.yaml": POLICY},
                sandboxes={"sb-1": {}, "sb-2": {}}, settings_extra={"proxy": {"fast_path": request.param}})
    g.state_dir.mkdir(parents=True, exist_ok=True)
    repo = PolicyRepo(g.state_dir / "policies.db")   # what the runtime writes when it creates sb-2
    try:
        repo.commit("network", "sb-2", SB2_NETWORK, action="create", actor="test")
    finally:
        repo.close()
    g.start()
    yield g
    g.stop()


def _connect(gw, target: str, sandbox: str = "sb-1") -> tuple[int, bytes]:
    """CONNECT target through the explicit proxy; the status and the whole answer head."""
    def run():
        with socket.create_connection(("127.0.0.1", gw.proxy_port), timeout=10) as s:
            auth = rawclient.auth_header(sandbox, gw.tokens[sandbox])
            s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(4096)
                if not chunk:
                    break
                head += chunk
            return int(head.split(b" ", 2)[1]), head
    return gw.lab.call_gw(run)


def _denied_record(gw, host: str, reason: str, sandbox: str = "sb-1") -> dict:
    return gw.wait_record(lambda r: r["event"] == "decision" and r.get("host") == host
                          and r.get("sandbox") == sandbox and r.get("decision") == "deny"
                          and r.get("reason") == reason)


def _no_allow_for(gw, host: str, sandbox: str = "sb-1") -> None:
    recs = [r for r in gw.audit_records() if r.get("host") == host and r.get("sandbox") == sandbox]
    assert recs and all(r.get("decision") != "allow" or r["event"] == "dns" for r in recs), recs
    assert not any(r.get("upstream") for r in recs), recs


def test_connect_to_a_name_resolving_into_a_global_deny_cidr_is_refused(gw):
    status, head = _connect(gw, f"{SNEAKY}:443")
    assert status == 403, head
    assert b"resolved_global_deny" in head, head
    rec = _denied_record(gw, SNEAKY, "resolved_global_deny")
    assert rec["rule"] == f"{DENIED_IP}/32" and rec["policy"] == "global", rec
    _no_allow_for(gw, SNEAKY)


def test_an_intercepted_host_resolving_into_a_global_deny_cidr_is_refused(gw):
    r = gw.curl(f"https://{INSPECTED}/rdc-inspected")
    assert 403 in (r.connect_status, r.status), r
    _denied_record(gw, INSPECTED, "resolved_global_deny")
    _no_allow_for(gw, INSPECTED)
    assert "rdc-inspected" not in gw.lab.logs("upstream")


def test_plain_http_to_a_name_resolving_into_a_global_deny_cidr_is_refused(gw):
    r = gw.curl(f"http://{SNEAKY}/rdc-plain")
    assert r.status == 403, r
    _denied_record(gw, SNEAKY, "resolved_global_deny")
    assert "rdc-plain" not in gw.lab.logs("upstream")


def test_a_sandbox_network_deny_cidr_refuses_names_resolving_into_it(gw):
    status, head = _connect(gw, f"{PINNED}:443", sandbox="sb-2")
    assert status == 403 and b"resolved_sandbox_network_deny" in head, head
    rec = _denied_record(gw, PINNED, "resolved_sandbox_network_deny", sandbox="sb-2")
    assert rec["rule"] == f"{SB_DENIED_IP}/32" and rec["policy"] == "network:sb-2", rec
    r = gw.curl(f"http://{PINNED}/rdc-sb2-plain", sandbox="sb-2")
    assert r.status == 403, r
    assert "rdc-sb2-plain" not in gw.lab.logs("upstream")
    # another sandbox has no such entry: the same name is allowed for it
    status, head = _connect(gw, f"{PINNED}:443", sandbox="sb-1")
    assert status == 200, head


def test_control_a_name_resolving_outside_the_ranges_still_works(gw):
    status, head = _connect(gw, "api.allowed.test:443")
    assert status == 200, head
    r = gw.curl("https://api.allowed.test/rdc-control")
    assert r.status == 200 and '"path": "/rdc-control"' in r.body, r
    r = gw.curl("http://api.allowed.test/rdc-control-plain", sandbox="sb-2")
    assert r.status == 200, r


# ---------------------------------------------------------------- transparent

TPORT = 18066
HUB_IP = "10.200.0.1"    # cubevs hub gateway address: the sandbox resolver listens there
T_SANDBOX = "sb-rdc"
_NO_PROXY_ENV = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}


@pytest.fixture(scope="module")
def tlab(lab, zone, tmp_path_factory):
    dns = {"listen_host": HUB_IP, "port": 53, "audit_interval_seconds": 1.0}
    with switch_lab(lab, tmp_path_factory.mktemp("rdct"), POLICY, sandbox=T_SANDBOX, tport=TPORT,
                    prefix="cz", settings_extra={"dns": dns}) as env:
        yield env


def _sandbox_curl(lab, net, url: str, *args: str) -> subprocess.CompletedProcess:
    argv = ["nsenter", f"--net=/run/netns/{net.netns}", "curl", "-sS", "--max-time", "5",
            "--cacert", str(lab.ca.bundle_path), "-o", "/dev/stdout", "-w", "\n%{http_code}", *args, url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=10, env=_NO_PROXY_ENV)


def test_transparent_sni_and_host_resolving_into_a_global_deny_cidr_are_refused(tlab, lab):
    gw, _, net = tlab
    # The sandbox dials an allowed address; the gateway resolves SNI / Host itself.
    r = _sandbox_curl(lab, net, f"https://{SNEAKY}/rdc-t-tls", "--resolve", f"{SNEAKY}:443:198.18.0.10")
    assert r.returncode in (35, 56), r
    gw.wait_record(lambda x: x["event"] == "decision" and x.get("sandbox") == T_SANDBOX and x.get("port") == 443
                   and x.get("host") == SNEAKY and x.get("reason") == "resolved_global_deny")
    r = _sandbox_curl(lab, net, f"http://{SNEAKY}/rdc-t-plain", "--resolve", f"{SNEAKY}:80:198.18.0.10")
    assert r.stdout.rstrip().endswith("403"), r
    gw.wait_record(lambda x: x["event"] == "request" and x.get("sandbox") == T_SANDBOX and x.get("port") == 80
                   and x.get("host") == SNEAKY and x.get("reason") == "resolved_global_deny")
    recs = [x for x in gw.audit_records() if x.get("host") == SNEAKY and x.get("sandbox") == T_SANDBOX]
    assert not any(x.get("upstream") for x in recs), recs
    assert "rdc-t-" not in lab.logs("upstream")
    # control
    r = _sandbox_curl(lab, net, "https://api.allowed.test/rdc-t-ok", "--resolve", "api.allowed.test:443:198.18.0.10")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("200"), (r, gw.log())


FLIP = "rdc-flip.allowed.test"   # alternates an allowed address and DENIED_IP, TTL 0


def test_a_rebinding_answer_into_a_deny_cidr_is_never_sent_a_request(gw):
    """The decision's answer and the connect's may differ (TTL 0): on the fast path only the decided
    (filtered) addresses are dialled; through mitmproxy, which resolves again, the address it
    connected to is checked before a byte is sent."""
    gw.lab.set_zone(FLIP, {"alternate": ["198.18.0.10", DENIED_IP]})
    try:
        results = [gw.curl(f"http://{FLIP}/rdc-flip-{i}") for i in range(6)]
    finally:
        gw.lab.set_zone(FLIP, None)
    # (through mitmproxy the rotation keeps step: the decision sees the allowed answer, the connect the
    # denied one, so every request is refused there, 502; on the fast path every other one is answered)
    assert all(r.status in (200, 403, 502) for r in results), results
    recs = [r for r in gw.audit_records() if r.get("host") == FLIP]
    upstreams = [r["upstream"] for r in recs if r.get("upstream")]
    assert all(u.startswith("198.18.0.10:") for u in upstreams), upstreams
    assert any(r.get("reason") == "resolved_global_deny" for r in recs), recs
    reached = [line for line in gw.lab.logs("upstream").splitlines() if "rdc-flip" in line]
    assert not any(line.startswith("denied.test ") for line in reached), reached


def test_sandbox_dns_answers_no_address_in_a_deny_cidr(tlab):
    gw, _, net = tlab
    argv = ["nsenter", f"--net=/run/netns/{net.netns}", "dig", "+time=3", "+tries=2", f"@{HUB_IP}"]
    r = subprocess.run([*argv, SNEAKY], capture_output=True, text=True, timeout=20, env=_NO_PROXY_ENV)
    assert r.returncode == 0 and "status: NOERROR" in r.stdout and DENIED_IP not in r.stdout, (r, gw.log())
    rec = gw.wait_record(lambda x: x["event"] == "dns" and x.get("host") == SNEAKY and x.get("decision") == "deny")
    assert rec["reason"] == "resolved_global_deny" and rec["extra"]["rule"] == f"{DENIED_IP}/32", rec
    ok = subprocess.run([*argv, "+short", "api.allowed.test"], capture_output=True, text=True, timeout=20,
                        env=_NO_PROXY_ENV)
    assert ok.stdout.split() == ["198.18.0.10"], ok


def _reloads(gw) -> float:
    import re
    text = gw.ops_status("/metrics")[1]
    m = re.search(r'^cubegate_policy_reloads_total\{result="ok"\} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _write_and_wait(gw, path, text: str) -> None:
    import time as _time
    before = _reloads(gw)
    path.write_text(text)
    deadline = _time.monotonic() + 10
    while _reloads(gw) <= before:
        assert _time.monotonic() < deadline, "policy not reloaded"
        _time.sleep(0.1)


def test_a_deny_cidr_added_later_closes_open_connections_to_names_resolving_into_it(gw):
    """Revocation re-decides an open connection by its name and by the address it is connected to."""
    from tests.gateway.test_fastpath_policy import _hold_then

    policy_file = gw.policy_dir / "rdc.yaml"
    widened = POLICY.replace(f"denied_cidrs: [{DENIED_IP}/32]", f"denied_cidrs: [{DENIED_IP}/32, 198.18.0.10/32]")
    assert widened != POLICY

    def change():
        _write_and_wait(gw, policy_file, widened)
        return 200

    try:
        held = _hold_then(gw, "api.allowed.test", change)
    finally:
        _write_and_wait(gw, policy_file, POLICY)
    assert held["closed"] and held["after_s"] < 3, held
    gw.wait_record(lambda r: r.get("host") == "api.allowed.test" and r.get("reason") == "policy_revoked")
