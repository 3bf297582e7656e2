import ipaddress

import pytest

from egress.netguard import AddressGuard, parse_ip_literal

GUARD = AddressGuard()


@pytest.mark.parametrize("ip, reason", [
    ("0.0.0.0", "unspecified"), ("0.1.2.3", "unspecified"),
    ("127.0.0.1", "loopback"), ("127.255.255.254", "loopback"),
    ("10.0.0.1", "private"), ("172.16.0.1", "private"), ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("169.254.169.254", "link_local"),
    ("100.64.0.1", "cgnat"), ("100.127.255.255", "cgnat"),
    ("192.0.0.1", "reserved"), ("192.0.0.9", "reserved"), ("192.88.99.1", "reserved"),
    ("240.0.0.1", "reserved"), ("254.255.255.255", "reserved"),
    ("192.0.2.1", "documentation"), ("198.51.100.7", "documentation"),
    ("203.0.113.9", "documentation"),
    ("198.18.0.10", "benchmarking"), ("198.19.255.255", "benchmarking"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"),
    ("255.255.255.255", "broadcast"),
    ("::", "unspecified"), ("::1", "loopback"),
    ("fe80::1", "link_local"), ("febf::1", "link_local"),
    ("fc00::1", "unique_local"), ("fd00::1", "unique_local"),
    ("ff02::1", "multicast"),
    ("2001:db8::1", "documentation"), ("3fff::1", "documentation"),
    ("2001:2::1", "benchmarking"),
    ("2001::1", "reserved"),            # Teredo, inside 2001::/23
    ("2001:1ff::1", "reserved"),
    ("100::1", "reserved"), ("fec0::1", "reserved"), ("5f00::1", "reserved"),
    ("::2", "reserved"), ("1::1", "reserved"), ("4000::1", "reserved"),  # outside 2000::/3
    # IPv6 forms that embed IPv4: the embedded address's reason first
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "private"),
    ("::ffff:169.254.169.254", "link_local"),
    ("::ffff:8.8.8.8", "ipv4_mapped"),
    ("::ffff:0:10.0.0.1", "private"), ("::ffff:0:8.8.8.8", "ipv4_translated"),
    ("64:ff9b::127.0.0.1", "loopback"), ("64:ff9b::8.8.8.8", "nat64"),
    ("64:ff9b:1::8.8.8.8", "nat64"),
    ("2002:7f00:1::1", "loopback"), ("2002:a9fe:a9fe::1", "link_local"),
])
def test_reasons(ip, reason):
    assert GUARD.check(ip) == reason
    assert GUARD.check(ipaddress.ip_address(ip), 443) == reason


@pytest.mark.parametrize("ip", [
    "8.8.8.8", "1.1.1.1", "93.184.216.34", "100.63.255.255", "100.128.0.0",
    "172.15.255.255", "172.32.0.0", "169.253.255.255", "198.17.255.255", "198.20.0.0",
    "223.255.255.255", "192.0.1.255", "192.31.196.1",
    "2606:4700:4700::1111", "2a00:1450:4001::1", "2002:808:808::1", "2001:200::1",
])
def test_public_addresses_are_allowed(ip):
    assert GUARD.check(ip, 443) is None


# Every block the design asks to deny: first and last address must be refused.
SPECIAL_BLOCKS = [
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16",
    "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
    "255.255.255.255/32", "::/128", "::1/128", "::ffff:0:0/96", "64:ff9b::/96", "100::/64",
    "2001::/23", "2001:db8::/32", "fc00::/7", "fe80::/10", "ff00::/8",
]


