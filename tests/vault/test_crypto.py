import base64
import hashlib
import os
import sqlite3

import pytest

from vault import (DecryptError, KeyFileError, Vault, WrongMasterKey, create_key_file, generate_master_key,
                   key_from_env, load_key_file)
from vault.crypto import KeyRing, MasterKey, version_aad

from vaulttest_helpers import SECRET, header_binding


def _resolve(v, tenant="acme"):
    return v.resolve(tenant, scheme="https", host="api.openai.com", port=443, method="GET", path="/v1/x")


def test_roundtrip_through_resolve(bound_vault):
    inj = _resolve(bound_vault)
    headers = {}
    inj.apply_to_headers(headers)
    assert headers == {"Authorization": f"Bearer {SECRET}"}
    assert inj.version == 1 and len(inj.fingerprint) == 12


def test_value_is_not_stored_in_clear(bound_vault, vault_path):
    bound_vault.close()
    for f in (vault_path, f"{vault_path}-wal"):
        if os.path.exists(f):
            assert SECRET.encode() not in open(f, "rb").read()


def test_envelope_uses_fresh_data_key_and_nonce_per_version(bound_vault, vault_path):
    bound_vault.rotate("acme", "openai", SECRET, previous="keep")  # same value twice
    rows = sqlite3.connect(vault_path).execute(
        "SELECT wrapped_key, nonce, ciphertext, fingerprint FROM versions ORDER BY version").fetchall()
    assert rows[0][0] != rows[1][0] and rows[0][1] != rows[1][1] and rows[0][2] != rows[1][2]
    assert rows[0][3] == rows[1][3]  # fingerprint is deterministic per vault


def test_fingerprint_is_keyed_not_a_plain_hash(bound_vault, tmp_path):
    fp = bound_vault.get_secret("acme", "openai").versions[0].fingerprint
    assert fp not in (hashlib.sha256(SECRET.encode()).hexdigest()[:12], hashlib.sha1(SECRET.encode()).hexdigest()[:12])
    other = Vault.init(tmp_path / "other.db", generate_master_key())
    other.put_secret("acme", "openai", SECRET)
    assert other.get_secret("acme", "openai").versions[0].fingerprint != fp


def test_wrong_master_key_is_a_clear_error(bound_vault, vault_path):
    bound_vault.close()
    v = Vault.open(vault_path)
    with pytest.raises(WrongMasterKey, match="wrong master key"):
        v.unseal(generate_master_key())
    assert v.sealed


def test_passphrase_vault(tmp_path):
    v = Vault.init(tmp_path / "p.db", passphrase="correct horse battery staple")
    v.put_secret("t1", "s1", SECRET)
    v.close()
    v = Vault.open(tmp_path / "p.db")
    assert v.key_source == "passphrase"
    with pytest.raises(WrongMasterKey):
        v.unseal_with_passphrase("wrong horse")
    v.unseal_with_passphrase("correct horse battery staple")
    assert not v.sealed and v.verify() == []


def test_env_key(tmp_path):
    key = generate_master_key()
    env = {"CUBEGATE_VAULT_KEY": base64.b64encode(key.raw()).decode()}
    assert key_from_env(env).raw() == key.raw()
    assert key_from_env({}) is None
    with pytest.raises(KeyFileError):
        key_from_env({"CUBEGATE_VAULT_KEY": "not base64!!"})
    with pytest.raises(KeyFileError):
        key_from_env({"CUBEGATE_VAULT_KEY": base64.b64encode(b"short").decode()})


def test_key_file_created_0600_and_never_overwritten(tmp_path):
    p = tmp_path / "k"
    create_key_file(p)
    assert os.stat(p).st_mode & 0o777 == 0o600
    with pytest.raises(KeyFileError, match="exists"):
        create_key_file(p)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_key_file_readable_by_others_is_refused(key_path, mode):
    os.chmod(key_path, mode)
    with pytest.raises(KeyFileError, match="group or other"):
        load_key_file(key_path)


def test_key_file_of_wrong_length_is_refused(tmp_path):
    p = tmp_path / "k"
    p.write_bytes(b"x" * 31)
    os.chmod(p, 0o600)
    with pytest.raises(KeyFileError, match="exactly 32"):
        load_key_file(p)


