"""Grants and per-sandbox network options on top of the admin policies (pure, table-tested).

The network options only narrow: whatever they list, a destination the admin
policies deny stays denied; global deny and invalid input are final."""
import pytest

from egress.policy import PolicyError
from egress.policy.effective import EffectivePolicy
from egress.policy.grants import GrantIndex, parse_grant
from egress.policy.network import parse_entry, parse_network
from policy_testlib import req

ADMIN = """
name: admin
default: deny
rules:
  - {name: api, action: allow, match: {hosts: [api.x.test], ports: [443]}}
  - {name: gh, action: allow, match: {hosts: ["*.gh.test"]}}
  - {name: lab, action: allow, match: {cidrs: [198.18.0.0/24], ports: [443]}}
  - {name: no-admin, action: deny, match: {hosts: [admin.gh.test]}}
global: {denied_domains: ["*.banned.test"]}
"""
REPORT = """
name: rep
applies_to: {sandboxes: [sb-rep]}
mode: report
default: deny
rules: []
"""


@pytest.fixture
def admin(load):
    return load(ADMIN)


def eff(admin, network=None, grants=()):
    nets = {"sb-1": parse_network(network)} if network is not None else {}
    return EffectivePolicy(admin, GrantIndex(parse_grant(n, d) for n, d in grants), nets)


NARROW = [
    # (network options, host, port, expected action, expected reason)
    (None, "api.x.test", 443, "allow", "rule_allow"),
    ({"allow": ["api.x.test:443"]}, "api.x.test", 443, "allow", "rule_allow"),
    ({"allow": ["api.x.test:443"]}, "a.gh.test", 443, "deny", "sandbox_network_not_allowed"),
    ({"allow": ["api.x.test"]}, "api.x.test", 443, "allow", "rule_allow"),
    ({"allow": ["api.x.test:8443"]}, "api.x.test", 443, "deny", "sandbox_network_not_allowed"),
    ({"deny": ["*.gh.test"]}, "a.gh.test", 443, "deny", "sandbox_network_deny"),
    ({"deny": ["*.gh.test"]}, "api.x.test", 443, "allow", "rule_allow"),
    ({"deny": ["a.gh.test:80"]}, "a.gh.test", 443, "allow", "rule_allow"),
    ({"deny": ["a.gh.test:80"]}, "a.gh.test", 80, "deny", "sandbox_network_deny"),
    ({"allow": ["198.18.0.0/28:443"]}, "198.18.0.10", 443, "allow", "rule_allow"),
    ({"allow": ["198.18.0.0/28:443"]}, "198.18.0.20", 443, "deny", "sandbox_network_not_allowed"),
    ({"deny": ["198.18.0.10"]}, "198.18.0.10", 443, "deny", "sandbox_network_deny"),
    # never widens: the sandbox's allow list cannot add what the admin policy denies
    ({"allow": ["denied.test"]}, "denied.test", 443, "deny", "default_deny"),
    ({"allow": ["*.test"]}, "denied.test", 443, "deny", "default_deny"),
    ({"allow": ["admin.gh.test"]}, "admin.gh.test", 443, "deny", "rule_deny"),
    ({"allow": ["api.x.test:80"]}, "api.x.test", 80, "deny", "default_deny"),
    ({"allow": ["10.0.0.0/8"]}, "10.1.2.3", 443, "deny", "ip_literal_not_allowed"),
    ({"allow": ["0.0.0.0/0", "*.banned.test"]}, "a.banned.test", 443, "deny", "global_deny"),
    ({"allow": ["metadata.google.internal"]}, "metadata.google.internal", 80, "deny", "global_deny"),
    ({"allow": ["169.254.169.254"]}, "169.254.169.254", 80, "deny", "global_deny"),
]


@pytest.mark.parametrize("network,host,port,action,reason", NARROW)
def test_network_options_only_narrow(admin, network, host, port, action, reason):
    ip = host[0].isdigit()
    d = eff(admin, network).decide(req(host, port, ip=ip))
    assert (d.action, d.reason) == (action, reason)
    # the property behind the table: never allowed where the admin policy alone denies
    if not admin.decide(req(host, port, ip=ip)).allowed:
        assert not d.allowed


def test_network_options_belong_to_their_sandbox(admin):
    e = eff(admin, {"allow": ["api.x.test"]})
    assert e.decide(req("a.gh.test", sb="sb-2")).allowed
    assert not e.decide(req("a.gh.test", sb="sb-1")).allowed


