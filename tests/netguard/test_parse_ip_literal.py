import ipaddress
import socket

import pytest

from egress.netguard import parse_ip_literal

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address


@pytest.mark.parametrize("spelling, expected", [
    ("127.0.0.1", V4("127.0.0.1")),
    ("2130706433", V4("127.0.0.1")),            # single decimal integer
    ("0x7f000001", V4("127.0.0.1")),            # single hex integer
    ("0X7F000001", V4("127.0.0.1")),
    ("0x7f.0.0.1", V4("127.0.0.1")),            # hex part
    ("0x7f.0x0.0x0.0x1", V4("127.0.0.1")),
    ("0177.0.0.1", V4("127.0.0.1")),            # octal part
    ("017700000001", V4("127.0.0.1")),          # single octal integer
    ("127.1", V4("127.0.0.1")),                 # a.b  (b is 24 bits)
    ("127.0.1", V4("127.0.0.1")),               # a.b.c (c is 16 bits)
    ("10.1.2", V4("10.1.0.2")),
    ("169.254.43518", V4("169.254.169.254")),
    ("0", V4("0.0.0.0")),
    ("0.0.0.0", V4("0.0.0.0")),
    ("127.0.0.1.", V4("127.0.0.1")),            # trailing dot
    ("2130706433.", V4("127.0.0.1")),
    ("1.2.3", V4("1.2.0.3")),                   # digit "TLD": a literal, not a name
    ("4294967295", V4("255.255.255.255")),
    ("::1", V6("::1")),
    ("[::1]", V6("::1")),                       # bracketed
    ("[0:0:0:0:0:0:0:1]", V6("::1")),
    ("fe80::1%eth0", V6("fe80::1")),            # zone id dropped
    ("[fe80::1%25eth0]", V6("fe80::1")),        # URL-encoded zone
    ("::ffff:127.0.0.1", V6("::ffff:7f00:1")),  # IPv4-mapped, dotted tail
    ("[::ffff:7f00:1]", V6("::ffff:7f00:1")),
    ("::FFFF:10.0.0.1", V6("::ffff:a00:1")),
    ("64:ff9b::127.0.0.1", V6("64:ff9b::7f00:1")),
])
def test_literals_are_recognised(spelling, expected):
    assert parse_ip_literal(spelling) == expected


@pytest.mark.parametrize("name", [
    "example.com", "api.allowed.test", "localhost", "127.0.0.1.nip.io", "0x7f.example",
    "1.2.3.4.5",            # five parts: inet_aton refuses, so it is a name
    "256.1.1.1",            # out of range
    "4294967296",           # 2**32
    "08.1.1.1",             # 8 is not an octal digit
    "0x", "0x.1", "1..2", ".1.2.3", "1.2.3.4..",
    "1.2.3.4 x", " 1.2.3.4", "1.2.3.4\n",  # glibc inet_aton would accept trailing junk
    "", "[]", "[1.2.3.4]", "[example.com]", "fe80::1%", ":::1", "[::1", "::1]",
    "-1", "+1", "1e3",
])
def test_names_and_junk_are_not_literals(name):
    assert parse_ip_literal(name) is None


@pytest.mark.parametrize("spelling", [
    "127.1", "0x7f.1", "0177.1", "2130706433", "0x7f000001", "1.2.3", "10.0x10.0377",
    "0.0.0.0", "255.255.255.255", "01.02.03.04", "0xA.0xb.0xC.0xd",
])
def test_bsd_forms_agree_with_the_c_library(spelling):
    """Our acceptance matches what the C resolver would connect to."""
    assert parse_ip_literal(spelling) == V4(socket.inet_aton(spelling))
    info = socket.getaddrinfo(spelling, 80, socket.AF_INET, socket.SOCK_STREAM,
                              flags=socket.AI_NUMERICHOST)
    assert V4(info[0][4][0]) == parse_ip_literal(spelling)


def test_non_string_is_not_a_literal():
    assert parse_ip_literal(None) is None  # type: ignore[arg-type]
    assert parse_ip_literal(b"127.0.0.1") is None  # type: ignore[arg-type]