def test_master_key_repr_hides_bytes():
    k = generate_master_key()
    assert k.raw().hex() not in repr(k) and "hidden" in repr(k)


def _swap(vault_path, a: tuple, b: tuple):
    """Copy the encrypted columns of row b over row a (an attacker with write access to the file)."""
    c = sqlite3.connect(vault_path)
    src = c.execute("SELECT wrapped_key, nonce, ciphertext FROM versions WHERE tenant=? AND id=? AND version=?",
                    b).fetchone()
    c.execute("UPDATE versions SET wrapped_key=?, nonce=?, ciphertext=? WHERE tenant=? AND id=? AND version=?",
              (*src, *a))
    c.execute("UPDATE meta SET v = v + 1 WHERE k = 'generation'")
    c.commit()
    c.close()


@pytest.mark.parametrize("victim,donor", [
    (("acme", "openai", 1), ("acme", "other", 1)),      # between ids
    (("acme", "openai", 1), ("evil", "openai", 1)),     # between tenants
    (("acme", "openai", 2), ("acme", "openai", 1)),     # between versions (roll back)
])
def test_aad_prevents_swapping_ciphertexts(bound_vault, vault_path, victim, donor):
    bound_vault.put_secret("acme", "other", "other-value-1234567")
    bound_vault.put_secret("evil", "openai", "evil-value-12345678")
    if victim[2] == 2:
        bound_vault.rotate("acme", "openai", "second-value-123456", previous="keep")
    assert _resolve(bound_vault).version == victim[2]  # the victim row is the one injected
    _swap(vault_path, victim, donor)
    with pytest.raises(DecryptError, match="failed authentication") as ei:
        _resolve(bound_vault)
    problems = bound_vault.verify()
    assert len(problems) == 1 and f"{victim[0]}/{victim[1]} version {victim[2]}" in problems[0]
    for v in ("other-value-1234567", "evil-value-12345678", "second-value-123456", SECRET):
        assert v not in problems[0] and v not in str(ei.value)


@pytest.mark.parametrize("column", ["ciphertext", "nonce", "wrapped_key"])
def test_tampered_ciphertext_fails_clearly(bound_vault, vault_path, column):
    c = sqlite3.connect(vault_path)
    blob = bytearray(c.execute(f"SELECT {column} FROM versions").fetchone()[0])
    blob[len(blob) // 2] ^= 0x01
    c.execute(f"UPDATE versions SET {column}=?", (bytes(blob),))
    c.execute("UPDATE meta SET v = v + 1 WHERE k = 'generation'")
    c.commit()
    with pytest.raises(DecryptError) as ei:
        _resolve(bound_vault)
    assert SECRET not in str(ei.value) and "acme/openai version 1" in str(ei.value)


def test_truncated_ciphertext_fails_clearly(bound_vault, vault_path):
    c = sqlite3.connect(vault_path)
    c.execute("UPDATE versions SET ciphertext = substr(ciphertext, 1, 5)")
    c.execute("UPDATE meta SET v = v + 1 WHERE k = 'generation'")
    c.commit()
    with pytest.raises(DecryptError):
        _resolve(bound_vault)


def test_aad_is_unambiguous():
    vid = os.urandom(16)
    assert version_aad(vid, "a", "bc", 1) != version_aad(vid, "ab", "c", 1)
    assert version_aad(vid, "a", "b", 11) != version_aad(vid, "a", "b1", 1)


def test_keyring_rejects_wrong_key_directly():
    vid = os.urandom(16)
    k1, k2 = KeyRing(generate_master_key(), vid), KeyRing(generate_master_key(), vid)
    aad = version_aad(vid, "t", "s", 1)
    w, n, c = k1.encrypt(aad, b"value-123456")
    assert k1.decrypt(aad, w, n, c, "x") == b"value-123456"
    with pytest.raises(DecryptError):
        k2.decrypt(aad, w, n, c, "x")
    with pytest.raises(WrongMasterKey):
        k2.check_kcv(k1.make_kcv())
    with pytest.raises(KeyFileError):
        MasterKey(b"too short")
