"""egress.fastpath.hello_scan answers only where it agrees with mitmproxy's ClientHello parser."""
from __future__ import annotations

import ssl
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as s

from egress import mitm_internals
from egress.fastpath import heads
from egress.fastpath.hello_scan import scan_hello


def real_hello(sni: str | None, alpn: list[str] | None = None) -> bytes:
    """A ClientHello as Python's ssl module (OpenSSL) writes it."""
    ctx = ssl.create_default_context() if sni else ssl._create_unverified_context()
    if alpn:
        ctx.set_alpn_protocols(alpn)
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def mitmproxy_says(data: bytes):
    """(sni, sni_unread) by mitmproxy's parser; None while incomplete; "invalid" when it refuses."""
    try:
        hello = mitm_internals.parse_client_hello(data)
    except ValueError:
        return "invalid"
    return None if hello is None else (hello.sni, mitm_internals.unread_server_name(hello))


def agrees(data: bytes) -> bool:
    got = scan_hello(data)
    return got is None or got == mitmproxy_says(data)


@pytest.mark.parametrize("sni, alpn", [
    ("api.allowed.test", None), ("api.allowed.test", ["h2", "http/1.1"]), (None, None),
    ("x.test", ["http/1.1"]), ("a-b.c-d.example.com", None),
])
def test_real_hellos_are_read_here_and_mean_what_mitmproxy_reads(sni, alpn):
    data = real_hello(sni, alpn)
    assert scan_hello(data) is not None, "the common shape must not need mitmproxy's parser"
    assert scan_hello(data) == mitmproxy_says(data) == (sni, False)
    assert heads.read_hello(data, False) == heads.Hello("tls", sni=sni)


def test_a_hello_with_bytes_after_its_record_is_read_like_mitmproxy_does():
    data = real_hello("api.allowed.test") + b"\x17\x03\x03\x00\x01x"
    assert scan_hello(data) == mitmproxy_says(data) == ("api.allowed.test", False)


def test_incomplete_and_multi_record_hellos_are_left_to_mitmproxy():
    data = real_hello("api.allowed.test")
    for cut in (5, 9, 40, len(data) - 1):
        assert scan_hello(data[:cut]) is None
    body = data[5:]
    split = b"".join(b"\x16\x03\x01" + struct.pack("!H", len(part)) + part for part in (body[:50], body[50:]))
    assert scan_hello(split) is None
    assert mitmproxy_says(split) == ("api.allowed.test", False)
    assert heads.read_hello(split, False) == heads.Hello("tls", sni="api.allowed.test")


# --------------------------------------------------------------- generated hellos
def _ext(ext_type: int, body: bytes) -> bytes:
    return struct.pack("!HH", ext_type, len(body)) + body


def _server_names(entries: list[tuple[int, bytes]], list_len_delta: int = 0) -> bytes:
    raw = b"".join(bytes([t]) + struct.pack("!H", len(n)) + n for t, n in entries)
    return struct.pack("!H", max(0, len(raw) + list_len_delta)) + raw


def _alpn(protocols: list[bytes], list_len_delta: int = 0) -> bytes:
    raw = b"".join(bytes([len(p)]) + p for p in protocols)
    return struct.pack("!H", max(0, len(raw) + list_len_delta)) + raw


def _hello(extensions: list[bytes] | None, *, suites: bytes = b"\x13\x01\x13\x02", session: bytes = b"",
           ext_len_delta: int = 0, hs_type: int = 1) -> bytes:
    body = b"\x03\x03" + bytes(32) + bytes([len(session)]) + session + struct.pack("!H", len(suites)) + suites \
        + b"\x01\x00"
    if extensions is not None:
        raw = b"".join(extensions)
        body += struct.pack("!H", max(0, len(raw) + ext_len_delta)) + raw
    hs = bytes([hs_type]) + struct.pack("!I", len(body))[1:] + body
    return b"\x16\x03\x01" + struct.pack("!H", len(hs)) + hs


names = s.sampled_from([b"api.allowed.test", b"x.test", b"", b"bad name", b"-x.test", b"a" * 70 + b".test",
                        b"1.2.3.4", "bücher.test".encode(), b"xn--bcher-kva.test", b"\xff\xfe", b"a.test."])
server_name_ext = s.builds(lambda e, d: _ext(0, _server_names(e, d)),
                           s.lists(s.tuples(s.sampled_from([0, 0, 1]), names), max_size=3),
                           s.sampled_from([0, 0, 0, 1, -1]))
alpn_ext = s.builds(lambda p, d: _ext(16, _alpn(p, d)), s.lists(s.sampled_from([b"h2", b"http/1.1", b""]), max_size=3),
                    s.sampled_from([0, 0, 0, 1, -1]))
other_ext = s.builds(_ext, s.sampled_from([10, 13, 43, 51, 0xFF01]), s.binary(max_size=12))
raw_ext = s.binary(max_size=8)          # anything at all where an extension is expected


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extensions=s.one_of(s.none(), s.lists(s.one_of(server_name_ext, alpn_ext, other_ext, raw_ext), max_size=5)),
       suites=s.sampled_from([b"\x13\x01", b"\x13\x01\x13", b"", b"\x00\x2f\x00\x35"]),
       session=s.sampled_from([b"", bytes(32)]), ext_len_delta=s.sampled_from([0, 0, 0, 1, -1, 5]),
       hs_type=s.sampled_from([1, 1, 1, 2]))
def test_generated_hellos_are_read_as_mitmproxy_reads_them_or_left_to_it(extensions, suites, session,
                                                                          ext_len_delta, hs_type):
    data = _hello(extensions, suites=suites, session=session, ext_len_delta=ext_len_delta, hs_type=hs_type)
    assert agrees(data)


@settings(max_examples=400, deadline=None)
@given(data=s.data())
def test_mutated_real_hellos_are_read_as_mitmproxy_reads_them_or_left_to_it(data):
    hello = bytearray(real_hello("api.allowed.test", ["h2"]) if data.draw(s.booleans()) else
                      _hello([_ext(0, _server_names([(0, b"api.allowed.test")])), _ext(16, _alpn([b"h2"]))]))
    for _ in range(data.draw(s.integers(1, 3))):
        i = data.draw(s.integers(0, len(hello) - 1))
        hello[i] = data.draw(s.integers(0, 255))
    if data.draw(s.booleans()):
        hello = hello[:data.draw(s.integers(0, len(hello)))]
    assert agrees(bytes(hello))


def test_the_cases_that_matter_for_the_sni_check():
    two = _hello([_ext(0, _server_names([(0, b"a.test")])), _ext(0, _server_names([(0, b"b.test")]))])
    assert scan_hello(two) == mitmproxy_says(two) == ("a.test", True)           # two server_name extensions
    pair = _hello([_ext(0, _server_names([(0, b"a.test"), (0, b"b.test")]))])
    assert scan_hello(pair) == mitmproxy_says(pair) == (None, True)             # a list of two names
    other_type = _hello([_ext(0, _server_names([(1, b"a.test")]))])
    assert scan_hello(other_type) == mitmproxy_says(other_type) == (None, True)
    invalid = _hello([_ext(0, _server_names([(0, b"bad name")]))])
    assert scan_hello(invalid) == mitmproxy_says(invalid) == (None, True)
    no_ext = _hello(None)
    assert scan_hello(no_ext) == mitmproxy_says(no_ext) == (None, False)
    bad_alpn = _hello([_ext(0, _server_names([(0, b"a.test")])), _ext(16, b"\x00")])
    assert scan_hello(bad_alpn) is None and mitmproxy_says(bad_alpn) == "invalid"
