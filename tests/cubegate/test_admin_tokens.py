"""Local token files and who they (or a vault token) make an actor, for the policy API and the runtime API."""
from __future__ import annotations

import stat

import pytest

import vault as vaultlib
from cubegate.admin_tokens import Actor, AdminTokens, ensure_token_file
from cubegate.runtime_api import RUNTIME_TOKEN_PREFIX, TokenCheck


@pytest.fixture
def vault_tokens(tmp_path):
    v = vaultlib.Vault.init(tmp_path / "vault.db", vaultlib.create_key_file(tmp_path / "vault.key"))
    yield v.tokens
    v.close()


def test_token_file_is_created_once_private_with_its_prefix(tmp_path):
    path = tmp_path / "sub" / "api.token"
    ensure_token_file(path, RUNTIME_TOKEN_PREFIX)
    first = path.read_text()
    assert first.startswith("cgrt_") and len(first.strip()) > 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ensure_token_file(path)
    assert path.read_text() == first          # never rewritten: running CLIs keep working
    ensure_token_file(tmp_path / "admin.token")
    assert (tmp_path / "admin.token").read_text().startswith("cgat_")


def test_policy_api_actors_keep_their_vault_scope(tmp_path, vault_tokens):
    ensure_token_file(tmp_path / "admin.token")
    local = (tmp_path / "admin.token").read_text().strip()
    read_info, read = vault_tokens.create("read", 3600, "reader")
    admin_info, admin = vault_tokens.create("admin", 3600, "admin")
    tokens = AdminTokens(tmp_path / "admin.token", vault_tokens)
    assert tokens.verify(local) == Actor("local", "admin")
    assert tokens.verify(read) == Actor(read_info.id, "read")
    assert tokens.verify(admin) == Actor(admin_info.id, "admin")
    assert tokens.verify(local + "x") is None and tokens.verify("") is None
    assert AdminTokens(tmp_path / "admin.token").verify(admin) is None     # no vault: the file only


def test_runtime_api_takes_admin_actors_only(tmp_path, vault_tokens):
    ensure_token_file(tmp_path / "api.token", RUNTIME_TOKEN_PREFIX)
    local = (tmp_path / "api.token").read_text().strip()
    _, read = vault_tokens.create("read", 3600, "reader")
    admin_info, admin = vault_tokens.create("admin", 3600, "admin")
    check = TokenCheck(tmp_path / "api.token", vault_tokens)
    assert check.actor(local) == "local"
    assert check.actor(admin) == admin_info.id
    assert check.actor(read) is None           # a read token may not run code in a sandbox
    assert check.actor("cgrt_wrong") is None
