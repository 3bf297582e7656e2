import base64
import os

from click.testing import CliRunner

from vault import Vault, generate_master_key
from vault.cli import vault_cli

from vaulttest_helpers import SECRET, SECRET2


def run(db, *args, input=None, env=None):
    r = CliRunner().invoke(vault_cli, ["--db", str(db), *args], input=input, env=env or {},
                           catch_exceptions=False)
    return r


def test_cli_end_to_end(tmp_path):
    db = tmp_path / "v.db"
    r = run(db, "init")
    assert r.exit_code == 0, r.output
    assert os.stat(f"{db}.key").st_mode & 0o777 == 0o600 and os.stat(db).st_mode & 0o777 == 0o600
    assert run(db, "init").exit_code == 1  # never over an existing vault
    assert run(db, "unseal-check").exit_code == 0

    r = run(db, "secret", "put", "acme", "openai", "--description", "key", input=SECRET + "\n")
    assert r.exit_code == 0 and "v1" in r.output and SECRET not in r.output
    value_file = tmp_path / "v2"
    value_file.write_text(SECRET2 + "\n")
    r = run(db, "secret", "rotate", "acme", "openai", "--from-file", str(value_file))
    assert r.exit_code == 0 and "v2" in r.output
    r = run(db, "binding", "add", "--id", "b1", "--tenant", "acme", "--secret", "openai",
            "--host", "api.openai.com", "--header", "Authorization")
    assert r.exit_code == 0, r.output
    r = run(db, "binding", "add", "--id", "b2", "--tenant", "acme", "--secret", "openai",
            "--host", "x.example", "--header", "Host")
    assert r.exit_code == 1 and "framing" in r.output
    r = run(db, "secret", "ls")
    assert "acme/openai" in r.output and "v1:disabled" in r.output and "v2:active" in r.output
    assert run(db, "binding", "ls").output.count('"id": "b1"') == 1
    assert run(db, "secret", "rm", "acme", "openai", "--yes").exit_code == 1  # still bound
    assert run(db, "version", "destroy", "acme", "openai", "1", "--yes").exit_code == 0
    assert "secrets: 1" in run(db, "status").output

    r = run(db, "token", "create", "--scope", "read", "--ttl", "1h")
    token = r.stdout.strip().splitlines()[-1]
    v = Vault.open(db)
    info = v.tokens.verify(token)
    assert info.scope == "read" and info.expires is not None
    # the value actually stored is the one from stdin / the file, without the newline
    v.unseal_with_key_file(f"{db}.key")
    inj = v.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET", path="/")
    assert inj.version == 2
    h = {}
    inj.apply_to_headers(h)
    assert h == {"Authorization": f"Bearer {SECRET2}"}
    v.close()

    out = "".join(run(db, *a).output for a in (["secret", "ls", "--json"], ["binding", "ls"], ["token", "ls"],
                                                  ["status", "--json"]))
    assert SECRET not in out and SECRET2 not in out and token not in out


def test_cli_wrong_key_and_env_key(tmp_path):
    db = tmp_path / "v.db"
    assert run(db, "init").exit_code == 0
    wrong = {"CUBEGATE_VAULT_KEY": base64.b64encode(generate_master_key().raw()).decode()}
    r = run(db, "unseal-check", env=wrong)
    assert r.exit_code == 1 and "wrong master key" in r.output
    os.chmod(f"{db}.key", 0o644)
    r = run(db, "unseal-check")
    assert r.exit_code == 1 and "group or other" in r.output


def test_cli_passphrase_vault(tmp_path):
    db = tmp_path / "p.db"
    env = {"CUBEGATE_VAULT_PASSPHRASE": "a long passphrase here"}
    assert run(db, "init", "--passphrase", env=env).exit_code == 0
    assert not os.path.exists(f"{db}.key")
    assert run(db, "secret", "put", "t", "s", input=SECRET, env=env).exit_code == 0
    assert run(db, "unseal-check", "--deep", env=env).exit_code == 0
    r = run(db, "unseal-check", env={"CUBEGATE_VAULT_PASSPHRASE": "nope nope"})
    assert r.exit_code == 1 and "wrong master key" in r.output


def test_cli_value_never_from_argv():
    put = vault_cli.commands["secret"].commands["put"]
    rotate = vault_cli.commands["secret"].commands["rotate"]
    for cmd in (put, rotate):
        assert [p.name for p in cmd.params if p.param_type_name == "argument"] == ["tenant", "secret_id"]
        assert not any(p.name in ("value", "secret") for p in cmd.params)
