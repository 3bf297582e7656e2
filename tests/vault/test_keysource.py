"""One key precedence (vault.unseal_from): env key, else key file, else passphrase; a source that
is there but wrong raises instead of falling through."""
from __future__ import annotations

import base64
import os

import pytest

from vault import KeyFileError, NoKeySource, Vault, WrongMasterKey, create_key_file, generate_master_key, unseal_from

PASS = "a long passphrase here"


def _b64(key) -> str:
    return base64.b64encode(key.raw()).decode()


@pytest.fixture
def keyfile_vault(tmp_path):
    key_file = tmp_path / "v.key"
    key = create_key_file(key_file)
    Vault.init(tmp_path / "v.db", key).close()
    return tmp_path / "v.db", key_file, key


@pytest.fixture
def passphrase_vault(tmp_path):
    Vault.init(tmp_path / "p.db", passphrase=PASS).close()
    return tmp_path / "p.db", tmp_path / "p.key"


def _open(db):
    return Vault.open(db)


@pytest.mark.parametrize("env_key,has_file,expected", [
    ("right", True, "env"),          # env first, even with a key file there
    ("right", False, "env"),
    (None, True, "key_file"),
    (None, False, NoKeySource),
    ("wrong", True, WrongMasterKey),  # a wrong env key never falls through to the file
    ("garbage", True, KeyFileError),
])
def test_keyfile_vault_precedence(keyfile_vault, env_key, has_file, expected):
    db, key_file, key = keyfile_vault
    environ = {"CUBEGATE_VAULT_PASSPHRASE": PASS}   # never used for a key-file vault
    if env_key:
        environ["CUBEGATE_VAULT_KEY"] = {"right": _b64(key), "wrong": _b64(generate_master_key()),
                                         "garbage": "%%%"}[env_key]
    if not has_file:
        os.unlink(key_file)
    v = _open(db)
    try:
        if isinstance(expected, str):
            assert unseal_from(v, key_file, environ=environ) == expected and not v.sealed
        else:
            with pytest.raises(expected):
                unseal_from(v, key_file, environ=environ)
            assert v.sealed
    finally:
        v.close()


def test_key_file_readable_by_others_is_refused_not_skipped(keyfile_vault):
    db, key_file, _ = keyfile_vault
    os.chmod(key_file, 0o644)
    v = _open(db)
    with pytest.raises(KeyFileError, match="group or other") as exc:
        unseal_from(v, key_file, environ={})
    assert not isinstance(exc.value, NoKeySource)
    v.close()


@pytest.mark.parametrize("environ,prompt,expected", [
    ({"CUBEGATE_VAULT_PASSPHRASE": PASS}, None, "passphrase"),
    ({}, lambda: PASS, "passphrase"),
    ({"CUBEGATE_VAULT_PASSPHRASE": PASS}, lambda: pytest.fail("env comes before the prompt"), "passphrase"),
    ({"CUBEGATE_VAULT_PASSPHRASE": "nope nope"}, None, WrongMasterKey),
    ({}, None, NoKeySource),
])
def test_passphrase_vault_precedence(passphrase_vault, environ, prompt, expected):
    db, key_file = passphrase_vault
    v = _open(db)
    try:
        if isinstance(expected, str):
            assert unseal_from(v, key_file, environ=environ, prompt=prompt) == expected and not v.sealed
        else:
            with pytest.raises(expected, match="CUBEGATE_VAULT_PASSPHRASE" if expected is NoKeySource else None):
                unseal_from(v, key_file, environ=environ, prompt=prompt)
    finally:
        v.close()
