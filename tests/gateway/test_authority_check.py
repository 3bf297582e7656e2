"""check_request_authority: every name a request carries must be the decided host AND port (pure)."""
from __future__ import annotations

import pytest

from egress.gate import _canonical_host
from egress.http_checks import check_request_authority


def check(authority="", hosts=(), scheme="https", host="api.bound.test", port=443):
    r = check_request_authority(want_host=host, want_port=port, scheme=scheme, authority=authority,
                                host_headers=list(hosts), normalize=_canonical_host)
    return None if r is None else (r.status, r.reason)


@pytest.mark.parametrize("authority,hosts", [
    ("", ()),                                     # HTTP/1.0 without Host: the tunnel host applies
    ("", ("api.bound.test",)),
    ("", ("API.Bound.Test.",)),                   # case and one trailing dot
    ("", ("api.bound.test:443",)),
    ("api.bound.test", ()),
    ("api.bound.test:443", ("api.bound.test",)),
])
def test_same_host_and_port_passes(authority, hosts):
    assert check(authority, hosts) is None


@pytest.mark.parametrize("authority,hosts", [
    ("api.bound.test:443", ("evil.test",)),       # absolute-form names the tunnel, Host names another (fronting)
    ("", ("evil.test",)),
    ("", ("api.bound.test:8443",)),               # same name, other port
    ("api.bound.test:8443", ()),                  # h2 :authority with another port
    ("evil.test", ("api.bound.test",)),           # h2 :authority other host, host header ours
    ("api.bound.test", ("evil.test",)),           # h2 host header differs from :authority
    ("", ("api.bound.test.evil.test",)),
    ("", ("127.0.0.1",)),
])
def test_other_host_or_port_is_421(authority, hosts):
    assert check(authority, hosts) == (421, "authority_mismatch")


def test_two_host_headers_are_refused_even_if_one_matches():
    assert check("", ("api.bound.test", "evil.test")) == (400, "duplicate_host")
    assert check("", ("api.bound.test", "api.bound.test")) == (400, "duplicate_host")


@pytest.mark.parametrize("value", ["api.bound.test:0", "api.bound.test:99999", "api.bound.test:x", "[::1", "a b"])
def test_unparseable_names_are_400(value):
    assert check("", (value,))[0] in (400, 421)


def test_default_port_follows_scheme():
    assert check("", ("plain.test",), scheme="http", host="plain.test", port=80) is None
    assert check("", ("plain.test",), scheme="http", host="plain.test", port=8080) == (421, "authority_mismatch")


def test_ip_literal_spellings_compare_canonically():
    assert check("", ("0x7f.1",), host="127.0.0.1", port=443) is None
    assert check("", ("[::ffff:127.0.0.1]",), host="127.0.0.1", port=443) == (421, "authority_mismatch")


@pytest.mark.parametrize("hosts,port,want", [
    ([], 80, ("host_missing", 400)),
    (["a.test", "b.test"], 80, ("duplicate_host", 400)),
    (["a.test:8080"], 80, ("authority_mismatch", 421)),
    (["a.test:x"], 80, ("invalid_host", 400)),
])
def test_transparent_host_refusals(hosts, port, want):
    from egress.http_checks import Refusal, transparent_host
    r = transparent_host(hosts, port)
    assert isinstance(r, Refusal) and (r.reason, r.status) == want


def test_transparent_host_is_the_one_host_on_the_dialled_port():
    from egress.http_checks import transparent_host
    assert transparent_host(["a.test"], 80) == ("a.test", None)
    assert transparent_host(["a.test:80"], 80) == ("a.test", 80)
