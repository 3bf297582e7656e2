"""The daemon, `cubegate identity placeholders` and `cubegate vault` unseal the same way
(vault.unseal_from): a passphrase vault opens from CUBEGATE_VAULT_PASSPHRASE in all three
(before, only the vault CLI could), and the env key wins over the key file in all three."""
from __future__ import annotations

import base64
import os

import pytest
import yaml
from click.testing import CliRunner

import vault as vaultlib
from cubegate.cli import main
from cubegate.daemon import Daemon

from tests.cubegate.daemon_util import daemon_settings, readyz, run_daemon

PASS = "a long passphrase here"


@pytest.fixture
def clean_env(monkeypatch):
    for var in vaultlib.KEY_ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def _setup(tmp_path):
    s = daemon_settings(tmp_path)
    os.makedirs(s.state_dir)
    cfg = tmp_path / "settings.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": s.state_dir, "policy_dir": s.policy_dir}))
    return s, cfg


def _cli(cfg, *args, env=None, input=None):
    return CliRunner().invoke(main, ["-c", str(cfg), *args], env=env or {}, input=input)


def _daemon_vault_state(s) -> str:
    d = Daemon(s)

    async def scenario():
        return await readyz(s.ops.port, lambda code, body: "vault" in body.get("checks", {}))
    _, body = run_daemon(d, scenario)
    return body["checks"]["vault"]["detail"]


def test_passphrase_vault_opens_the_same_way_everywhere(tmp_path, clean_env):
    s, cfg = _setup(tmp_path)
    env = {"CUBEGATE_VAULT_PASSPHRASE": PASS}
    assert _cli(cfg, "vault", "init", "--passphrase", env=env).exit_code == 0
    assert _cli(cfg, "vault", "secret", "put", "default", "k1", env=env, input="s3cret-value-123\n").exit_code == 0
    assert _cli(cfg, "identity", "add", "sb-1").exit_code == 0

    assert _cli(cfg, "vault", "unseal-check", env=env).exit_code == 0
    r = _cli(cfg, "identity", "placeholders", "sb-1", env=env)
    assert r.exit_code == 0, r.output
    os.environ.update(env)   # the daemon reads it from its environment, then drops it
    assert _daemon_vault_state(s) == "unsealed"
    assert "CUBEGATE_VAULT_PASSPHRASE" not in os.environ

    for args in (("vault", "unseal-check"), ("identity", "placeholders", "sb-1")):
        r = _cli(cfg, *args, env={"CUBEGATE_VAULT_PASSPHRASE": ""})
        assert r.exit_code == 1 and "no master key" in r.output, (args, r.output)
    assert _daemon_vault_state(s).startswith("sealed")


def test_env_key_wins_over_the_key_file_everywhere(tmp_path, clean_env):
    s, cfg = _setup(tmp_path)
    assert _cli(cfg, "vault", "init").exit_code == 0
    assert _cli(cfg, "identity", "add", "sb-1").exit_code == 0
    wrong = {"CUBEGATE_VAULT_KEY": base64.b64encode(vaultlib.generate_master_key().raw()).decode()}
    for args in (("vault", "unseal-check"), ("identity", "placeholders", "sb-1")):
        assert _cli(cfg, *args).exit_code == 0
        r = _cli(cfg, *args, env=wrong)
        assert r.exit_code == 1 and "wrong master key" in r.output.lower(), (args, r.output)
    assert _daemon_vault_state(s) == "unsealed"
    os.environ.update(wrong)
    assert _daemon_vault_state(s).startswith("sealed")
    assert "CUBEGATE_VAULT_KEY" not in os.environ
