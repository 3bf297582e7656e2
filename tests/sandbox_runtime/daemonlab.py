"""The real daemon with the sandbox runtime on, for lab tests: namespace sandboxes on the cubevs
switch in the lab's gw namespace, the transparent gateway, sandbox DNS and the vault.

One way to start it and to talk to it (runtime API, `cubegate sandbox ...`), shared by the
runtime, snapshot, access-request, e2b and console tests."""
from __future__ import annotations

import base64
import json
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

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
    kw.setdefault("trust_env", False)   # loopback: never through a proxy of the environment
    return call_in_netns(lab.gw_ns, lambda: httpx.request(method, f"http://127.0.0.1:{port}/v1{path}",
                                                          headers=headers, **kw))


def _settings(gw) -> dict:
    return yaml.safe_load(gw.settings_path.read_text())


def _status_doc(r: httpx.Response) -> tuple[int, Any]:
    """(status, the JSON document, else the text, else None for an empty body)."""
    if not r.content:
        return r.status_code, None
    if r.headers.get("content-type", "").startswith("application/json"):
        return r.status_code, r.json()
    return r.status_code, r.text


def runtime_call(lab, gw, method: str, path: str, **kw) -> tuple[int, Any]:
    """The runtime API, with the daemon's own token: (status, document)."""
    return _status_doc(runtime_api(lab, gw, _settings(gw)["runtime"]["api_port"], method, path, **kw))


def policy_call(lab, gw, method: str, path: str, **kw) -> tuple[int, Any]:
    """The policy API, with the daemon's local admin token: (status, document)."""
    token = (gw.state_dir / "admin.token").read_text().strip()
    return _status_doc(runtime_api(lab, gw, _settings(gw)["policy_api"]["port"], method, path, token=token, **kw))


# ------------------------------------------------------------- a sandbox, seen from inside
def sandbox_create(lab, gw, sid: str, *, tenant: str = "acme", network: dict | None = None) -> dict:
    """A sandbox of `tenant` (201 or the test fails) with /workspace/ca.pem = gw.sandbox_ca."""
    body = {"id": sid, "tenant": tenant, "files": {"ca.pem": base64.b64encode(gw.sandbox_ca.read_bytes()).decode()}}
    if network is not None:
        body["network"] = network
    status, doc = runtime_call(lab, gw, "POST", "/sandboxes", json=body)
    assert status == 201, (doc, gw.log()[-3000:])
    return doc


def sandbox_sh(lab, gw, sid: str, script: str, timeout: int = 30) -> tuple[int, str]:
    """`sh -c script` in the sandbox: (exit code, stdout)."""
    status, doc = runtime_call(lab, gw, "POST", f"/sandboxes/{sid}/exec",
                               json={"argv": ["sh", "-c", script], "timeout": timeout})
    assert status == 200, doc
    return doc["exit_code"], doc["stdout"]


def sandbox_https(lab, gw, sid: str, host: str) -> str:
    """The status code curl in the sandbox gets for https://host/ (trusting /workspace/ca.pem)."""
    return sandbox_sh(lab, gw, sid, f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 8 "
                                    f"--cacert /workspace/ca.pem https://{host}/")[1]


def sandbox_internal(lab, gw, sid: str, path: str, data: dict | None = None) -> tuple[int, dict]:
    """What the sandbox gets from http://cubegate.internal<path> (POST `data` as JSON when given)."""
    post = f"-X POST -H 'Content-Type: application/json' --data '{json.dumps(data)}'" if data is not None else ""
    rc, out = sandbox_sh(lab, gw, sid,
                         f"curl -s --max-time 8 -w '\\n%{{http_code}}' {post} http://cubegate.internal{path}")
    body, _, code = out.rpartition("\n")
    assert rc == 0 and code.isdigit(), (rc, out, gw.log()[-2000:])
    return int(code), json.loads(body)


def sandbox_cli(lab, gw, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    """`cubegate sandbox <args>`, run in the gw namespace; check: a non-zero exit fails the test."""
    r = lab.run_gw([str(REPO / ".venv/bin/cubegate"), "-c", str(gw.settings_path), "sandbox", *args],
                   lab_dns=False, cwd=REPO, input=input, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"cubegate sandbox {' '.join(args)} → {r.returncode}: {r.stderr}\n{gw.log()[-3000:]}")
    return r
