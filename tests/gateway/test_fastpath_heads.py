"""The fast path's CONNECT parser: strict, and never wider than mitmproxy's.

What it refuses (None) is handed to mitmproxy, which parses it again and answers as it
always did; what it accepts must mean the same to mitmproxy (host, port, credentials).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egress import mitm_internals, netguard
from egress.fastpath import heads
from egress.policy import normalize_host


def destination(raw: str):
    """What decide_destination makes of a raw host: an IP literal, a normalised name, or invalid."""
    literal = netguard.parse_ip_literal(raw)
    if literal is not None:
        return ("ip", str(literal))
    try:
        return ("name", normalize_host(raw))
    except ValueError:
        return ("invalid",)


def mitmproxy_view(head: bytes):
    """What mitmproxy's own parser makes of `head` (as the fast path used to call it), or None."""
    lines = head.splitlines(keepends=True)
    while lines and lines[-1].strip() == b"":
        lines.pop()
    try:
        req = mitm_internals.read_request_head(lines)
    except ValueError:
        return None
    if req.method != "CONNECT" or not req.host or not req.port:
        return None
    return req.host, req.port, req.headers.get_all("Proxy-Authorization")


ACCEPTED = [
    (b"CONNECT api.test:443 HTTP/1.1\r\n\r\n", ("api.test", 443, None, False)),
    (b"CONNECT API.Test.:443 HTTP/1.0\r\nHost: api.test\r\n\r\n", ("API.Test.", 443, None, False)),
    (b"CONNECT a_b-c.test:8443 HTTP/1.1\r\nProxy-Authorization:   Basic eDp5  \r\n\r\n",
     ("a_b-c.test", 8443, "Basic eDp5", True)),
    (b"CONNECT [::1]:443 HTTP/1.1\r\n\r\n", ("::1", 443, None, False)),
    (b"CONNECT [::ffff:127.0.0.1]:443 HTTP/1.1\r\n\r\n", ("::ffff:127.0.0.1", 443, None, False)),
    (b"CONNECT 2130706433:443 HTTP/1.1\r\n\r\n", ("2130706433", 443, None, False)),   # the guard sees a literal
    (b"CONNECT 0x7f.1:65535 HTTP/1.1\r\nX-Empty:\r\n\r\n", ("0x7f.1", 65535, None, False)),
    (b"CONNECT xn--bcher-kva.test:443 HTTP/1.1\r\n\r\n", ("xn--bcher-kva.test", 443, None, False)),
    (b"CONNECT a.test:443 HTTP/1.1\r\nproxy-authorization: a\r\nPROXY-AUTHORIZATION: b\r\n\r\n",
     ("a.test", 443, None, True)),                                   # two: refused as invalid, never one picked
]


@pytest.mark.parametrize("head, want", ACCEPTED)
def test_strict_connect_heads_are_parsed(head, want):
    got = heads.parse_connect(head)
    assert (got.host, got.port, got.proxy_authorization, got.has_proxy_authorization) == want
    view = mitmproxy_view(head)
    assert view is not None and view[1] == got.port
    assert destination(view[0]) == destination(got.host)


REFUSED = {
    "plain HTTP": b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",
    "lower-case method": b"connect a.test:443 HTTP/1.1\r\n\r\n",
    "no port": b"CONNECT a.test HTTP/1.1\r\n\r\n",
    "empty port": b"CONNECT a.test: HTTP/1.1\r\n\r\n",
    "port 0": b"CONNECT a.test:0 HTTP/1.1\r\n\r\n",
    "port too big": b"CONNECT a.test:65536 HTTP/1.1\r\n\r\n",
    "port 99999": b"CONNECT a.test:99999 HTTP/1.1\r\n\r\n",
    "leading zero port": b"CONNECT a.test:0443 HTTP/1.1\r\n\r\n",
    "signed port": b"CONNECT a.test:+443 HTTP/1.1\r\n\r\n",
    "unbracketed IPv6": b"CONNECT ::1:443 HTTP/1.1\r\n\r\n",
    "bad IPv6": b"CONNECT [::g]:443 HTTP/1.1\r\n\r\n",
    "IPv6 zone": b"CONNECT [fe80::1%25eth0]:443 HTTP/1.1\r\n\r\n",
    "userinfo": b"CONNECT user@a.test:443 HTTP/1.1\r\n\r\n",
    "non-ASCII host": "CONNECT bücher.test:443 HTTP/1.1\r\n\r\n".encode(),
    "empty label": b"CONNECT a..test:443 HTTP/1.1\r\n\r\n",
    "label too long": b"CONNECT " + b"a" * 64 + b".test:443 HTTP/1.1\r\n\r\n",
    "name too long": b"CONNECT " + b".".join([b"a" * 63] * 5) + b":443 HTTP/1.1\r\n\r\n",
    "URL target": b"CONNECT https://a.test:443 HTTP/1.1\r\n\r\n",
    "HTTP/2 version": b"CONNECT a.test:443 HTTP/2\r\n\r\n",
    "HTTP/0.9-ish": b"CONNECT a.test:443\r\n\r\n",
    "two spaces": b"CONNECT  a.test:443 HTTP/1.1\r\n\r\n",
    "tab separator": b"CONNECT\ta.test:443 HTTP/1.1\r\n\r\n",
    "trailing space": b"CONNECT a.test:443 HTTP/1.1 \r\n\r\n",
    "bare LF line ends": b"CONNECT a.test:443 HTTP/1.1\nHost: a\n\n",
    "bare LF inside": b"CONNECT a.test:443 HTTP/1.1\r\nHost: a\nX: b\r\n\r\n",
    "bare CR inside": b"CONNECT a.test:443 HTTP/1.1\r\nHost: a\rX: b\r\n\r\n",
    "obs-fold": b"CONNECT a.test:443 HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
    "space before colon": b"CONNECT a.test:443 HTTP/1.1\r\nProxy-Authorization : Basic eDp5\r\n\r\n",
    "no colon": b"CONNECT a.test:443 HTTP/1.1\r\nBad Header\r\n\r\n",
    "empty name": b"CONNECT a.test:443 HTTP/1.1\r\n: x\r\n\r\n",
    "control byte in value": b"CONNECT a.test:443 HTTP/1.1\r\nX: a\x00b\r\n\r\n",
    "non-ASCII value": "CONNECT a.test:443 HTTP/1.1\r\nProxy-Authorization: Basic é\r\n\r\n".encode(),
    "Content-Length": b"CONNECT a.test:443 HTTP/1.1\r\nContent-Length: 5\r\n\r\n",
    "Transfer-Encoding": b"CONNECT a.test:443 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    "not ended": b"CONNECT a.test:443 HTTP/1.1\r\n",
    "too many headers": b"CONNECT a.test:443 HTTP/1.1\r\n" + b"X: y\r\n" * 101 + b"\r\n",
}


