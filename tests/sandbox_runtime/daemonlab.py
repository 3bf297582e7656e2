"""The real daemon with the sandbox runtime on, for lab tests: namespace sandboxes on the cubevs
switch in the lab's gw namespace, the transparent gateway, sandbox DNS and the vault.

One way to start it and to talk to it (runtime API, `cubegate sandbox ...`), shared by the
runtime, snapshot, access-request, e2b and console tests."""
from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import httpx

from testbed.netns import call_in_netns
from tests.gateway.switchlab import HUB_IP, switch_lab

REPO = Path(__file__).resolve().parents[2]


def lab_policy(name: str = "acme-agents") -> str:
    """Tenant acme's sandboxes may reach the lab's api/echo upstreams on 443 and 80, nothing else."""
    return f"""\
name: {name}
tenant: acme
applies_to: {{labels: {{tenant: acme}}}}
default: deny
rules:
  - name: lab
    action: allow
    match: {{hosts: [api.allowed.test, echo.allowed.test], ports: [443, 80]}}
"""


def put_placeholder_secret(gw, secret: str) -> None:
    """Vault set-up: acme's secret "openai", injected as a Bearer token at echo.allowed.test:443
    in place of the sandbox's placeholder."""
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "openai", input=secret + "\n")
    gw.cli("vault", "binding", "add", "--id", "b-echo", "--tenant", "acme", "--secret", "openai",
           "--host", "echo.allowed.test", "--port", "443", "--header", "Authorization",
           "--format", "Bearer {secret}", "--placeholder")


def runtime_settings(api_port: int, **runtime) -> dict:
    """Settings for sandbox DNS on the switch's hub address and the runtime API on api_port."""
    return {"dns": {"listen_host": HUB_IP, "port": 53},
            "runtime": {"enabled": True, "api_port": api_port, **runtime}}


@contextmanager
def runtime_daemon(lab, tmp, policy: str, *, tport: int, prefix: str, settings: dict, before_start=None):
    """Yields (gw, sw) with the daemon running; gw.sandbox_ca is the bundle a sandbox trusts
    (the lab CA for upstreams, the gateway's CA for intercepted TLS)."""
    with switch_lab(lab, tmp, policy, sandbox=None, tport=tport, prefix=prefix, settings_extra=settings,
                    before_start=before_start) as (gw, sw, _):
        ca = gw.dir / "sandbox-ca.pem"
        ca.write_text(Path(lab.ca.bundle_path).read_text() + gw.ca_cert.read_text())
        gw.sandbox_ca = ca
        yield gw, sw


def runtime_token(gw) -> str:
    return (gw.state_dir / "runtime" / "api.token").read_text().strip()


def runtime_api(lab, gw, port: int, method: str, path: str, token: str | None = "file", **kw) -> httpx.Response:
    """One call to the runtime API (it listens on loopback in the gw namespace); token "file":
    the daemon's own API token, None: no Authorization header."""
    if token == "file":
        token = runtime_token(gw)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    kw.setdefault("timeout", 60)
    return call_in_netns(lab.gw_ns, lambda: httpx.request(method, f"http://127.0.0.1:{port}/v1{path}",
                                                          headers=headers, **kw))


def sandbox_cli(lab, gw, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """`cubegate sandbox <args>`, run in the gw namespace; check: a non-zero exit fails the test."""
    r = lab.run_gw([str(REPO / ".venv/bin/cubegate"), "-c", str(gw.settings_path), "sandbox", *args],
                   lab_dns=False, cwd=REPO, input=input, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"cubegate sandbox {' '.join(args)} → {r.returncode}: {r.stderr}\n{gw.log()[-3000:]}")
    return r
