import base64
import pickle
from urllib.parse import quote, quote_plus

import httpx
import pytest
from mitmproxy.http import Headers

from vault import Vault

from vaulttest_helpers import SECRET, SECRET2, header_binding


def _inj(v, host="api.openai.com"):
    return v.resolve("acme", scheme="https", host=host, port=443, method="GET", path="/v1/models")


def test_repr_and_str_never_show_value(bound_vault):
    inj = _inj(bound_vault)
    for text in (repr(inj), str(inj), f"{inj}", "%s %r" % (inj, inj), repr([inj]), repr({"i": inj})):
        assert SECRET not in text
        assert base64.b64encode(SECRET.encode()).decode() not in text
    assert "openai" in repr(inj) and inj.fingerprint in repr(inj)
    with pytest.raises(TypeError):
        pickle.dumps(inj)
    with pytest.raises(Exception):
        inj.version = 3  # frozen


def test_apply_to_plain_dict_replaces_every_spelling(bound_vault):
    h = {"authorization": "Bearer sandbox-own", "AUTHORIZATION": "Basic x", "Accept": "*/*"}
    _inj(bound_vault).apply_to_headers(h)
    assert h == {"Accept": "*/*", "Authorization": f"Bearer {SECRET}"}


def test_apply_to_mitmproxy_headers_with_duplicates(bound_vault):
    h = Headers([(b"Authorization", b"Bearer a"), (b"authorization", b"Bearer b"), (b"X", b"1"),
                 (b"AUTHORIZATION", b"c")])
    _inj(bound_vault).apply_to_headers(h)
    assert h.get_all("authorization") == [f"Bearer {SECRET}"]
    assert h.fields.count((b"Authorization", f"Bearer {SECRET}".encode())) == 1
    assert h["X"] == "1" and len(h.fields) == 2


def test_apply_to_httpx_headers_with_duplicates(bound_vault):
    h = httpx.Headers([("Authorization", "a"), ("authorization", "b")])
    _inj(bound_vault).apply_to_headers(h)
    assert h.get_list("authorization") == [f"Bearer {SECRET}"]


def test_query_injection(bound_vault):
    bound_vault.put_secret("acme", "maps", "maps-key-12345678")
    bound_vault.add_binding({"id": "q", "tenant": "acme", "secret_id": "maps",
                             "match": {"hosts": ["maps.example"]}, "inject": {"type": "query", "name": "key"}})
    inj = _inj(bound_vault, "maps.example")
    pairs = inj.apply_to_query([("q", "x"), ("key", "sandbox"), ("KEY", "dup"), ("key", "again")])
    assert pairs == [("q", "x"), ("key", "maps-key-12345678")]
    h = {"Authorization": "keep"}
    inj.apply_to_headers(h)  # query injections leave headers alone
    assert h == {"Authorization": "keep"}


def test_basic_injection(bound_vault):
    bound_vault.put_secret("acme", "reg", "registry-pass-1234")
    bound_vault.add_binding({"id": "basic", "tenant": "acme", "secret_id": "reg",
                             "match": {"hosts": ["registry.example"]},
                             "inject": {"type": "basic", "username": "bot"}})
    inj = _inj(bound_vault, "registry.example")
    h = {"authorization": "Basic sandbox"}
    inj.apply_to_headers(h)
    assert h == {"Authorization": "Basic " + base64.b64encode(b"bot:registry-pass-1234").decode()}
    assert inj.scrub(h["Authorization"].encode()) == b"Basic [REDACTED]"


def test_scrub_removes_all_forms(bound_vault):
    inj = _inj(bound_vault)
    v = SECRET.encode()
    body = b"|".join([
        v, base64.b64encode(v), base64.urlsafe_b64encode(v).rstrip(b"="), quote(SECRET, safe="").encode(),
        v.hex().encode(), v.hex().upper().encode(), base64.b64encode(b"user:" + v), base64.b64encode(b"xy" + v)])
    out = inj.scrub(body)
    assert v not in out and out.count(b"[REDACTED]") == 8
    assert inj.value_forms and not any(f in out for f in inj.value_forms)
    assert inj.scrub(b"nothing to see") == b"nothing to see"


