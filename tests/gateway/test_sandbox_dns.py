"""Sandbox DNS end to end: a sandbox attached to a cubevs switch asks the
gateway's resolver (on the hub gateway address, port 53) and gets answers only
for names its policy allows; everything else is NXDOMAIN and audited."""
from __future__ import annotations

import subprocess

import pytest

from tests.gateway.switchlab import switch_lab

from tests.gateway.test_transparent import _NO_PROXY_ENV

pytestmark = pytest.mark.netns

TPORT = 18076            # below the harness's port range; differs from test_transparent's
HUB_IP = "10.200.0.1"    # cubevs hub gateway address (bound on lo in the gw namespace)
SANDBOX = "sb-dns"
POLICY = """\
name: dns
default: deny
rules:
  - name: lab-api
    action: allow
    match: {hosts: [api.allowed.test], ports: [443, 80]}
  - name: evil-names          # allowed by policy: the private-address guard is what refuses them
    action: allow
    match: {hosts: ["*.evil.test"], ports: [443, 80]}
"""


@pytest.fixture(scope="module")
def dlab(lab, tmp_path_factory):
    with switch_lab(lab, tmp_path_factory.mktemp("dlab"), POLICY, sandbox=SANDBOX, tport=TPORT,
                    prefix="cd", settings_extra={"dns": {"listen_host": HUB_IP, "port": 53}}) as env:
        yield env


def sandbox_dig(net, *args: str) -> subprocess.CompletedProcess:
    argv = ["nsenter", f"--net=/run/netns/{net.netns}", "dig", "+time=2", "+tries=2", f"@{HUB_IP}", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=15, env=_NO_PROXY_ENV)


def test_allowed_name_resolves(dlab):
    gw, _, net = dlab
    r = sandbox_dig(net, "+short", "api.allowed.test")
    assert r.returncode == 0 and r.stdout.split() == ["198.18.0.10"], (r, gw.log())


def test_allowed_name_over_tcp(dlab):
    gw, _, net = dlab
    r = sandbox_dig(net, "+tcp", "+short", "api.allowed.test")
    assert r.returncode == 0 and r.stdout.split() == ["198.18.0.10"], (r, gw.log())


def test_denied_name_is_nxdomain_and_audited(dlab):
    gw, _, net = dlab
    r = sandbox_dig(net, "denied.test")
    assert r.returncode == 0 and "status: NXDOMAIN" in r.stdout, (r, gw.log())
    rec = gw.wait_record(lambda x: x["event"] == "dns" and x.get("host") == "denied.test")
    assert rec["decision"] == "deny" and rec["reason"] == "dns_not_allowed"
    assert rec["sandbox"] == SANDBOX and rec["client"].startswith(net.ip + ":")


def test_allowed_name_with_private_address_gets_no_address(dlab):
    gw, _, net = dlab
    r = sandbox_dig(net, "private.evil.test")
    assert r.returncode == 0 and "status: NOERROR" in r.stdout, (r, gw.log())
    assert "10.0.0.1" not in r.stdout
    short = sandbox_dig(net, "+short", "private.evil.test")
    assert short.stdout.strip() == "", short
    rec = gw.wait_record(lambda x: x["event"] == "dns" and x.get("host") == "private.evil.test")
    assert rec["decision"] == "deny" and rec["reason"].startswith("ssrf_")


def test_other_qtypes_for_allowed_names_are_empty(dlab):
    gw, _, net = dlab
    r = sandbox_dig(net, "TXT", "api.allowed.test")
    assert r.returncode == 0 and "status: NOERROR" in r.stdout and "ANSWER: 0" in r.stdout, r


def test_unknown_source_is_refused(dlab, lab):
    gw, _, _ = dlab
    # From the hub namespace itself: its address is no sandbox in the registry.
    r = subprocess.run(["nsenter", f"--net=/run/netns/{lab.gw_ns}", "dig", "+time=2", "+tries=1",
                        f"@{HUB_IP}", "api.allowed.test"], capture_output=True, text=True, timeout=15)
    assert r.returncode == 0 and "status: REFUSED" in r.stdout, (r, gw.log())
