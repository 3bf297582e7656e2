"""Deny CIDRs hold for the IPv6 forms that carry an IPv4 address (pure): 6to4 2002:WWXX:YYZZ::/48,
NAT64 64:ff9b::/96, Teredo 2001:0::/32 (client address inverted), IPv4-compatible ::a.b.c.d — as
resolved addresses (address_denial) and as IP literals (decide), for the policy's global
`denied_cidrs`, its deny rules' `cidrs` and the sandbox's network-options deny entries. The
unwrapping is netguard's (one way); allows match the address as written only."""
import ipaddress

import pytest

from egress.netguard import AddressGuard, embedded_ipv4
from egress.policy.effective import EffectivePolicy
from egress.policy.model import RequestInfo
from egress.policy.network import parse_network

POLICY = """
name: admin
default: deny
rules:
  - {name: v6-literals, action: allow, match: {cidrs: ["2002::/16", "64:ff9b::/96", "2001::/32", "::/96"]}}
  - {name: no-doc-2, action: deny, match: {cidrs: [198.51.100.0/24]}}
  - {name: names, action: allow, match: {hosts: ["*.example.test"]}}
global: {denied_cidrs: [203.0.113.0/24]}
"""

# 203.0.113.1 = cb00:7101; Teredo carries it inverted (34ff:8efe)
FORMS_OF_203_0_113_1 = ["2002:cb00:7101::1", "64:ff9b::cb00:7101", "2001:0:4136:e378:8000:63bf:34ff:8efe",
                        "::203.0.113.1"]
FORMS_OF_198_51_100_1 = ["2002:c633:6401::1", "64:ff9b::c633:6401"]
FORMS_OF_192_0_2_9 = ["2002:c000:209::1", "64:ff9b::c000:209"]   # covered by no deny


@pytest.fixture
def admin(load):
    return load(POLICY)


def _literal(policy, ip: str, sandbox: str = "sb-1"):
    return policy.decide(RequestInfo(sandbox_id=sandbox, labels={}, host=f"[{ip}]", port=443, is_ip_literal=True))


@pytest.mark.parametrize("ip", FORMS_OF_203_0_113_1)
def test_the_unwrapping_is_netguards_and_finds_the_ipv4(ip):
    assert embedded_ipv4(ipaddress.ip_address(ip)) == ipaddress.IPv4Address("203.0.113.1")


@pytest.mark.parametrize("ip", ["::1", "::", "2a00:1450::1", "203.0.113.1"])
def test_addresses_carrying_no_ipv4_are_themselves(ip):
    assert embedded_ipv4(ipaddress.ip_address(ip)) is None


@pytest.mark.parametrize("ip", FORMS_OF_203_0_113_1)
def test_a_global_deny_cidr_covers_the_ipv6_forms_resolved_and_literal(admin, ip):
    assert admin.address_denial("sb-1", ip, 443) == ("resolved_global_deny", "203.0.113.0/24")
    assert _literal(admin, ip).reason == "global_deny"


@pytest.mark.parametrize("ip", FORMS_OF_198_51_100_1)
def test_a_deny_rules_cidr_covers_the_ipv6_forms_of_a_literal(admin, ip):
    d = _literal(admin, ip)
    assert not d.allowed and d.reason == "rule_deny" and d.rule == "no-doc-2", d


@pytest.mark.parametrize("ip", FORMS_OF_192_0_2_9)
def test_forms_of_an_undenied_ipv4_are_decided_as_written(admin, ip):
    assert admin.address_denial("sb-1", ip, 443) is None
    d = _literal(admin, ip)
    assert d.allowed and d.rule == "v6-literals", d


def test_network_deny_entries_cover_the_ipv6_forms(admin):
    p = EffectivePolicy(admin, None, {"sb-1": parse_network({"deny": ["192.0.2.0/24"]})})
    for ip in FORMS_OF_192_0_2_9:
        assert p.address_denial("sb-1", ip, 443) == ("resolved_sandbox_network_deny", "192.0.2.0/24")
        assert _literal(p, ip).reason == "sandbox_network_deny"
        assert p.address_denial("sb-2", ip, 443) is None        # another sandbox's options


def test_an_allow_cidr_does_not_allow_the_ipv6_forms(load):
    p = load("""
name: v4only
default: deny
rules:
  - {name: v4, action: allow, match: {cidrs: [192.0.2.0/24]}}
""")
    for ip in FORMS_OF_192_0_2_9:
        assert _literal(p, ip).reason == "ip_literal_not_allowed"


@pytest.mark.parametrize("ip, reason", [
    ("2001::1", "reserved"), ("::1", "loopback"), ("::", "unspecified"),
    ("::127.0.0.1", "loopback"), ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),   # Teredo to 127.0.0.1
    ("::8.8.8.8", "reserved"), ("2001:0:4136:e378:8000:63bf:f7f7:f7f7", "reserved"),   # still refused
])
def test_the_guard_still_refuses_teredo_and_ipv4_compatible(ip, reason):
    assert AddressGuard().check(ip) == reason
