import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from vault import (Conflict, InvalidName, InvalidValue, NotFound, SecretUnavailable, Vault, VaultCorrupt,
                   VaultNotFound, VaultSealed, load_key_file)

from vaulttest_helpers import SECRET, SECRET2, header_binding

N_SECRETS = 40


def _req(v, tenant="acme"):
    return v.resolve(tenant, scheme="https", host="api.openai.com", port=443, method="POST", path="/v1/chat")


@pytest.fixture
def filled_path(vault, vault_path):
    for i in range(N_SECRETS):
        vault.put_secret("acme", f"s{i}", f"value-{i:04d}-abcdefgh", description="d" * 200)
    vault.close()
    assert not os.path.exists(f"{vault_path}-wal") or os.path.getsize(f"{vault_path}-wal") == 0
    return vault_path


def test_open_missing_file(tmp_path):
    with pytest.raises(VaultNotFound):
        Vault.open(tmp_path / "nope.db")
    assert not (tmp_path / "nope.db").exists()


def test_vault_file_is_0600(vault_path):
    assert os.stat(vault_path).st_mode & 0o777 == 0o600


def test_init_refuses_existing_file(vault_path, key_path):
    with pytest.raises(VaultCorrupt, match="exists already"):
        Vault.init(vault_path, load_key_file(key_path))


@pytest.mark.parametrize("content", [b"", b"garbage" * 1000, os.urandom(8192),
                                     b"SQLite format 3\0" + os.urandom(8192)])
def test_garbage_file_is_vault_corrupt(tmp_path, content):
    p = tmp_path / "g.db"
    p.write_bytes(content)
    with pytest.raises(VaultCorrupt):
        Vault.open(p)
    assert p.read_bytes() == content  # opening did not "repair" or rewrite it


def test_other_sqlite_db_is_not_a_vault(tmp_path):
    p = tmp_path / "other.db"
    c = sqlite3.connect(p)
    c.execute("CREATE TABLE x (a)")
    c.commit()
    c.close()
    with pytest.raises(VaultCorrupt, match="not a cubegate vault"):
        Vault.open(p)


def test_truncated_file_is_refused_or_fully_intact(filled_path, key_path, tmp_path):
    size = os.path.getsize(filled_path)
    assert size > 8 * 4096
    refused = 0
    for cut in (0, 50, 100, 4096, 4096 + 17, size // 2, size - 4096, size - 1):
        p = tmp_path / f"cut{cut}.db"
        shutil.copy(filled_path, p)
        os.truncate(p, cut)
        try:
            v = Vault.open(p)
        except VaultCorrupt as e:
            refused += 1
            assert "value-" not in str(e)
            continue
        # Only acceptable if nothing was lost (e.g. only unused bytes of the last page were cut)
        v.unseal_with_key_file(key_path)
        assert v.verify() == []
        assert len(v.list_secrets()) == N_SECRETS
        v.close()
    assert refused >= 7


def test_destroy_wipes_ciphertext_from_the_file(bound_vault, vault_path):
    raw = sqlite3.connect(vault_path)
    ct = raw.execute("SELECT ciphertext FROM versions WHERE version=1").fetchone()[0]
    raw.close()
    bound_vault.rotate("acme", "openai", SECRET2, previous="keep")
    info = bound_vault.destroy_version("acme", "openai", 1)
    assert [v.state for v in info.versions] == ["destroyed", "active"]
    assert info.versions[0].fingerprint  # metadata kept
    raw = sqlite3.connect(vault_path)
    assert raw.execute("SELECT wrapped_key, nonce, ciphertext FROM versions WHERE version=1").fetchone() == (None, None, None)
    raw.close()
    for f in (vault_path, f"{vault_path}-wal"):
        if os.path.exists(f):
            assert ct not in open(f, "rb").read()
    with pytest.raises(Conflict):
        bound_vault.enable_version("acme", "openai", 1)
    assert _req(bound_vault).version == 2


def test_rotate_previous_modes(bound_vault):
    assert bound_vault.rotate("acme", "openai", SECRET2).current_version == 2
    assert [v.state for v in bound_vault.get_secret("acme", "openai").versions] == ["disabled", "active"]
    info = bound_vault.rotate("acme", "openai", SECRET, previous="keep")
    assert [v.state for v in info.versions] == ["disabled", "active", "active"]
    info = bound_vault.rotate("acme", "openai", SECRET2, previous="destroy")
    assert [v.state for v in info.versions] == ["destroyed", "destroyed", "destroyed", "active"]


def test_disable_current_version_fails_closed(bound_vault):
    bound_vault.disable_version("acme", "openai", 1)
    with pytest.raises(SecretUnavailable, match="no active version"):
        _req(bound_vault)
    bound_vault.enable_version("acme", "openai", 1)
    assert _req(bound_vault).version == 1


def test_rotation_takes_effect_on_next_call(bound_vault):
    first = _req(bound_vault)
    assert first.occurs_in(SECRET)
    bound_vault.rotate("acme", "openai", SECRET2)
    second = _req(bound_vault)
    assert second.version == 2 and second.occurs_in(SECRET2) and not second.occurs_in(SECRET)


def test_rotation_by_another_instance_takes_effect(bound_vault, vault_path, key_path):
    assert _req(bound_vault).version == 1  # warm the caches
    other = Vault.open(vault_path)
    other.unseal_with_key_file(key_path)
    other.rotate("acme", "openai", SECRET2)
    inj = _req(bound_vault)
    assert inj.version == 2 and inj.occurs_in(SECRET2)
    other.remove_binding("b-openai")
    assert _req(bound_vault) is None
    other.close()


def test_rotation_by_another_process_takes_effect(bound_vault, vault_path, key_path):
    assert _req(bound_vault).version == 1
    code = textwrap.dedent(f"""
        import sys
        from vault import Vault
        v = Vault.open({str(vault_path)!r}); v.unseal_with_key_file({str(key_path)!r})
        v.rotate("acme", "openai", sys.stdin.read())
    """)
    subprocess.run([sys.executable, "-c", code], input=SECRET2, text=True, check=True, timeout=60,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    inj = _req(bound_vault)
    assert inj.version == 2 and inj.occurs_in(SECRET2)


CRASH_WRITER = textwrap.dedent("""
    import sys
    from vault import Vault
    v = Vault.open(sys.argv[1]); v.unseal_with_key_file(sys.argv[2])
    for i in range(2, 5000):
        v.rotate("acme", "openai", f"crash-value-{i:06d}-padding", previous="keep")
        print(i, flush=True)   # printed only after COMMIT returned
""")


def test_crash_mid_write_loses_no_committed_version(bound_vault, vault_path, key_path):
    bound_vault.close()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, str(vault_path), str(key_path)],
                            stdout=subprocess.PIPE, text=True, cwd=repo)
    committed = 1
    deadline = time.monotonic() + 30
    try:
        while committed < 40 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            committed = int(line)
        os.kill(proc.pid, signal.SIGKILL)  # lands somewhere inside a transaction
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    assert committed >= 40, "writer did not get going"
    v = Vault.open(vault_path)  # integrity check passes after WAL recovery
    v.unseal_with_key_file(key_path)
    assert v.verify() == []
    versions = v.get_secret("acme", "openai").versions
    numbers = [x.version for x in versions]
    assert numbers == list(range(1, len(numbers) + 1))  # no holes
    assert len(numbers) >= committed  # every committed version survived (one more may have committed)
    inj = _req(v)
    assert inj.version == len(numbers) and inj.occurs_in(f"crash-value-{inj.version:06d}-padding")
    v.close()


