"""Attack pass 7 on the vault: a stored value is checked again where it becomes a header.

The write path refuses CR, LF and NUL (vault.core._check_value); a store written another way
(an older version, a restore, anyone holding the master key and the file) is not held to it. These
tests put such a version in the store with the vault's own encryption, past the write check, and
ask for the injection the gateway would apply.
"""
import pytest

from vault import VaultError
from vault.core import Vault

from vaulttest_helpers import SECRET, header_binding

# Each one ends the header line early (request smuggling), is not a field-value byte
# (RFC 9110 5.5: VCHAR, obs-text, SP, HTAB), or would cut a C string at the next hop.
BAD = {"crlf": b"\r\nX-Evil: 1", "lf": b"\nX-Evil: 1", "cr": b"\rX", "nul": b"\0x", "vt": b"\x0bx",
       "esc": b"\x1b[2J", "del": b"\x7fx"}


def _store_past_the_write_check(vault: Vault, tenant: str, secret_id: str, value: bytes) -> None:
    keys = vault._require_keys()
    with vault._store.write() as c:
        last = c.execute("SELECT MAX(version) FROM versions WHERE tenant=? AND id=?",
                         (tenant, secret_id)).fetchone()[0]
        c.execute("UPDATE versions SET state='disabled' WHERE tenant=? AND id=?", (tenant, secret_id))
        vault._insert_version(c, keys, tenant, secret_id, last + 1, value)


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("kind", ["header", "basic", "query"])
def test_a_stored_value_that_breaks_a_header_is_never_injected(vault, kind, bad):
    """FINDING: build_injection set whatever the store held: a version holding CR/LF became a
    header line of its own upstream (`Authorization: Bearer sk-...\\r\\nX-Evil: 1`), a control byte a
    header value the next hop reads its own way. Now every version is checked where it is turned
    into an injection (the write rule for every kind; a header's value as RFC 9110 field-value):
    the request fails closed with a vault error that names the secret, never its value."""
    inject = {"header": {"type": "header", "name": "Authorization", "format": "Bearer {secret}"},
              "basic": {"type": "basic", "username": "u"},
              "query": {"type": "query", "name": "key"}}[kind]
    vault.put_secret("acme", "openai", SECRET)
    vault.add_binding({**header_binding(), "inject": inject})
    value = SECRET.encode() + BAD[bad]
    _store_past_the_write_check(vault, "acme", "openai", value)
    if kind != "header" and bad not in ("crlf", "lf", "cr", "nul"):
        # base64 (basic) and percent-encoding (query) carry any other byte safely
        inj = vault.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET", path="/")
        assert inj is not None and inj.version == 2
        return
    with pytest.raises(VaultError) as e:
        vault.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET", path="/")
    assert SECRET not in str(e.value) and SECRET[:12] not in repr(e.value)
    assert "secret openai version 2" in str(e.value)


def test_a_clean_value_is_still_injected(vault):
    """HOLDS (and the fix keeps it): tab and non-ASCII bytes are field-value bytes."""
    vault.put_secret("acme", "openai", SECRET + "\tü")
    vault.add_binding(header_binding())
    inj = vault.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET", path="/")
    headers: dict = {}
    inj.apply_to_headers(headers)
    assert headers == {"Authorization": "Bearer " + SECRET + "\tü"}


@pytest.mark.parametrize("bad", ["crlf", "lf", "cr", "nul"])
def test_the_write_path_refuses_what_breaks_framing(vault, bad):
    """HOLDS: put and rotate refuse CR, LF and NUL, without quoting the value."""
    from vault import InvalidValue
    with pytest.raises(InvalidValue) as e:
        vault.put_secret("acme", "openai", SECRET.encode() + BAD[bad])
    assert SECRET not in str(e.value)
    vault.put_secret("acme", "openai", SECRET)
    with pytest.raises(InvalidValue):
        vault.rotate("acme", "openai", SECRET.encode() + BAD[bad])
