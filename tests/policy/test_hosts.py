import pytest

from egress.policy import InvalidHost, InvalidPath, normalize_host, normalize_path, parse_host_pattern
from egress.policy.hosts import path_prefix_matches


@pytest.mark.parametrize("raw, expected", [
    ("api.openai.com", "api.openai.com"),
    ("API.OpenAI.COM", "api.openai.com"),
    ("api.openai.com.", "api.openai.com"),
    ("api.openai.com:443", "api.openai.com"),
    ("API.openai.com.:8443", "api.openai.com"),
    ("bücher.example", "xn--bcher-kva.example"),
    ("BÜCHER.example", "xn--bcher-kva.example"),
    ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("例え.テスト", "xn--r8jz45g.xn--zckzah"),
    ("a\u3002b.test", "a.b.test"),  # ideographic full stop is a dot under UTS-46
    ("metadata", "metadata"),
    ("_dmarc.example.com", "_dmarc.example.com"),
    ("127.0.0.1", "127.0.0.1"),
    ("127.0.0.1:80", "127.0.0.1"),
    ("[::1]", "::1"),
    ("[::1]:443", "::1"),
    ("::1", "::1"),
    ("[::ffff:169.254.169.254]", "169.254.169.254"),
    ("2001:DB8::1", "2001:db8::1"),
    ("  padded.test ", "padded.test"),
])
def test_normalize_host(raw, expected):
    assert normalize_host(raw) == expected


@pytest.mark.parametrize("raw", [
    "", " ", ".", "..", "a..b", ".a.b", "a.b..", "a b.com", "a/b.com", "a%2e.com", "a\x00.com",
    "-a.com", "a-.com", "x" * 64 + ".com", ("a." * 127) + "com",
    "a.com:", "a.com:http", "[::1", "[::1]x", "[nothost]", "a:b:c.com",
    "127.1", "2130706433", "0x7f.1", "0x7f000001", "010.0.0.1", "1.2.3.04",
    "xn--.com\u00ad\u200b",
])
def test_normalize_host_rejects(raw):
    with pytest.raises(InvalidHost):
        normalize_host(raw)


@pytest.mark.parametrize("text, name, wildcard", [
    ("api.openai.com", "api.openai.com", False),
    ("*.github.com", "github.com", True),
    ("*.GitHub.COM.", "github.com", True),
    ("*.bücher.example", "xn--bcher-kva.example", True),
])
def test_parse_host_pattern(text, name, wildcard):
    p = parse_host_pattern(text)
    assert (p.name, p.wildcard) == (name, wildcard)


@pytest.mark.parametrize("text, fragment", [
    ("api.*.x.com", "leftmost label"),
    ("*x.com", "whole label"),
    ("example.*", "leftmost label"),
    ("**.x.com", '"**" is not supported'),
    ("*", "bare"),
    ("", "empty"),
    ("x.com:443", "match.ports"),
    ("https://x.com", "not a URL"),
    ("x.com/path", "not a URL"),
    ("10.0.0.1", "match.cidrs"),
    ("*.", "empty host"),
    ("a..b", "empty label"),
])
def test_parse_host_pattern_rejects(text, fragment):
    with pytest.raises(InvalidHost) as ei:
        parse_host_pattern(text)
    assert fragment in str(ei.value)


@pytest.mark.parametrize("host, pattern, hit", [
    ("a.x.com", "*.x.com", True),
    ("a.b.x.com", "*.x.com", True),
    ("x.com", "*.x.com", False),
    ("evil-x.com", "*.x.com", False),
    ("x.com.evil.net", "*.x.com", False),
    ("x.com", "x.com", True),
    ("a.x.com", "x.com", False),
])
def test_pattern_reference_semantics(host, pattern, hit):
    assert parse_host_pattern(pattern).matches(host) is hit


@pytest.mark.parametrize("raw, expected", [
    ("/", "/"),
    ("/v1/chat?x=1", "/v1/chat"),
    ("/v1/chat?x=1#f", None),  # a request target has no fragment (the whole target goes upstream)
    ("//admin", "/admin"),
    ("/a//b/", "/a/b/"),
    ("/./admin", "/admin"),
    ("/v1/../admin", "/admin"),
    ("/v1/..", "/"),
    ("/%61dmin", "/admin"),
    ("/%2e%2e/x".replace("/x", "/x"), None),  # climbs above root
    ("/ok/%2E%2E/admin", "/admin"),
    ("/allowed/..;/admin", "/admin"),
    ("/admin;jsessionid=1/x", "/admin/x"),
    ("/a%20b", "/a%20b"),
    ("/a%c3%a9", "/a%C3%A9"),
    ("*", "*"),
])
def test_normalize_path(raw, expected):
    if expected is None:
        with pytest.raises(InvalidPath):
            normalize_path(raw)
    else:
        assert normalize_path(raw) == expected


@pytest.mark.parametrize("raw", ["admin", "/..", "/ok/#/../admin", "/a/%2Fadmin", "/a%5cb", "/a\\b", "/a%00", "/a%zz", "/a%4", "/a\nb"])
def test_normalize_path_rejects(raw):
    with pytest.raises(InvalidPath):
        normalize_path(raw)


@pytest.mark.parametrize("prefix, path, hit", [
    ("/admin", "/admin", True),
    ("/admin", "/admin/x", True),
    ("/admin", "/administrator", False),
    ("/v1/", "/v1/chat", True),
    ("/v1/", "/v1", False),
    ("/", "/anything", True),
])
def test_path_prefix(prefix, path, hit):
    assert path_prefix_matches(prefix, path) is hit


def test_zone_ids_are_not_accepted():
    for raw in ("fe80::1%eth0", "[fe80::1%25eth0]:443"):
        with pytest.raises(InvalidHost):
            normalize_host(raw)


def test_random_garbage_never_raises_from_decide():
    """decide() and name_may_resolve() must turn any input into a decision."""
    import random
    import string

    from egress.policy import CompiledPolicySet, Match, Policy, RequestInfo, Rule

    ps = CompiledPolicySet([Policy("p", (
        Rule("a", "allow", Match(hosts=(parse_host_pattern("*.x.test"),), paths=("/v1/",))),
        Rule("b", "allow", Match(cidrs=(__import__("ipaddress").ip_network("fe80::/10"),))),
    ))])
    rng = random.Random(7)
    alphabet = string.printable + "é。．[]:%ａ\u200b"
    for _ in range(3000):
        host = "".join(rng.choices(alphabet, k=rng.randint(0, 24)))
        path = rng.choice(("", "/", "*")) + "".join(rng.choices(alphabet, k=rng.randint(0, 16)))
        d = ps.decide(RequestInfo("s", {}, host, rng.choice((0, 443, 70000)), rng.choice((None, "https", "FTP")),
                                  rng.choice((None, "GET", "brew")), rng.choice((None, path)),
                                  rng.random() < 0.1))
        assert d.action in ("allow", "deny")
        assert isinstance(ps.name_may_resolve("s", {}, host), bool)