@pytest.mark.parametrize("bad", ["", "UPPER", "-lead", "a/b", "a b", "x" * 65, "a\n", "ä"])
def test_invalid_names_refused(vault, bad):
    with pytest.raises(InvalidName):
        vault.put_secret(bad, "ok", SECRET)
    with pytest.raises(InvalidName):
        vault.put_secret("ok", bad, SECRET)


@pytest.mark.parametrize("bad", ["s3cr7", "with\r\nheader: x-injected", "nul\0inside-value", ""])
def test_unsafe_values_refused_without_echo(vault, bad):
    with pytest.raises(InvalidValue) as ei:
        vault.put_secret("acme", "x", bad)
    if bad:
        assert bad not in str(ei.value)


def test_put_existing_and_unknown(bound_vault):
    with pytest.raises(Conflict):
        bound_vault.put_secret("acme", "openai", SECRET2)
    with pytest.raises(NotFound):
        bound_vault.rotate("acme", "nope", SECRET2)
    with pytest.raises(NotFound):
        bound_vault.disable_version("acme", "openai", 9)


def test_delete_refused_while_bound(bound_vault):
    with pytest.raises(Conflict, match="b-openai"):
        bound_vault.delete_secret("acme", "openai")
    bound_vault.remove_binding("b-openai")
    bound_vault.delete_secret("acme", "openai")
    assert bound_vault.list_secrets() == []


def test_sealed_vault(bound_vault):
    bound_vault.seal()
    assert bound_vault.sealed
    with pytest.raises(VaultSealed):
        _req(bound_vault)
    with pytest.raises(VaultSealed):
        bound_vault.put_secret("acme", "x", SECRET)
    with pytest.raises(VaultSealed):
        bound_vault.placeholder_for("acme", "sb1", "openai")
    # metadata and routing decisions still work
    assert bound_vault.needs_interception("acme", "api.openai.com", 443)
    assert bound_vault.resolve("acme", scheme="https", host="example.com", port=443, method="GET", path="/") is None
    assert bound_vault.list_secrets()[0].id == "openai"


def test_metadata_never_carries_value(bound_vault):
    text = repr(bound_vault.list_secrets()) + repr(bound_vault.status()) + repr(bound_vault.list_bindings())
    assert SECRET not in text
