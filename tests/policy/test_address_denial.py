"""Deny CIDRs on the addresses a name resolved to (pure): the policy's global `denied_cidrs` and
the sandbox's network-options deny address entries hold whatever name led there; allow CIDRs
(rules' `cidrs`, network allow address entries) never widen a name's decision."""
import socket

import pytest

from egress.destination import keep_undenied
from egress.policy.effective import EffectivePolicy
from egress.policy.model import RequestInfo
from egress.policy.network import parse_network

ADMIN = """
name: admin
default: deny
rules:
  - {name: wild, action: allow, match: {hosts: ["*.example.test"]}}
  - {name: net, action: allow, match: {cidrs: [198.51.100.0/24]}}
global: {denied_cidrs: [203.0.113.0/24, "2001:db8:dead::/48"]}
"""
REPORT = """
name: rep
applies_to: {sandboxes: [sb-rep]}
mode: report
default: deny
rules: []
global: {denied_cidrs: [192.0.2.0/24]}
"""


@pytest.fixture
def admin(load):
    return load(ADMIN)


def eff(admin, network=None):
    return EffectivePolicy(admin, None, {"sb-1": parse_network(network)} if network is not None else {})


@pytest.mark.parametrize("ip, expected", [
    ("203.0.113.7", ("resolved_global_deny", "203.0.113.0/24")),
    ("::ffff:203.0.113.7", ("resolved_global_deny", "203.0.113.0/24")),    # mapped: the IPv4 it carries
    ("2001:db8:dead::1", ("resolved_global_deny", "2001:db8:dead::/48")),
    ("169.254.169.254", ("resolved_global_deny", "169.254.169.254/32")),    # built-in metadata address
    ("203.0.114.1", None),
    ("198.51.100.1", None),
    ("not-an-address", ("resolved_global_deny", None)),                     # unreadable: fail closed
])
def test_global_denied_cidrs_cover_resolved_addresses(admin, ip, expected):
    assert admin.address_denial("sb-1", ip, 443) == expected
    assert eff(admin).address_denial("sb-1", ip, 443) == expected


def test_network_deny_address_entries_cover_resolved_addresses_on_their_port(admin):
    p = eff(admin, {"deny": ["198.51.100.0/24:443", "10.9.0.0/16", "deny.example.test"]})
    assert p.address_denial("sb-1", "198.51.100.9", 443) == ("resolved_sandbox_network_deny", "198.51.100.0/24:443")
    assert p.address_denial("sb-1", "198.51.100.9", 80) is None            # the entry names one port
    assert p.address_denial("sb-1", "198.51.100.9", None) is None          # DNS: some port may pass
    assert p.address_denial("sb-1", "10.9.1.1", None) == ("resolved_sandbox_network_deny", "10.9.0.0/16")
    assert p.address_denial("sb-2", "10.9.1.1", 443) is None               # another sandbox's options
    # the global deny comes first
    assert p.address_denial("sb-1", "203.0.113.1", 443)[0] == "resolved_global_deny"


def test_allow_cidrs_never_widen_a_name(admin):
    """An allow address entry (network options) or a `cidrs` rule decides IP literals only: a name
    that resolves into it is decided by its name, and the address check only ever denies."""
    p = eff(admin, {"allow": ["198.51.100.0/24"]})
    d = p.decide(RequestInfo("sb-1", {}, "a.example.test", 443, None, None, None, False))
    assert d.action == "deny" and d.reason == "sandbox_network_not_allowed"
    other = admin.decide(RequestInfo("sb-1", {}, "other.test", 443, None, None, None, False))
    assert other.action == "deny" and other.reason == "default_deny"   # no cidrs rule applies to a name
    assert p.address_denial("sb-1", "198.51.100.1", 443) is None


def test_keep_undenied_keeps_only_addresses_outside_the_ranges(admin):
    p = eff(admin, {"deny": ["198.51.100.0/24"]})
    allowed = p.decide(RequestInfo("sb-1", {}, "a.example.test", 443, None, None, None, False))
    answers = [(socket.AF_INET, "203.0.113.1"), (socket.AF_INET, "198.51.100.1"), (socket.AF_INET, "8.8.8.8")]
    kept, denied = keep_undenied(p, "sb-1", allowed, answers, 443)
    assert kept == ((socket.AF_INET, "8.8.8.8"),) and denied is None
    kept, denied = keep_undenied(p, "sb-1", allowed, answers[:2], 443)
    assert kept == ()
    assert (denied.action, denied.reason, denied.rule, denied.policy, denied.mode) == \
        ("deny", "resolved_global_deny", "203.0.113.0/24", "global", "enforce")
    kept, denied = keep_undenied(p, "sb-1", allowed, answers[1:2], 443)
    assert (denied.reason, denied.rule, denied.policy) == \
        ("resolved_sandbox_network_deny", "198.51.100.0/24", "network:sb-1")


def test_a_report_mode_policy_still_enforces_resolved_deny_cidrs(load, tmp_path):
    from egress.policy.loader import load_policy_files
    (tmp_path / "a.yaml").write_text(ADMIN)
    (tmp_path / "r.yaml").write_text(REPORT)
    p = EffectivePolicy(load_policy_files([tmp_path / "a.yaml", tmp_path / "r.yaml"]))
    d = p.decide(RequestInfo("sb-rep", {}, "x.test", 443, None, None, None, False))
    assert d.action == "allow" and d.would_deny
    kept, denied = keep_undenied(p, "sb-rep", d, [(socket.AF_INET, "192.0.2.5")], 443)
    assert kept == () and denied.action == "deny" and denied.mode == "enforce"
