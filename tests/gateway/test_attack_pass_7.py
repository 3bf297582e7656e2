"""Attack pass 7: what a request means to an upstream beyond its request line (earlier passes:
tests/gateway/test_attack_pass_1.py .. _6.py, tests/vault/test_attack_pass_5.py).

Each test asserts the secure behaviour against a real gateway (explicit + transparent listeners,
cubevs switch) and the hostile upstream (testbed/hostile.py). FINDING tests failed before their fix.

Here the policy refuses DELETE to hostile.allowed.test (intercepted: it has a binding) and to
sink.allowed.test (plain HTTP on the fast path: no binding), and okey is bound to
other.allowed.test for GET only.
"""
from __future__ import annotations

import time

import pytest

from tests.gateway import hostile_env as he
from tests.gateway.switchlab import switch_lab

pytestmark = pytest.mark.netns

TPORT = 18107

POLICY = """\
name: attack7
tenant: acme
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [hostile.allowed.test, other.allowed.test, sink.allowed.test], ports: [443, 80]}
  - name: no-delete
    action: deny
    match: {hosts: [hostile.allowed.test, sink.allowed.test], ports: [443, 80], methods: [DELETE]}
"""


def _setup_vault(gw) -> None:
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "hkey", input=he.KEY_A + "\n")
    gw.cli("vault", "secret", "put", "acme", "okey", input=he.KEY_B + "\n")
    gw.cli("vault", "binding", "add", "--id", "b-hostile", "--tenant", "acme", "--secret", "hkey",
           "--host", he.H, "--port", "443", "--header", "Authorization", "--format", "Bearer {secret}")
    gw.cli("vault", "binding", "add", "--id", "b-other-get", "--tenant", "acme", "--secret", "okey",
           "--host", he.OTHER, "--port", "443", "--method", "GET",
           "--header", "Authorization", "--format", "Bearer {secret}")


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    hostile = he.ensure_hostile(lab)
    with switch_lab(lab, tmp_path_factory.mktemp("attack7"), POLICY, sandbox=he.SANDBOX, tport=TPORT,
                    prefix="a7", before_start=_setup_vault) as (gw, sw, net):
        yield he.Env(gw, sw, net, hostile, "")


def _upstream_got(env, marker: str) -> list[dict]:
    time.sleep(0.3)                  # the upstream's log is written after it answered
    return env.hostile.requests(marker)


# ------------------------------------------------------------- method overrides
# Every way a common framework lets a request name another method than its request line's:
# Google APIs, Azure, Symfony (X-HTTP-Method-Override), OData/Microsoft (X-HTTP-Method),
# Express method-override (X-Method-Override), Rails/Laravel/Rack (_method in the query).
CARRIERS = {
    "x-http-method-override": lambda m: ("", [("X-HTTP-Method-Override", m)]),
    "x-http-method": lambda m: ("", [("X-HTTP-Method", m)]),
    "x-method-override": lambda m: ("", [("x-method-override", m.lower())]),
    "query": lambda m: (f"?a=1&_method={m}", []),
}
PLACES = [("http", he.SINK, "explicit"), ("http", he.SINK, "transparent"),
          ("https", he.H, "explicit"), ("https", he.H, "transparent")]
PLACE_IDS = ["plain-explicit", "plain-transparent", "intercepted-explicit", "intercepted-transparent"]


@pytest.mark.parametrize("carrier", sorted(CARRIERS))
@pytest.mark.parametrize("scheme, host, mode", PLACES, ids=PLACE_IDS)
def test_a_method_override_does_not_get_around_a_method_rule(env, scheme, host, mode, carrier):
    """FINDING: the policy decided on the request line's method only. A POST (or GET) carrying
    `X-HTTP-Method-Override: DELETE` is a DELETE to every upstream that honours the header, past the
    rule that refuses DELETE to that host. A request that names another method is now decided by
    both, the stricter wins: here refused (rule_deny), and nothing reaches the upstream."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7m")
    query, headers = CARRIERS[carrier]("DELETE")
    r = sb.get(scheme, host, f"/{m}{query}", method="POST", headers=headers, body=b"")
    assert (r.status, r.reason) == (403, "rule_deny"), r
    assert _upstream_got(env, m) == [], "the overridden DELETE went upstream"


@pytest.mark.parametrize("mode", he.MODES)
@pytest.mark.parametrize("host, want", [(he.H, (403, "rule_deny")), (he.OTHER, (403, "method_override_binding"))],
                         ids=["method-rule", "binding"])
def test_a_method_override_in_http2_is_decided_for_both_methods(env, mode, host, want):
    """FINDING (same class, HTTP/2): the override header in an h2 request is decided the same way."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7h")
    r = sb.h2(host, [(":method", "GET"), (":scheme", "https"), (":authority", host), (":path", f"/{m}"),
                     ("x-http-method-override", "DELETE")])
    assert (r.status, r.reason) == want, r
    assert _upstream_got(env, m) == []


