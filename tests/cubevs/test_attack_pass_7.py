"""Attack pass 7 on the switch's direct L4 paths: what a `cidrs` rule opens past the gateway.

FINDING: the switch's per-sandbox L4 allow list (cubegate/l4sync.py) followed the policy's
decision alone. The gateway's SSRF guard (private, loopback, link-local, CGNAT, reserved
ranges, its own listeners: refused "independently of policy" on every proxied connection)
was never asked, so an admin rule `cidrs: [0.0.0.0/0], ports: [22]` ("agents may ssh out")
opened 10/8, 172.16/12, 192.168/16, 100.64/10 and 169.254/16 (all but the metadata /32s) on
port 22 for every sandbox: the host's LAN, the docker bridge (the host itself), link-local
services. The same rule on 443 through the gateway is refused for those addresses."""
from __future__ import annotations

import ipaddress

import pytest

from cubegate.l4sync import l4_allow_for
from egress.netguard import AddressGuard
from egress.policy import load_policy_files

NEVER_DIRECT = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16",
                "127.0.0.0/8", "0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4", "198.18.0.0/15", "192.0.2.0/24"]


def _policy(tmp_path, match: str):
    p = tmp_path / "p.yaml"
    p.write_text(f"name: a\ndefault: deny\nrules:\n  - {{name: out, action: allow, match: {match}}}\n")
    return load_policy_files([p])


def _overlaps(entries, cidr: str) -> list:
    net = ipaddress.ip_network(cidr)
    return [e for e in entries if ipaddress.ip_network(e[0]).overlaps(net)]


@pytest.mark.parametrize("match", ["{cidrs: [0.0.0.0/0], ports: [22]}", "{cidrs: [0.0.0.0/0]}",
                                   "{cidrs: [10.0.0.0/8, 169.254.0.0/16], ports: [5432]}"])
def test_a_wide_cidrs_rule_opens_no_private_or_special_range_past_the_gateway(tmp_path, match):
    entries = l4_allow_for(_policy(tmp_path, match), "sb", {}, guard=AddressGuard())
    for cidr in NEVER_DIRECT:
        assert not _overlaps(entries, cidr), (cidr, _overlaps(entries, cidr)[:5])
    if "0.0.0.0/0" in match:      # the public internet is still open on the rule's port
        assert any(ipaddress.ip_address("8.8.8.8") in ipaddress.ip_network(c) for c, _, _ in entries)


def test_upstream_allow_cidrs_exempt_exactly_what_they_name(tmp_path):
    guard = AddressGuard(allow_cidrs=["10.9.0.0/24"])
    entries = l4_allow_for(_policy(tmp_path, "{cidrs: [0.0.0.0/0], ports: [22]}"), "sb", {}, guard=guard)
    assert ("10.9.0.0/24", 22, "tcp") in entries
    assert _overlaps(entries, "10.0.0.0/8") == [("10.9.0.0/24", 22, "tcp")]


def test_the_gateways_own_listeners_are_no_direct_path(tmp_path):
    """A listener of ours on a public address (a wildcard bind expanded to the host's
    addresses): that address is no direct path on that port (nor on "any port": the switch
    cannot say "any port but 8080", so it stays closed); its neighbours follow the rule."""
    guard = AddressGuard(own_endpoints=[("203.0.114.7", 8080)])
    entries = l4_allow_for(_policy(tmp_path, "{cidrs: [203.0.114.0/24]}"), "sb", {}, guard=guard)
    own = [e for e in entries if ipaddress.ip_address("203.0.114.7") in ipaddress.ip_network(e[0])]
    assert all(port not in (0, 8080) for _, port, _ in own), own
    assert any(ipaddress.ip_address("203.0.114.8") in ipaddress.ip_network(c) and p == 0 for c, p, _ in entries)