GRANTS = [
    # (grant doc, request, expected action, expected reason)
    ({"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"], "ports": [443]},
     dict(host="new.test"), "allow", "grant_allow"),
    ({"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"], "ports": [443]},
     dict(host="new.test", port=80), "deny", "default_deny"),
    ({"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"], "ports": [443]},
     dict(host="new.test", sb="sb-2"), "deny", "default_deny"),
    ({"applies_to": {"labels": {"tenant": "acme"}}, "hosts": ["new.test"]},
     dict(host="new.test", sb="sb-9", labels={"tenant": "acme"}), "allow", "grant_allow"),
    ({"applies_to": {"labels": {"tenant": "acme"}}, "hosts": ["new.test"]},
     dict(host="new.test", sb="sb-9", labels={"tenant": "other"}), "deny", "default_deny"),
    ({"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["admin.gh.test"]},
     dict(host="admin.gh.test"), "allow", "grant_allow"),           # an approved exception to a rule deny
    ({"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["x.banned.test"]},
     dict(host="x.banned.test"), "deny", "global_deny"),            # never past a global deny
    ({"applies_to": {"sandboxes": ["sb-rep"]}, "hosts": ["r.test"]},
     dict(host="r.test", sb="sb-rep"), "allow", "grant_allow"),     # report mode: no would-deny left
]


@pytest.mark.parametrize("doc,request_,action,reason", GRANTS)
def test_grants(load, tmp_path, doc, request_, action, reason):
    from egress.policy import load_policy_files
    from policy_testlib import write
    admin = load_policy_files([write(tmp_path, "a.yaml", ADMIN), write(tmp_path, "r.yaml", REPORT)])
    d = eff(admin, grants=[("grant.t", doc)]).decide(req(**request_))
    assert (d.action, d.reason) == (action, reason)
    assert not d.would_deny or action == "deny"


def test_a_grant_does_not_pass_the_sandbox_network_options(admin):
    grant = ("g", {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"]})
    d = eff(admin, {"deny": ["new.test"]}, [grant]).decide(req("new.test"))
    assert (d.action, d.reason) == ("deny", "sandbox_network_deny")


def test_dns_follows_narrowing_and_grants(admin):
    e = eff(admin, {"allow": ["api.x.test:443"]}, [("g", {"applies_to": {"sandboxes": ["sb-2"]},
                                                            "hosts": ["new.test"]})])
    assert e.name_may_resolve("sb-1", {}, "api.x.test")
    assert not e.name_may_resolve("sb-1", {}, "a.gh.test")          # admin allows, the sandbox narrowed it
    assert not e.name_may_resolve("sb-1", {}, "denied.test")
    assert e.name_may_resolve("sb-2", {}, "new.test")                # granted
    assert not e.name_may_resolve("sb-1", {}, "new.test")
    assert e.resolve_scope("sb-2", {}, "new.test") is None           # exact grant: not rate limited


@pytest.mark.parametrize("text,pointer", [
    ("https://x.test/", ""), ("*x.test", ""), ("api.*.x.test", ""), ("10.0.0.300/8", ""), ("x.test:0", ""),
    ("x.test:99999", ""), ("2001:db8::/32", ""), ("[2001:db8::/32", ""), ("*", ""), ("10.0.0.1/8", ""),
])
def test_bad_network_entries_refused(text, pointer):
    with pytest.raises(ValueError):
        parse_entry(text)
    with pytest.raises(PolicyError) as e:
        parse_network({"allow": ["ok.test", text]})
    assert e.value.pointers()[0]["pointer"] == "/allow/1"


def test_network_entry_forms():
    assert parse_entry("[2001:db8::/32]:443").port == 443
    assert parse_entry("198.18.0.10").net.prefixlen == 32
    assert parse_entry("*.x.test:8443").host.wildcard
    with pytest.raises(PolicyError):
        parse_network({"allow": [], "widen": ["x"]})


def test_a_grant_is_not_in_force_past_its_expiry_whatever_the_sweep(admin):
    """decide() takes the time (or reads the injected clock): an expired grant that the
    daemon's sweep has not removed yet — or that a restart loaded back — allows nothing."""
    doc = {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"], "expires": 1000.0}
    now = [999.0]
    e = EffectivePolicy(admin, GrantIndex([parse_grant("g", doc)]), clock=lambda: now[0])
    assert e.decide(req("new.test")).reason == "grant_allow"
    assert e.name_may_resolve("sb-1", {}, "new.test")
    assert e.expired_grants() == ()
    now[0] = 1000.0
    d = e.decide(req("new.test"))
    assert (d.action, d.reason) == ("deny", "default_deny")
    assert not e.name_may_resolve("sb-1", {}, "new.test")
    assert e.expired_grants() == ("g",)
    assert e.decide(req("new.test"), now=500.0).reason == "grant_allow"     # the time passed in wins
    label = parse_grant("t", {"applies_to": {"labels": {"tenant": "acme"}}, "hosts": ["new.test"], "expires": 10.0})
    e2 = EffectivePolicy(admin, GrantIndex([label]), clock=lambda: 11.0)
    assert not e2.decide(req("new.test", labels={"tenant": "acme"})).allowed


def test_an_expired_grant_loaded_after_a_restart_allows_nothing(tmp_path, load):
    from egress.policy.live import LivePolicies
    from egress.policy.reload import PolicyStore
    from egress.policy.repo import PolicyRepo
    from policy_testlib import write
    (tmp_path / "p").mkdir()
    write(tmp_path / "p", "a.yaml", ADMIN)
    repo = PolicyRepo(tmp_path / "policies.db")
    live = LivePolicies(PolicyStore(tmp_path / "p"), repo)
    import time
    live.put_grant("g", {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"], "expires": time.time() + 0.3},
                   actor="t")
    assert live.current.decide(req("new.test")).reason == "grant_allow"
    repo.close()
    time.sleep(0.4)
    repo = PolicyRepo(tmp_path / "policies.db")          # a restart, before any sweep ran
    live = LivePolicies(PolicyStore(tmp_path / "p"), repo)
    assert "g" in live.grants()
    assert live.current.decide(req("new.test")).reason == "default_deny"
    repo.close()