def test_find_leaks_placeholder_and_value_in_every_spot(bound_vault):
    v = bound_vault
    v.put_secret("acme", "other", "other-value-1234567")
    ph = v.placeholder_for("acme", "sb1", "openai")
    assert ph.startswith("cgph_") and SECRET not in ph
    assert ph == v.placeholder_for("acme", "sb1", "openai")
    assert ph != v.placeholder_for("acme", "sb2", "openai") != v.placeholder_for("globex", "sb1", "openai")
    cases = [
        f"Authorization: Bearer {ph}",                               # header
        f"GET /x?token={quote(ph)}&a=1",                              # query
        '{"api_key": "%s"}' % ph,                                     # JSON body
        base64.b64encode(f"user:{ph}".encode()).decode(),            # basic-auth style base64
        f"X-Key: {SECRET}",                                           # the real value
        f"body={quote_plus(SECRET)}",                                 # url-encoded value
        "data=" + base64.b64encode(("zz" + SECRET).encode()).decode(),  # base64 at another alignment
        base64.urlsafe_b64encode(SECRET.encode()).decode().rstrip("="),
    ]
    for data in cases:
        assert v.find_leaks("acme", "sb1", data) == ["openai"], data
        assert v.find_leaks("acme", "sb1", data.encode()) == ["openai"]
    assert v.find_leaks("acme", "sb1", "nothing here cgph_aaaa") == []
    assert v.find_leaks("acme", "sb2", f"Bearer {ph}") == []  # another sandbox's placeholder is not ours
    assert v.find_leaks("acme", "sb1", "other-value-1234567 " + ph) == ["openai", "other"]
    assert v.find_leaks(None, "sb1", SECRET) == []


def test_find_leaks_follows_rotation_and_keeps_old_versions(bound_vault):
    bound_vault.rotate("acme", "openai", SECRET2)  # v1 disabled, still a real key somewhere
    assert bound_vault.find_leaks("acme", "sb", SECRET2) == ["openai"]
    assert bound_vault.find_leaks("acme", "sb", SECRET) == ["openai"]
    bound_vault.destroy_version("acme", "openai", 1)
    assert bound_vault.find_leaks("acme", "sb", SECRET) == []


def test_placeholders_for_sandbox(bound_vault):
    assert bound_vault.placeholders_for_sandbox("acme", "sb1") == {}
    bound_vault.put_secret("acme", "gh", "ghp_value-1234567890")
    bound_vault.add_binding({**header_binding(bid="gh", secret_id="gh", hosts=["api.github.com"]),
                             "placeholder": True})
    phs = bound_vault.placeholders_for_sandbox("acme", "sb1")
    assert phs == {"gh": bound_vault.placeholder_for("acme", "sb1", "gh")}
    # the sandbox's placeholder in its own Authorization header is replaced on a bound request
    h = {"Authorization": f"token {phs['gh']}"}
    _inj(bound_vault, "api.github.com").apply_to_headers(h)
    assert h == {"Authorization": "Bearer ghp_value-1234567890"}


def test_placeholders_stable_across_reopen(bound_vault, vault_path, key_path):
    ph = bound_vault.placeholder_for("acme", "sb1", "openai")
    other = Vault.open(vault_path)
    other.unseal_with_key_file(key_path)
    assert other.placeholder_for("acme", "sb1", "openai") == ph
    other.close()


def test_what_resolve_keeps_between_requests_follows_every_change(bound_vault, vault_path, key_path):
    """resolve() keeps the selected binding, the active version and the compiled scrub forms
    between requests: a change made by another process (the daemon's admin API) is seen on
    the very next request, and the query string is not part of what is kept."""
    first = bound_vault.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET",
                                path="/v1/models?key=cgph_x")
    again = _inj(bound_vault)
    assert again is first and again.scrub_forms is first.scrub_forms        # compiled once
    assert all("cgph_x" not in str(k) for k in bound_vault._selected)
    other = Vault.open(vault_path)
    other.unseal_with_key_file(key_path)
    try:
        other.rotate("acme", "openai", SECRET2)
        rotated = _inj(bound_vault)
        assert rotated.version == first.version + 1 and SECRET2.encode() in rotated.value_forms
        assert rotated.scrub_forms.visible(SECRET2.encode()) and not rotated.scrub_forms.visible(SECRET.encode())
        other.add_binding(header_binding("b-models", path_prefixes=["/v1/models"]))
        assert _inj(bound_vault).binding_id == "b-models"       # more specific: selected at once
        other.remove_binding("b-models")
        other.remove_binding("b-openai")
        assert _inj(bound_vault) is None
    finally:
        other.close()