@pytest.mark.parametrize("scheme, host, mode", PLACES, ids=PLACE_IDS)
def test_two_different_method_overrides_are_refused(env, scheme, host, mode):
    """FINDING (same class): which of two override values a server takes is its own choice; a
    request naming two different methods is refused as ambiguous, whatever the rules say."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7a")
    r = sb.get(scheme, host, f"/{m}?_method=PUT", method="POST",
               headers=[("X-HTTP-Method-Override", "PATCH")], body=b"")
    assert (r.status, r.reason) == (400, "ambiguous_method_override"), r
    assert _upstream_got(env, m) == []


@pytest.mark.parametrize("scheme, host, mode", PLACES, ids=PLACE_IDS)
def test_an_override_to_an_allowed_method_still_goes_through(env, scheme, host, mode):
    """HOLDS (and the fix keeps it): an override to a method the rules allow is relayed as sent."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7p")
    r = sb.get(scheme, host, f"/{m}", method="POST", headers=[("X-HTTP-Method-Override", "PATCH")], body=b"")
    assert r.status == 200, r
    got = _upstream_got(env, m)
    assert len(got) == 1 and [v for k, v in got[0]["headers"] if k.lower() == "x-http-method-override"] == ["PATCH"]


@pytest.mark.parametrize("mode", he.MODES)
@pytest.mark.parametrize("carrier", sorted(CARRIERS))
def test_a_method_override_does_not_carry_a_key_bound_to_another_method(env, mode, carrier):
    """FINDING: the vault picked the binding by the request line's method: a GET carrying
    `X-HTTP-Method-Override: DELETE` got okey, bound for GET only, and the upstream ran a DELETE
    with it. The binding must hold for the overriding method too, else the request is refused
    (method_override_binding) and nothing goes upstream."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7k")
    query, headers = CARRIERS[carrier]("DELETE")
    r = sb.get("https", he.OTHER, f"/{m}{query}", headers=headers)
    assert (r.status, r.reason) == (403, "method_override_binding"), r
    assert _upstream_got(env, m) == [], "the key bound for GET went upstream on an overridden DELETE"
    assert he.KEY_B not in r.wire.decode("latin-1")


@pytest.mark.parametrize("mode", he.MODES)
def test_a_get_bound_key_is_injected_when_the_override_names_get(env, mode):
    """HOLDS (and the fix keeps it): an override naming the bound method keeps the key."""
    sb = env.sandbox(mode)
    m = he.new_marker("a7g")
    r = sb.get("https", he.OTHER, f"/{m}", headers=[("X-HTTP-Method-Override", "get")])
    assert r.status == 200, r
    he.injected_request(env.hostile, m, he.KEY_B)


@pytest.mark.parametrize("method, fields, query, want", [
    ("GET", [], [], None),
    ("POST", [(b"X-HTTP-Method-Override", b" delete ")], [], "DELETE"),
    ("POST", [(b"x-http-method-override", b"POST")], [("_METHOD", "post")], None),   # the same method
    ("POST", [(b"X-Method-Override", b"PUT")], [("_method", "put")], "PUT"),        # one other method, twice
    ("POST", [(b"X-HTTP-Method", b"PUT")], [("_method", "PATCH")], "ambiguous_method_override"),
    ("POST", [(b"X-HTTP-Method", b"PUT, DELETE")], [], "bad_method_override"),
    ("POST", [], [("_method", "")], "bad_method_override"),
])
def test_method_override_reads_every_carrier(method, fields, query, want):
    """The pure reading behind the tests above (egress.http_checks.method_override)."""
    from egress.http_checks import Refusal, method_override
    got = method_override(method, fields, query)
    assert (got.reason if isinstance(got, Refusal) else got) == want
