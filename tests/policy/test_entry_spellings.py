"""Network entries, grant CIDRs and policy CIDRs are normalised the way requests are
(attack pass 2, finding 5): an entry in one spelling must match a request in another
spelling of the same destination, or be refused when it is set — never accepted and
silently void (a void deny entry is a fail-open)."""
import ipaddress

import pytest

from egress.policy import PolicyError, RequestInfo
from egress.policy.effective import EffectivePolicy
from egress.policy.grants import GrantIndex, parse_grant
from egress.policy.hosts import normalize_host_addr, parse_cidr
from egress.policy.network import parse_entry, parse_network

ADMIN = """
name: admin
default: deny
rules:
  - {name: lab, action: allow, match: {cidrs: [198.18.0.0/24], ports: [443]}}
  - {name: api, action: allow, match: {hosts: [api.x.test, xn--bcher-kva.test]}}
"""

# (entry as written, request host as sent): the same destination
SAME = [
    ("[::ffff:198.18.0.10]", "198.18.0.10"),
    ("[::ffff:198.18.0.10]", "[::ffff:198.18.0.10]"),
    ("198.18.0.10", "[::ffff:198.18.0.10]"),
    ("[::ffff:c612:a]", "198.18.0.10"),
    ("[::ffff:198.18.0.0/120]", "198.18.0.77"),
    ("API.X.TEST.", "api.x.test"),
    ("api.x.test", "API.X.TEST."),
    ("bücher.test", "xn--bcher-kva.test"),
    ("xn--bcher-kva.test", "BÜCHER.test"),
]


@pytest.mark.parametrize("entry,host", SAME)
def test_deny_entry_denies_every_spelling_of_its_destination(load, entry, host):
    eff = EffectivePolicy(load(ADMIN), networks={"sb-1": parse_network({"deny": [entry]})})
    ip = normalize_host_addr(host)[1] is not None
    d = eff.decide(RequestInfo("sb-1", {}, host, 443, is_ip_literal=ip))
    assert (d.action, d.reason) == ("deny", "sandbox_network_deny"), (entry, host)


@pytest.mark.parametrize("entry,host", SAME)
def test_allow_entry_admits_every_spelling_of_its_destination(load, entry, host):
    eff = EffectivePolicy(load(ADMIN), networks={"sb-1": parse_network({"allow": [entry]})})
    ip = normalize_host_addr(host)[1] is not None
    assert eff.decide(RequestInfo("sb-1", {}, host, 443, is_ip_literal=ip)).allowed, (entry, host)


# spellings a request can never take (the request side refuses them as invalid_host):
# an entry in such a spelling could only ever match nothing, so it is refused when set
NEVER_A_REQUEST = ["[fe80::1%eth0]", "[fe80::%eth0/64]", "127.1", "0x7f.0.0.1", "0x7f000001", "2130706433",
                   "010.0.0.1", "198.18.0.10.", "[::ffff:0:0/95]", "0177.0.0.1"]


@pytest.mark.parametrize("entry", NEVER_A_REQUEST)
def test_entries_in_spellings_no_request_takes_are_refused(entry):
    with pytest.raises(ValueError):
        parse_entry(entry)
    with pytest.raises(PolicyError):
        parse_network({"deny": [entry]})


@pytest.mark.parametrize("entry", NEVER_A_REQUEST[:3] + ["::ffff:198.18.0.10/128"])
def test_request_side_agrees(entry):
    """The same spellings as requests: invalid (or, for mapped IPv6, the IPv4 address)."""
    host = entry.strip("[]")
    if host.startswith("::ffff:"):
        assert parse_cidr(host) == ipaddress.ip_network("198.18.0.10/32")
        return
    try:
        _, addr = normalize_host_addr(entry)
    except ValueError:
        return
    assert addr is None or "%" not in str(addr)


def test_mapped_ipv6_in_grants_and_policy_cidrs_means_the_ipv4_network(load):
    g = parse_grant("g", {"applies_to": {"sandboxes": ["sb-1"]}, "cidrs": ["::ffff:198.18.1.0/120"], "ports": [443]})
    assert g.cidrs == (ipaddress.ip_network("198.18.1.0/24"),)
    eff = EffectivePolicy(load(ADMIN), GrantIndex([g]))
    assert eff.decide(RequestInfo("sb-1", {}, "198.18.1.9", 443, is_ip_literal=True)).reason == "grant_allow"
    denied = load("""
name: d
default: deny
rules:
  - {name: lab, action: allow, match: {cidrs: ["198.18.0.0/24"]}}
global: {denied_cidrs: ["::ffff:198.18.0.16/124"]}
""", "d.yaml")
    assert denied.decide(RequestInfo("sb-1", {}, "198.18.0.20", 443, is_ip_literal=True)).reason == "global_deny"
    with pytest.raises(PolicyError):
        load("""
name: z
default: deny
rules:
  - {name: z, action: deny, match: {cidrs: ["fe80::%eth0/64"]}}
""", "z.yaml")


def test_ipv6_ranges_containing_the_mapped_range_stay_ipv6():
    """::/0 is "all of IPv6": IPv4-mapped requests are IPv4 requests (documented)."""
    assert parse_cidr("::/0") == ipaddress.ip_network("::/0")
