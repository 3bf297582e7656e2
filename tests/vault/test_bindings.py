import pytest

from vault import AmbiguousBinding, InvalidBinding, PlaintextNotAllowed, Vault, parse_binding
from vault.bindings import select

from vaulttest_helpers import SECRET, header_binding


def _hdr(name, fmt="{secret}"):
    d = header_binding()
    d["inject"] = {"type": "header", "name": name, "format": fmt}
    return d


@pytest.mark.parametrize("name", ["Host", "content-length", "Transfer-Encoding", "CONNECTION", "Upgrade",
                                  "Keep-Alive", "TE", "Trailer", "Proxy-Authorization", "proxy-connection",
                                  ":authority", ":path", "X-Forwarded-For"])
def test_framing_and_hop_headers_refused(bound_vault, name):
    bound_vault.remove_binding("b-openai")
    with pytest.raises(InvalidBinding, match="refused|pseudo"):
        bound_vault.add_binding(_hdr(name))
    assert bound_vault.list_bindings() == []


@pytest.mark.parametrize("name", ["X Api Key", "X-Key\r\nHost", "", "Ä-key", "x:y"])
def test_invalid_header_names_refused(name):
    with pytest.raises(InvalidBinding):
        parse_binding(_hdr(name))


@pytest.mark.parametrize("fmt", ["Bearer", "{secret} {secret}", "Bearer {secret}\r\nX: y", "Token {Secret}"])
def test_format_must_hold_exactly_one_secret(fmt):
    with pytest.raises(InvalidBinding):
        parse_binding(_hdr("Authorization", fmt))


@pytest.mark.parametrize("host", ["api.*.x.com", "*x.com", "example.*", "*", "a..b", "exa mple.com", "bücher.de"])
def test_malformed_host_patterns_refused(host):
    with pytest.raises(InvalidBinding):
        parse_binding(header_binding(hosts=[host]))


def test_unknown_keys_and_types_refused():
    d = header_binding()
    d["match"]["hostz"] = ["x"]
    d["extra"] = 1
    with pytest.raises(InvalidBinding) as ei:
        parse_binding(d)
    assert len(ei.value.reasons) == 2
    with pytest.raises(InvalidBinding):
        parse_binding(header_binding(ports=[0]))
    with pytest.raises(InvalidBinding):
        parse_binding({**header_binding(), "inject": {"type": "basic", "username": "a:b"}})
    with pytest.raises(InvalidBinding):
        parse_binding(header_binding(path_prefixes=["/v1/../admin"]))


def test_binding_to_missing_secret_refused(vault):
    with pytest.raises(InvalidBinding, match="does not exist"):
        vault.add_binding(header_binding())


@pytest.mark.parametrize("second,ambiguous", [
    ({}, True),                                                   # identical match
    ({"hosts": ["API.OpenAI.com."]}, True),                       # same host after normalisation
    ({"ports": [443, 8443]}, True),                               # ports intersect
    ({"ports": [8443]}, False),                                   # disjoint ports
    ({"hosts": ["*.openai.com"]}, False),                         # wildcard is less specific
    ({"path_prefixes": ["/v1"]}, False),                          # path prefix is more specific
    ({"methods": ["POST"]}, False),                               # method list is more specific
])
def test_overlap_at_equal_specificity_refused(bound_vault, second, ambiguous):
    bound_vault.put_secret("acme", "other", "other-value-1234")
    doc = header_binding(bid="b2", secret_id="other", **second)
    if ambiguous:
        with pytest.raises(InvalidBinding, match="ambiguous.*b-openai"):
            bound_vault.add_binding(doc)
    else:
        bound_vault.add_binding(doc)


def test_overlap_in_other_tenant_is_fine(bound_vault):
    bound_vault.put_secret("globex", "openai", "globex-value-123456")
    bound_vault.add_binding(header_binding(bid="b-globex", tenant="globex"))
    a = bound_vault.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET", path="/")
    g = bound_vault.resolve("globex", scheme="https", host="api.openai.com", port=443, method="GET", path="/")
    assert a.occurs_in(SECRET) and g.occurs_in("globex-value-123456") and not g.occurs_in(SECRET)
    assert bound_vault.resolve("initech", scheme="https", host="api.openai.com", port=443, method="GET", path="/") is None
    assert bound_vault.resolve(None, scheme="https", host="api.openai.com", port=443, method="GET", path="/") is None


