"""`cubegate init` and `cubegate ca env`: a real host's first steps.

Unit part (no root): files and modes, idempotence, a key is never replaced.
Lab part: the daemon runs from exactly what init made (plus CUBEGATE_* variables
that point it at the lab's "internet"), and a curl that trusts nothing but the
variables `cubegate ca env` printed gets through an intercepted (credential-
injected) host; without them it refuses the gateway's certificate.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cubegate.settings import load_settings

REPO = Path(__file__).resolve().parents[2]
CUBEGATE = [sys.executable, "-m", "cubegate.cli"]
SECRET = "sk-init-test-4c8e1a2b9d7f"
_ports = itertools.count(18700, 10)


def cg(*args, env=None, input=None, check=True):
    e = {k: v for k, v in os.environ.items() if not k.startswith("CUBEGATE_")}
    e.update(PYTHONPATH=str(REPO), **(env or {}))
    r = subprocess.run([*CUBEGATE, *args], capture_output=True, text=True, cwd=REPO, env=e, input=input, timeout=60)
    if check:
        assert r.returncode == 0, f"cubegate {' '.join(args)}: {r.stdout}{r.stderr}"
    return r


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_init_creates_everything_with_the_right_modes_and_is_idempotent(tmp_path):
    state = tmp_path / "state"
    out = cg("init", "--state-dir", str(state)).stdout
    cfg = state / "settings.yaml"
    for f in (cfg, state / "policies" / "default.yaml", state / "ca" / "mitmproxy-ca.pem",
              state / "ca" / "mitmproxy-ca-cert.pem", state / "vault.key", state / "vault.db"):
        assert f.is_file(), f
    assert _mode(state) == 0o700 and _mode(state / "ca") == 0o700
    assert _mode(state / "vault.key") == 0o600 and _mode(state / "vault.db") == 0o600
    assert _mode(state / "ca" / "mitmproxy-ca.pem") == 0o600   # the CA's private key
    s = load_settings(cfg, environ={})
    assert Path(s.state_dir) == state and s.vault_key_file == state / "vault.key"
    assert "export CUBEGATE_CONFIG=" in out and "cubegate run" in out and "ca env" in out
    assert cg("-c", str(cfg), "policy", "check").returncode == 0
    assert cg("-c", str(cfg), "vault", "unseal-check").returncode == 0   # the key opens the vault

    key, ca_key, cfg_text = (state / "vault.key").read_bytes(), (state / "ca" / "mitmproxy-ca.pem").read_bytes(), \
        cfg.read_text()
    again = cg("init", "--state-dir", str(state)).stdout
    assert "created" not in again and again.count("kept") == 6, again
    assert (state / "vault.key").read_bytes() == key and cfg.read_text() == cfg_text
    assert (state / "ca" / "mitmproxy-ca.pem").read_bytes() == ca_key


def test_init_never_writes_a_key_for_a_vault_that_has_none(tmp_path):
    state = tmp_path / "state"
    cg("init", "--state-dir", str(state))
    (state / "vault.key").unlink()
    r = cg("init", "--state-dir", str(state))
    assert "no new key written" in r.stderr and not (state / "vault.key").exists()


def test_init_uses_an_existing_key_for_a_missing_vault(tmp_path):
    state = tmp_path / "state"
    cg("init", "--state-dir", str(state))
    key = (state / "vault.key").read_bytes()
    (state / "vault.db").unlink()
    cg("init", "--state-dir", str(state))
    assert (state / "vault.key").read_bytes() == key
    assert cg("-c", str(state / "settings.yaml"), "vault", "unseal-check").returncode == 0


def test_ca_env_prints_every_toolchain_variable_for_one_bundle(tmp_path):
    state = tmp_path / "state"
    cg("init", "--state-dir", str(state))
    out = cg("-c", str(state / "settings.yaml"), "ca", "env").stdout
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", out, re.M))
    assert set(exports) == {"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
                            "PIP_CERT", "GIT_SSL_CAINFO", "AWS_CA_BUNDLE"}
    (bundle,) = set(exports.values())
    text = Path(bundle).read_text()
    ours = (state / "ca" / "mitmproxy-ca-cert.pem").read_text()
    assert ours in text and text.count("BEGIN CERTIFICATE") > 10   # the system's CAs + ours
    assert "certutil -d sql:$HOME/.pki/nssdb -A" in out and str(state / "ca" / "mitmproxy-ca-cert.pem") in out
    # `eval` in a POSIX shell sets them (the output is valid shell)
    sh = subprocess.run(["sh", "-c", f'eval "$1"; echo "$SSL_CERT_FILE|$GIT_SSL_CAINFO"', "sh", out],
                        capture_output=True, text=True, timeout=10)
    assert sh.stdout.strip() == f"{bundle}|{bundle}"


def test_ca_env_without_a_ca_says_what_to_do(tmp_path):
    r = cg("--state-dir", str(tmp_path / "none"), "ca", "env", check=False)
    assert r.returncode == 1 and "cubegate init" in r.stderr


LAB_POLICY = """\
name: lab
applies_to: {sandboxes: [agent-1]}
tenant: default
default: deny
rules:
  - name: echo
    action: allow
    match: {hosts: [echo.allowed.test], ports: [443]}
