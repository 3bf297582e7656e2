"""Transparent mode end to end: a sandbox with no proxy settings, attached to a
cubevs switch whose hub is the lab's gw namespace, reaches the lab upstream
through the real gateway process; identity by source address, destination by
SNI/Host (resolved by the gateway), same policy and audit as explicit mode."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.gateway.switchlab import switch_lab


pytestmark = pytest.mark.netns

TPORT = 18075            # below the harness's port range (18080 + 10 n)
SANDBOX = "sb-t1"
POLICY = """\
name: transparent
default: deny
rules:
  - name: lab-api
    action: allow
    match: {hosts: [api.allowed.test], ports: [443, 80]}
"""
_NO_PROXY_ENV = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}



@pytest.fixture(scope="module")
def tlab(lab, tmp_path_factory):
    """Switch in the lab's gw namespace + one sandbox + a gateway with a transparent listener."""
    with switch_lab(lab, tmp_path_factory.mktemp("tlab"), POLICY, sandbox=SANDBOX, tport=TPORT,
                    prefix="cg") as env:
        yield env


def sandbox_curl(lab, net, url: str, *args: str, timeout: float = 5) -> subprocess.CompletedProcess:
    argv = ["nsenter", f"--net=/run/netns/{net.netns}", "curl", "-sS", "--max-time", str(timeout),
            "--cacert", str(lab.ca.bundle_path), "-o", "/dev/stdout", "-w", "\n%{http_code}", *args, url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 5, env=_NO_PROXY_ENV)


def _ok(r: subprocess.CompletedProcess) -> bool:
    return r.returncode == 0 and r.stdout.rstrip().endswith("200")


def test_https_passthrough_identified_by_source_address(tlab, lab):
    gw, _, net = tlab
    r = sandbox_curl(lab, net, "https://api.allowed.test/t-pass", "--resolve", "api.allowed.test:443:198.18.0.10")
    assert _ok(r), (r, gw.log())
    assert '"path": "/t-pass"' in r.stdout
    dec = gw.wait_record(lambda x: x["event"] == "decision" and x.get("sandbox") == SANDBOX
                         and x.get("host") == "api.allowed.test" and x.get("port") == 443)
    assert dec["decision"] == "allow" and dec["rule"] == "lab-api" and dec["sni"] == "api.allowed.test"
    assert dec["client"].startswith(net.ip + ":")
    closed = gw.wait_record(lambda x: x["event"] == "connection_closed" and x.get("sandbox") == SANDBOX
                            and x.get("extra", {}).get("kind") == "passthrough")
    assert closed["upstream"] == "198.18.0.10:443" and closed["bytes_in"] > 0


def test_plain_http_destination_comes_from_host_header_not_the_dialled_ip(tlab, lab):
    gw, _, net = tlab
    # The sandbox dials denied.test's address; the gateway resolves the Host header itself.
    r = sandbox_curl(lab, net, "http://api.allowed.test/t-http", "--resolve", "api.allowed.test:80:198.18.0.12")
    assert _ok(r), (r, gw.log())
    rec = gw.wait_record(lambda x: x["event"] == "request" and x.get("path") == "/t-http")
    assert rec["sandbox"] == SANDBOX and rec["host"] == "api.allowed.test" and rec["decision"] == "allow"
    closed = gw.wait_record(lambda x: x["event"] == "connection_closed" and x.get("sandbox") == SANDBOX
                            and x.get("extra", {}).get("kind") == "http")
    assert closed["upstream"] == "198.18.0.10:80"


def test_denied_host_is_reset_and_audited(tlab, lab):
    gw, _, net = tlab
    r = sandbox_curl(lab, net, "https://denied.test/t-deny-1", "--resolve", "denied.test:443:198.18.0.12")
    # Reset at once (curl 35: TLS connect error / 56: recv failure), not left hanging (28: timeout).
    assert r.returncode in (35, 56), r
    rec = gw.wait_record(lambda x: x["event"] == "decision" and x.get("sandbox") == SANDBOX
                         and x.get("host") == "denied.test")
    assert rec["decision"] == "deny" and rec["reason"] == "default_deny"
    assert "t-deny-1" not in lab.logs("upstream")


def test_sni_decides_even_when_the_sandbox_dials_an_allowed_ip(tlab, lab):
    gw, _, net = tlab
    r = sandbox_curl(lab, net, "https://denied.test/t-deny-2", "--resolve", "denied.test:443:198.18.0.10")
    assert r.returncode in (35, 56), r
    gw.wait_record(lambda x: x["event"] == "decision" and x.get("sni") == "denied.test"
                   and x.get("decision") == "deny" and x.get("reason") == "default_deny")
    recs = [x for x in gw.audit_records() if x.get("sandbox") == SANDBOX and x.get("host") == "denied.test"]
    assert recs and all(x.get("decision") != "allow" for x in recs)
    assert "t-deny-2" not in lab.logs("upstream")


def test_http_without_host_header_is_refused(tlab, lab):
    gw, _, net = tlab
    r = sandbox_curl(lab, net, "http://198.18.0.10/t-nohost", "-H", "Host:")
    assert r.stdout.rstrip().endswith("400"), r
    assert "t-nohost" not in lab.logs("upstream")


def test_gateway_down_means_no_egress_and_restart_restores_it(tlab, lab):
    gw, sw, net = tlab
    args = ("https://api.allowed.test/t-restart", "--resolve", "api.allowed.test:443:198.18.0.10")
    gw.stop()
    try:
        r = sandbox_curl(lab, net, *args, timeout=3)
        assert r.returncode != 0, r
        # Not even a direct path: the switch only lets TCP 80/443 reach the steering.
        r2 = sandbox_curl(lab, net, "http://198.18.0.10:8443/", timeout=2)
        assert r2.returncode != 0, r2
    finally:
        gw.start()
    assert "t-restart" not in lab.logs("upstream")
    assert sw.sandbox(SANDBOX) is not None
    r = sandbox_curl(lab, net, *args)
    assert _ok(r), (r, gw.log())
