"""Sandbox DNS end to end: a sandbox attached to a cubevs switch asks the
gateway's resolver (on the hub gateway address, port 53) and gets answers only
for names its policy allows; everything else is NXDOMAIN and audited. Allowed
answers are audited aggregated; new names under a wildcard are rate limited."""
from __future__ import annotations

import subprocess
import time
import uuid

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
  - name: wild                # an attacker's authoritative server answers every name below it
    action: allow
    match: {hosts: ["*.wild.test"], ports: [443]}
"""
NAME_LIMIT = 5                # dns.max_new_names_per_minute for this module
WILD_ADDR = "198.18.0.10"


@pytest.fixture(scope="module")
def dlab(lab, tmp_path_factory):
    lab.set_zone("*.wild.test", [WILD_ADDR])
    dns = {"listen_host": HUB_IP, "port": 53, "audit_interval_seconds": 1.0,
           "max_new_names_per_minute": NAME_LIMIT}
    try:
        with switch_lab(lab, tmp_path_factory.mktemp("dlab"), POLICY, sandbox=SANDBOX, tport=TPORT,
                        prefix="cd", settings_extra={"dns": dns}) as env:
            yield env
    finally:
        lab.set_zone("*.wild.test", None)


def sandbox_dig(net, *args: str, tries: int = 2) -> subprocess.CompletedProcess:
    argv = ["nsenter", f"--net=/run/netns/{net.netns}", "dig", "+time=3", f"+tries={tries}", f"@{HUB_IP}", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, env=_NO_PROXY_ENV)


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


def _upstream_saw(lab, name: str) -> bool:
    """The lab's authoritative server logs every query it gets: "query A <name> from ..."."""
    return any(f" {name} from " in line for line in lab.logs("dns").splitlines())


def _sum(records, key: str) -> int:
    return sum(r["extra"][key] for r in records)


def test_new_names_under_a_wildcard_are_limited_audited_and_never_forwarded(dlab, lab):
    gw, sw, net = dlab
    run = uuid.uuid4().hex[:8]
    names = [f"x{i}-{run}.wild.test" for i in range(NAME_LIMIT + 3)]
    answers = [sandbox_dig(net, "+short", n, tries=1) for n in names]      # one query each: exact counts
    assert [a.stdout.split() for a in answers[:NAME_LIMIT]] == [[WILD_ADDR]] * NAME_LIMIT, (answers, gw.log())
    for a in answers[NAME_LIMIT:]:
        assert a.returncode == 0 and a.stdout.strip() == "", a
    refused = sandbox_dig(net, names[-1], tries=1)
    assert "status: NXDOMAIN" in refused.stdout, refused
    # The first refusal is audited at once, with the wildcard that allowed the name.
    first = gw.wait_record(lambda x: x["event"] == "dns" and x.get("host") == names[NAME_LIMIT])
    assert (first["decision"], first["reason"], first["sandbox"]) == ("deny", "dns_name_rate_limited", SANDBOX)
    assert first["extra"]["scope"] == "*.wild.test" and first["extra"]["limit_per_minute"] == NAME_LIMIT
    # The upstream resolver never saw the refused names (it did see the admitted ones).
    lab.wait_logs("dns", lambda _: all(_upstream_saw(lab, n) for n in names[:NAME_LIMIT]))
    assert not any(_upstream_saw(lab, n) for n in names[NAME_LIMIT:])
    # An admitted name keeps resolving (repeats are not new names); an exact host is never limited.
    assert sandbox_dig(net, "+short", names[0], tries=1).stdout.split() == [WILD_ADDR]
    assert sandbox_dig(net, "+short", "api.allowed.test", tries=1).stdout.split() == ["198.18.0.10"]

    # Another sandbox has its own budget under the same wildcard.
    other = sw.attach_sandbox(f"sb-dns2-{run[:4]}")
    try:
        fresh = f"other-{run}.wild.test"
        r = sandbox_dig(other, "+short", fresh, tries=1)
        assert r.stdout.split() == [WILD_ADDR], (r, gw.log())
        rec = gw.wait_record(lambda x: x["event"] == "dns" and x.get("host") == fresh
                             and x["reason"] == "dns_allowed", timeout=10)
        assert rec["sandbox"] == other.sandbox_id and rec["extra"]["queries"] == 1
    finally:
        sw.detach_sandbox(other.sandbox_id)

    # Aggregated records (one per sandbox+name per 1 s interval) carry exact counts.
    def allowed(name):
        return [x for x in gw.audit_records() if x["event"] == "dns" and x.get("host") == name
                and x["reason"] == "dns_allowed" and x["sandbox"] == SANDBOX]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _sum(allowed(names[0]), "queries") < 2:
        time.sleep(0.2)
    recs = allowed(names[0])
    assert _sum(recs, "queries") == 2 and _sum(recs, "answers") == 2, recs
    assert all(r["decision"] == "allow" and r["extra"]["scope"] == "*.wild.test" for r in recs)
    assert sum(int(r["extra"]["qtypes"].removeprefix("A=")) for r in recs) == 2, recs   # "A=<n>" only
    assert all(len(allowed(n)) >= 1 for n in names[1:NAME_LIMIT])
    assert not any(allowed(n) for n in names[NAME_LIMIT:])             # refused names are no answers
    summaries = [x for x in gw.audit_records() if x.get("host") == "*.wild.test" and x["sandbox"] == SANDBOX
                 and x["reason"] == "dns_name_rate_limited"]
    assert _sum(summaries, "refused") == 4, summaries                  # 3 names + the second ask
    exact = [x for x in gw.audit_records() if x.get("host") == "api.allowed.test" and x["reason"] == "dns_allowed"]
    assert exact and all(x["extra"]["scope"] is None for x in exact)
    metrics = gw.ops("/metrics").stdout
    assert f'cubegate_dns_queries_total{{result="rate_limited",sandbox="{SANDBOX}"}} 4.0' in metrics, metrics
    assert 'cubegate_dns_audit_records_total{kind="dns_allowed"}' in metrics