"""


@pytest.mark.netns
def test_daemon_runs_from_init_and_ca_env_makes_curl_trust_an_intercepted_host(lab, tmp_path):
    state = tmp_path / "state"
    cg("init", "--state-dir", str(state))
    cfg = str(state / "settings.yaml")
    (state / "policies" / "lab.yaml").write_text(LAB_POLICY)
    base = next(_ports)
    env = {  # only what the lab needs beyond init's file: its "internet", and ports of our own
        "CUBEGATE_UPSTREAM__CA_BUNDLE": str(lab.ca.bundle_path),
        "CUBEGATE_UPSTREAM__NAMESERVERS": f"[{lab.dns_addr}]",
        "CUBEGATE_UPSTREAM__ALLOW_CIDRS": f"[{lab.lab_cidr}]",
        "CUBEGATE_PROXY__EXPLICIT_PORT": str(base), "CUBEGATE_OPS__PORT": str(base + 1),
        "CUBEGATE_VAULT__API_PORT": str(base + 2), "CUBEGATE_AUDIT__FSYNC": "never",
    }
    token = cg("-c", cfg, "identity", "add", "agent-1").stdout.strip()
    cg("-c", cfg, "vault", "secret", "put", "default", "echo-key", input=SECRET + "\n")
    cg("-c", cfg, "vault", "binding", "add", "--id", "b-echo", "--tenant", "default", "--secret", "echo-key",
       "--host", "echo.allowed.test", "--port", "443", "--header", "Authorization", "--format", "Bearer {secret}")
    ca_env = dict(re.findall(r"^export (\w+)=(\S+)$", cg("-c", cfg, "ca", "env").stdout, re.M))

    log = open(tmp_path / "gateway.log", "wb")
    proc = lab.spawn_gw([*CUBEGATE, "-c", cfg, "run"], stdout=log, stderr=log, cwd=REPO, lab_dns=False,
                        env=lab._env({"PYTHONPATH": str(REPO), **env}))
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
            r = lab.curl("-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://127.0.0.1:{base + 1}/readyz",
                         cacert=False, lab_dns=False)
            if r.stdout == "200":
                break
            assert time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()[-3000:]
            time.sleep(0.2)
        curl = ["curl", "-sS", "--max-time", "10", "-x", f"http://agent-1:{token}@127.0.0.1:{base}",
                "https://echo.allowed.test/first"]
        # trusting only what `ca env` printed (no --cacert): the intercepted host verifies
        ok = lab.run_gw(curl, lab_dns=False, env=lab._env(ca_env), timeout=20)
        assert ok.returncode == 0, ok.stderr
        auth = [v for k, v in json.loads(ok.stdout)["header_list"] if k.lower() == "authorization"]
        assert auth == ["Bearer [REDACTED]"], ok.stdout      # injected by the gateway, scrubbed on the way back
        assert SECRET not in ok.stdout
        # without those variables the same curl refuses the gateway's certificate (curl: 60)
        bare = {k: v for k, v in lab._env().items() if k not in ca_env}
        refused = lab.run_gw(curl, lab_dns=False, env=bare, timeout=20)
        assert refused.returncode == 60, (refused.returncode, refused.stderr)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