@pytest.mark.parametrize("block", SPECIAL_BLOCKS)
def test_every_special_purpose_block_is_denied(block):
    net = ipaddress.ip_network(block)
    for address in (net.network_address, net.broadcast_address, net.network_address + net.num_addresses // 2):
        assert GUARD.check(address) is not None, address


@pytest.mark.parametrize("spelling", ["2130706433", "0x7f.1", "0177.0.0.1", "127.1", "[::1]",
                                      "::ffff:127.0.0.1", "127.0.0.1."])
def test_literal_spellings_of_loopback_are_refused(spelling):
    assert GUARD.check(parse_ip_literal(spelling)) == "loopback"
    assert GUARD.check(spelling) == "loopback"  # strings go through parse_ip_literal


def test_hostname_is_not_an_address():
    with pytest.raises(ValueError):
        GUARD.check("example.com")


def test_allow_cidrs_exempt_exactly_what_they_name():
    guard = AddressGuard(allow_cidrs=["198.18.0.0/24"])
    assert guard.check("198.18.0.10") is None
    assert guard.check("198.18.1.10") == "benchmarking"
    assert guard.check("127.0.0.1") == "loopback"
    # the IPv4-mapped spelling of an exempt address is a different address
    assert guard.check("::ffff:198.18.0.10") == "ipv4_mapped"


def test_own_endpoints_win_over_exemptions():
    guard = AddressGuard(allow_cidrs=["198.18.0.0/24"],
                         own_endpoints={("198.18.0.1", 8080), ("198.18.0.1", 9090), ("198.18.0.5", None)})
    assert guard.check("198.18.0.1", 8080) == "own_listener"
    assert guard.check("198.18.0.1", 9090) == "own_listener"
    assert guard.check("198.18.0.1", 443) is None
    assert guard.check("198.18.0.1") == "own_listener"   # port unknown: fail closed
    assert guard.check("198.18.0.5", 1) == "own_listener"  # port None = every port
    assert guard.check("::ffff:198.18.0.1", 8080) == "own_listener"


def test_own_endpoint_on_public_address():
    guard = AddressGuard(own_endpoints=[("203.0.113.1", 3128), ("2606:4700::1", 3128)])
    assert guard.check("2606:4700::1", 3128) == "own_listener"
    assert guard.check("2606:4700::1", 443) is None


def test_extra_deny_beats_allow():
    guard = AddressGuard(allow_cidrs=["198.18.0.0/24"], extra_deny_cidrs=["198.18.0.13/32", "8.8.8.0/24",
                                                                          "2606:4700::/32"])
    assert guard.check("198.18.0.13") == "denied_cidr"
    assert guard.check("198.18.0.12") is None
    assert guard.check("8.8.8.8") == "denied_cidr"
    assert guard.check("2606:4700::1111") == "denied_cidr"
    assert guard.check("::ffff:8.8.8.8") == "denied_cidr"  # embedded address is checked too


def test_scoped_ipv6_object_is_checked_without_scope():
    guard = AddressGuard(own_endpoints=[("2606:4700::1", None)])
    assert guard.check(ipaddress.IPv6Address("2606:4700::1%eth0")) == "own_listener"
    assert guard.check(ipaddress.IPv6Address("fe80::1%eth0")) == "link_local"


def test_wildcard_listeners_expand_to_every_local_address():
    from egress.netguard import expand_wildcard_endpoints
    locals_ = ["127.0.0.1", "198.18.0.1", "::1", "2001:db8::5"]
    own = expand_wildcard_endpoints([("0.0.0.0", 8080), ("::", 9090), ("198.18.0.1", 8443)], locals_)
    guard = AddressGuard(allow_cidrs=["198.18.0.0/24"], own_endpoints=own)
    assert guard.check("198.18.0.1", 8080) == "own_listener"   # the proxy-loop case in the lab
    assert guard.check("198.18.0.1", 9090) == "own_listener"   # v6 wildcard is dual-stack
    assert guard.check("198.18.0.1", 8443) == "own_listener"
    assert guard.check("198.18.0.1", 443) is None
    assert guard.check("198.18.0.10", 8080) is None            # not ours
    v4_only = expand_wildcard_endpoints([("0.0.0.0", 8080)], locals_)
    assert (ipaddress.ip_address("::1"), 8080) not in v4_only
