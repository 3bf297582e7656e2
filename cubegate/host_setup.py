"""Setting up a real host (not the lab): `cubegate init` and `cubegate ca env`.

`init` creates what a first `cubegate run` needs and never replaces anything
that exists (a key above all: a new key would lock the vault for good).
`ca env` writes a bundle of the system's CAs plus the gateway's, and prints
the variables that make common toolchains trust it.
"""
from __future__ import annotations

import os
import shlex
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import yaml

STARTER_POLICY = """\
# Starter policy written by `cubegate init`. Everything not allowed here is denied.
# Edit it while the daemon runs: changes are picked up within policy_poll_seconds.
# Syntax and precedence: egress/policy/PRECEDENCE.md in the cubegate sources.
name: host-default
default: deny
tenant: default            # vault tenant whose credential bindings apply here
rules:
  - name: first-steps      # the hosts the README's "On your own host" walk-through uses
    action: allow
    match: {hosts: [example.com, httpbin.org], ports: [443]}
"""

# Toolchain variables that name a CA bundle file (all accept system CAs + ours in one file).
CA_ENV_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
               "PIP_CERT", "GIT_SSL_CAINFO", "AWS_CA_BUNDLE")
BUNDLE_NAME = "ca-bundle.pem"
_SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                   "/etc/ssl/cert.pem")


@dataclass
class InitReport:
    created: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def settings_text(state_dir: Path) -> str:
    doc = {
        "state_dir": str(state_dir),
        "policy_dir": str(state_dir / "policies"),
        "proxy": {"listen_host": "127.0.0.1", "explicit_port": 8080},
        "ops": {"listen_host": "127.0.0.1", "port": 9090},
        "vault": {"api_port": 9091},
    }
    return ("# cubegate settings written by `cubegate init` (every key: README, \"Settings\").\n"
            "# CUBEGATE_<SECTION>__<KEY> environment variables override this file.\n"
            + yaml.safe_dump(doc, sort_keys=False))


def _write_new(path: Path, text: str, mode: int) -> bool:
    """Create `path` with `text` (mode); False if it exists (never replaced)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def init_host(state_dir: Path, settings_path: Path) -> InitReport:
    """State dir (0700), settings, starter policy, interception CA, vault key (0600) + vault file."""
    import vault as vaultlib
    from cubegate.settings import load_settings
    from egress.mitm_ca import ca_paths, ensure_ca

    rep = InitReport()
    state_dir = state_dir.absolute()
    (rep.kept if state_dir.is_dir() else rep.created).append(f"state dir {state_dir}")
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    settings_path.parent.mkdir(parents=True, exist_ok=True)
    (rep.created if _write_new(settings_path, settings_text(state_dir), 0o644) else rep.kept).append(
        f"settings {settings_path}")
    s = load_settings(settings_path, environ={})   # the file as it is now (ours, or the one that was there)
    policy_dir = Path(s.policy_dir)
    if not policy_dir.is_absolute():
        policy_dir = settings_path.parent / policy_dir
    policy_dir.mkdir(parents=True, exist_ok=True)
    if not any(policy_dir.glob("*.y*ml")):
        _write_new(policy_dir / "default.yaml", STARTER_POLICY, 0o644)
        rep.created.append(f"policy {policy_dir / 'default.yaml'}")
    else:
        rep.kept.append(f"policies in {policy_dir}")
    ca_existed = ca_paths(s.ca_dir)[0].exists()
    ensure_ca(s.ca_dir)
    (rep.kept if ca_existed else rep.created).append(f"interception CA {ca_paths(s.ca_dir)[1]}")
    key_file, db = s.vault_key_file, s.vault_db
    if key_file.exists():
        rep.kept.append(f"vault key {key_file}")
    elif db.exists():
        rep.warnings.append(f"vault {db} exists without its key file {key_file}: no new key written "
                            "(it could not open that vault); unseal with CUBEGATE_VAULT_KEY or restore the key")
    else:
        key_file.parent.mkdir(parents=True, exist_ok=True)
        vaultlib.create_key_file(key_file)   # 0600, O_EXCL: never over an existing key
        rep.created.append(f"vault key {key_file} (mode 0600: back it up)")
    if db.exists():
        rep.kept.append(f"vault {db}")
    elif key_file.exists():
        vaultlib.Vault.init(db, vaultlib.load_key_file(key_file)).close()
        rep.created.append(f"vault {db}")
    return rep


def next_steps(settings_path: Path) -> str:
    cfg = shlex.quote(str(settings_path))
    return f"""\
Next:
  export CUBEGATE_CONFIG={cfg}
  cubegate run &                                   # explicit proxy on 127.0.0.1:8080, /readyz on :9090
  TOKEN=$(cubegate identity add my-agent)          # the agent's proxy credential (shown once)
  eval "$(cubegate ca env)"                        # this shell's tools trust the gateway's CA
  export HTTPS_PROXY=http://my-agent:$TOKEN@127.0.0.1:8080
  curl https://example.com/                        # allowed by the starter policy
  curl https://github.com/                         # denied (403): not in the policy
  # a credential the agent never sees: README, "On your own host"
"""


# ------------------------------------------------------------------ ca env
def system_ca_bundle() -> Path | None:
    # OpenSSL's compiled-in file, not .cafile: that one follows SSL_CERT_FILE, which may be our own bundle
    for candidate in (ssl.get_default_verify_paths().openssl_cafile, *_SYSTEM_BUNDLES):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    try:
        import certifi   # installed with mitmproxy
        return Path(certifi.where())
    except ImportError:
        return None


def write_bundle(ca_cert: Path, dest: Path, system_bundle: Path | None) -> Path:
    """dest = the system's CAs + the gateway's CA (rewritten each time: system CAs change)."""
    parts = [system_bundle.read_text()] if system_bundle is not None else []
    parts.append(f"# cubegate interception CA ({ca_cert})\n" + ca_cert.read_text())
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text("\n".join(p if p.endswith("\n") else p + "\n" for p in parts))
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)
    return dest


def ca_env_text(bundle: Path, ca_cert: Path, system_bundle: Path | None) -> str:
    b = shlex.quote(str(bundle))
    lines = [f"# Trust the cubegate gateway's CA in this shell:  eval \"$(cubegate ca env)\"",
             f"# {bundle}: " + (f"the system CAs ({system_bundle}) + " if system_bundle else
                                "(no system CA bundle found: only) ") + "the gateway's CA",
             *[f"export {var}={b}" for var in CA_ENV_VARS],
             "# Browsers (Chromium, Firefox) read an NSS database instead (apt install libnss3-tools):",
             f"#   certutil -d sql:$HOME/.pki/nssdb -A -t C,, -n cubegate -i {shlex.quote(str(ca_cert))}",
             "#   (certutil imports only the first certificate of a file: give it the CA alone, as here)"]
    return "\n".join(lines) + "\n"