@pytest.mark.parametrize("head", REFUSED.values(), ids=REFUSED.keys())
def test_heads_outside_the_strict_form_go_to_mitmproxy(head):
    assert heads.parse_connect(head) is None


def test_header_count_follows_the_setting():
    head = b"CONNECT a.test:443 HTTP/1.1\r\n" + b"X: y\r\n" * 5 + b"\r\n"
    assert heads.parse_connect(head, max_headers=5) is not None
    assert heads.parse_connect(head, max_headers=4) is None


# Heads a hostile sandbox would build: mostly well-formed, every part sometimes hostile. The
# property: whatever the fast path accepts, mitmproxy reads the same way (so answering it here
# changes nothing a sandbox can see).
def _one_of(*xs, usual: int = 1):
    """The first `usual` choices weigh 8 each, the hostile rest 1 each."""
    return st.sampled_from(list(xs[:usual]) * 8 + list(xs[usual:]))


_method = _one_of(b"CONNECT", b"connect", b"GET")
_sep = _one_of(b" ", b"  ", b"\t")
_host = _one_of(b"a.test", b"A.TEST.", b"[::1]", b"127.1", b"2130706433", b"x_y.test", b"xn--bcher-kva.test",
                b"::1", b"a..b",
                b"b\xc3\xbccher.test", b"u@a.test", b"a.test%00", b"", b"[fe80::1%25x]", usual=7)
_port = _one_of(b":443", b":8443", b":1", b":0443", b":65536", b":", b"", b":+1", b":44 3", usual=3)
_version = _one_of(b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"http/1.1", usual=2)
_eol = _one_of(b"\r\n", b"\n", b"\r", b" \r\n")
_name = _one_of(b"Proxy-Authorization", b"proxy-authorization", b"Host", b"X-A", b"Content-Length", b"",
                b" Host", b"Proxy-Authorization ", b"X\x00", usual=4)
_colon = _one_of(b":", b": ", b":\t", b"", usual=3)
_value = _one_of(b"Basic eDp5", b"Basic eDp5 ", b"a.test", b"", b"5", b"a\x00b", b"\xc3\xa9", b"a\r\n b",
                 usual=5)
_header = st.tuples(_name, _colon, _value, _eol).map(b"".join)


@settings(max_examples=500, deadline=None)
@given(st.tuples(_method, _sep, _host, _port, _sep, _version, _eol), st.lists(_header, max_size=4))
def test_anything_the_fast_path_accepts_mitmproxy_reads_the_same(line, headers):
    head = b"".join(line) + b"".join(headers) + b"\r\n"
    end = heads.head_end(head)
    ours = heads.parse_connect(head[:end]) if end >= 0 else None
    if ours is None:
        return
    view = mitmproxy_view(head[:end])
    assert view is not None, head
    host, port, auth = view
    assert port == ours.port
    assert destination(host) == destination(ours.host)
    assert bool(auth) == ours.has_proxy_authorization
    assert (auth[0] if len(auth) == 1 else None) == ours.proxy_authorization


def test_head_end_is_the_first_blank_line_of_either_kind():
    """Every string of CR, LF and one other byte up to 8 long: the earliest end of CRLFCRLF or LFLF."""
    import itertools

    def earliest(buf: bytes) -> int:
        ends = [k + n for k, n in ((buf.find(b"\r\n\r\n"), 4), (buf.find(b"\n\n"), 2)) if k >= 0]
        return min(ends) if ends else -1

    for length in range(9):
        for parts in itertools.product((b"\r", b"\n", b"a"), repeat=length):
            buf = b"".join(parts)
            assert heads.head_end(buf) == heads.head_end(bytearray(buf)) == earliest(buf), buf