def test_path_prefix_overlap(bound_vault):
    bound_vault.remove_binding("b-openai")
    bound_vault.put_secret("acme", "other", "other-value-1234")
    bound_vault.add_binding(header_binding(path_prefixes=["/v1"]))
    with pytest.raises(InvalidBinding, match="ambiguous"):
        bound_vault.add_binding(header_binding(bid="b2", secret_id="other", path_prefixes=["/v2", "/v1"]))
    bound_vault.add_binding(header_binding(bid="b2", secret_id="other", path_prefixes=["/v1/chat"]))
    r = lambda p: bound_vault.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET", path=p)
    assert r("/v1/models").binding_id == "b-openai"
    assert r("/v1/chat/completions?x=1").binding_id == "b2"
    assert r("/v10") is None and r("/v2") is None


@pytest.mark.parametrize("path", ["/v1/../admin", "/v1/%2e%2e/admin", "/v1%2fadmin", "/v1/./x", "/v1\\..\\admin",
                                  "/v1/..;/admin", "/v1/x/.;/../../admin", "/v1/#/../admin",
                                  "v1/x"])
def test_path_tricks_do_not_match_a_path_restricted_binding(bound_vault, path):
    bound_vault.remove_binding("b-openai")
    bound_vault.add_binding(header_binding(path_prefixes=["/v1"]))
    assert bound_vault.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET", path=path) is None


def test_runtime_tie_raises_ambiguous():
    a = parse_binding(header_binding(bid="a", hosts=["x.com"]))
    b = parse_binding(header_binding(bid="b", hosts=["x.com"]))
    with pytest.raises(AmbiguousBinding, match=r"\['a', 'b'\]"):
        select([a, b], host="x.com", port=443, method="GET", path="/")


def test_wildcard_semantics(bound_vault):
    bound_vault.remove_binding("b-openai")
    bound_vault.add_binding(header_binding(hosts=["*.x.com"]))
    r = lambda h: bound_vault.resolve("acme", scheme="https", host=h, port=443, method="GET", path="/")
    assert r("a.x.com") and r("a.b.x.com") and r("A.X.COM.")
    for h in ("x.com", "evil-x.com", "x.com.evil.net", "ax.com"):
        assert r(h) is None
        assert not bound_vault.needs_interception("acme", h, 443)


def test_host_policy_check_refusal(vault_path, key_path):
    calls = []

    def check(tenant, host):
        calls.append((tenant, host))
        return None if host == "api.openai.com" else "no egress rule for this host"

    v = Vault.open(vault_path, host_policy_check=check)
    v.unseal_with_key_file(key_path)
    v.put_secret("acme", "openai", SECRET)
    with pytest.raises(InvalidBinding, match="evil.example.*no egress rule"):
        v.add_binding(header_binding(hosts=["api.openai.com", "evil.example"]))
    v.add_binding(header_binding())
    assert ("acme", "evil.example") in calls and ("acme", "api.openai.com") in calls
    v.close()


def test_broken_host_policy_check_fails_closed(vault_path, key_path):
    def check(tenant, host):
        raise RuntimeError("policy not loaded")

    v = Vault.open(vault_path, host_policy_check=check)
    v.unseal_with_key_file(key_path)
    v.put_secret("acme", "openai", SECRET)
    with pytest.raises(InvalidBinding, match="host policy check failed"):
        v.add_binding(header_binding())
    v.close()


def test_plaintext_only_when_allowed(bound_vault):
    with pytest.raises(PlaintextNotAllowed):
        bound_vault.resolve("acme", scheme="http", host="api.openai.com", port=443, method="GET", path="/")
    bound_vault.put_secret("acme", "local", "local-value-12345")
    bound_vault.add_binding(header_binding(bid="plain", secret_id="local", hosts=["svc.internal"], ports=[80],
                                           allow_plaintext=True))
    inj = bound_vault.resolve("acme", scheme="http", host="svc.internal", port=80, method="GET", path="/")
    assert inj.binding_id == "plain"


def test_needs_interception(bound_vault):
    assert bound_vault.needs_interception("acme", "API.openai.com.", 443)
    assert not bound_vault.needs_interception("acme", "api.openai.com", 8443)
    assert not bound_vault.needs_interception("globex", "api.openai.com", 443)
    assert not bound_vault.needs_interception(None, "api.openai.com", 443)
    assert not bound_vault.needs_interception("acme", "example.com", 443)


def test_method_restriction(bound_vault):
    bound_vault.remove_binding("b-openai")
    bound_vault.add_binding(header_binding(methods=["post"]))
    r = lambda m: bound_vault.resolve("acme", scheme="https", host="api.openai.com", port=443, method=m, path="/")
    assert r("POST") and r("post") and r("GET") is None
    assert bound_vault.needs_interception("acme", "api.openai.com", 443)
