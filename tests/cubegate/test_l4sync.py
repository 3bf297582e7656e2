"""The switch's per-sandbox L4 allow list comes from the same effective decision as the
gateway's (attack pass 2, finding 1): admin policy, grants, the sandbox's network options.
Pure: EffectivePolicy objects in, (cidr, port, proto) tuples out."""
import pytest

from cubegate.l4sync import l4_allow_for
from egress.netguard import AddressGuard
from egress.policy import RequestInfo, load_policy_files
from egress.policy.effective import EffectivePolicy
from egress.policy.grants import GrantIndex, parse_grant
from egress.policy.network import parse_network

ADMIN = """\
name: acme
default: deny
rules:
  - {name: web, action: allow, match: {hosts: [api.allowed.test], ports: [443, 80]}}
  - {name: db, action: allow, match: {cidrs: [198.18.0.20/32], ports: [5432]}}
  - {name: lab, action: allow, match: {cidrs: [10.9.0.0/24]}}
  - {name: no-ssh, action: deny, match: {cidrs: [10.9.0.128/25], ports: [22]}}
"""


# the ranges these tables use are private (or benchmarking): exempt, as upstream.allow_cidrs would
GUARD = AddressGuard(allow_cidrs=["10.0.0.0/8", "198.18.0.0/15"])


@pytest.fixture
def admin(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(ADMIN)
    return load_policy_files([p])


def eff(admin, network=None, grants=(), now=100.0):
    nets = {"sb": parse_network(network)} if network is not None else {}
    return EffectivePolicy(admin, GrantIndex(parse_grant(n, d) for n, d in grants), nets, clock=lambda: now)


def test_without_options_the_admin_rules_open_their_cidrs(admin):
    got = l4_allow_for(eff(admin), "sb", {}, guard=GUARD)
    assert ("198.18.0.20/32", 5432, "tcp") in got
    assert ("10.9.0.0/25", 0, "tcp") in got                      # the half no rule denies: any port
    # the half with a port-22 deny: every other named port, never "any port" (that would open 22)
    assert ("10.9.0.128/25", 0, "tcp") not in got and ("10.9.0.128/25", 22, "tcp") not in got
    assert ("10.9.0.128/25", 5432, "tcp") in got


@pytest.mark.parametrize("network", [
    {"allow": ["api.allowed.test:443"]},          # an allow list of names admits no address
    {"deny": ["198.18.0.20/32"]},
    {"deny": ["198.18.0.20:5432"]},
    {"deny": ["[::ffff:198.18.0.20]"]},           # the mapped spelling of the same address
    {"allow": ["198.18.0.20:443"]},               # another port
    {"deny": ["0.0.0.0/0"]},
])
def test_network_options_narrow_the_direct_path(admin, network):
    got = l4_allow_for(eff(admin, network), "sb", {}, guard=GUARD)
    assert ("198.18.0.20/32", 5432, "tcp") not in got, got


def test_narrowing_cuts_a_cidr_at_the_entry(admin):
    got = l4_allow_for(eff(admin, {"deny": ["10.9.0.64/26"]}), "sb", {}, guard=GUARD)
    assert ("10.9.0.0/26", 0, "tcp") in got and not any(e[0] == "10.9.0.64/26" for e in got)
    got = l4_allow_for(eff(admin, {"allow": ["10.9.0.8/29:6379"]}), "sb", {}, guard=GUARD)
    assert got == [("10.9.0.8/29", 6379, "tcp")]


def test_every_entry_is_what_the_gateway_decides(admin):
    """The property behind the table: an address of an entry, on its port, is allowed by decide()."""
    for network in (None, {"deny": ["10.9.0.64/26", "10.9.0.3:5432"]}, {"allow": ["10.9.0.0/28", "198.18.0.20"]}):
        e = eff(admin, network)
        for cidr, port, _ in l4_allow_for(e, "sb", {}, guard=GUARD):
            import ipaddress
            net = ipaddress.ip_network(cidr)
            for addr in (net.network_address, net.broadcast_address):
                for p in ([port] if port else [22, 5432, 6379, 40000]):
                    assert e.decide(RequestInfo("sb", {}, str(addr), p, is_ip_literal=True)).allowed, (cidr, port, p)


def test_a_grant_with_cidrs_opens_its_path_until_it_expires(admin):
    g = ("g", {"applies_to": {"sandboxes": ["sb"]}, "cidrs": ["198.18.0.30/32"], "ports": [6379], "expires": 200.0})
    assert ("198.18.0.30/32", 6379, "tcp") in l4_allow_for(eff(admin, grants=[g], now=100.0), "sb", {}, guard=GUARD)
    assert ("198.18.0.30/32", 6379, "tcp") not in l4_allow_for(eff(admin, grants=[g], now=200.0), "sb", {}, guard=GUARD)
    assert ("198.18.0.30/32", 6379, "tcp") not in l4_allow_for(eff(admin, grants=[g]), "other", {}, guard=GUARD)
    # a grant does not pass the sandbox's own network options
    assert ("198.18.0.30/32", 6379, "tcp") not in l4_allow_for(
        eff(admin, {"deny": ["198.18.0.30"]}, grants=[g]), "sb", {}, guard=GUARD)


def test_global_deny_cuts_the_direct_path(tmp_path):
    p = tmp_path / "g.yaml"
    p.write_text("name: g\ndefault: deny\nrules:\n  - {name: a, action: allow, match: {cidrs: [10.0.0.0/8]}}\n"
                 "global: {denied_cidrs: [10.1.0.0/16]}\n")
    got = l4_allow_for(load_policy_files([p]), "sb", {}, guard=GUARD)
    assert got and not any(e[0].startswith("10.1.") for e in got)
    assert ("10.0.0.0/16", 0, "tcp") in got
