"""Credential injection end to end: vault file, real gateway, echo/redirect upstreams."""
from __future__ import annotations

import base64
import json
import urllib.parse
from pathlib import Path

import pytest

from tests.gateway import rawclient
from tests.gateway.harness import Gateway

pytestmark = pytest.mark.netns

SECRET = "sk-live-7f3a9c1e5b2d4a6f8e0c"
SECRET_V2 = "sk-live-rotated-11aa22bb33cc"
REDIR_SECRET = "redirect-key-9q8w7e6r5t4y"
PLAIN_SECRET = "plain-key-0p9o8i7u6y5t"

POLICY = """\
name: creds
tenant: acme
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [echo.allowed.test, redirect.allowed.test, api.allowed.test, passthrough.allowed.test], ports: [443, 80]}
"""


@pytest.fixture(scope="module")
def cgw(lab, tmp_path_factory):
    gw = Gateway(lab, tmp_path_factory.mktemp("cgw"), {"creds.yaml": POLICY},
                 sandboxes={"sb-1": {}, "sb-2": {}})
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", "acme", "openai", input=SECRET + "\n")
    gw.cli("vault", "secret", "put", "acme", "redir", input=REDIR_SECRET + "\n")
    gw.cli("vault", "secret", "put", "acme", "plain", input=PLAIN_SECRET + "\n")
    gw.cli("vault", "binding", "add", "--id", "b-echo", "--tenant", "acme", "--secret", "openai",
           "--host", "echo.allowed.test", "--port", "443", "--port", "80", "--header", "Authorization",
           "--format", "Bearer {secret}", "--placeholder")
    gw.cli("vault", "binding", "add", "--id", "b-redir", "--tenant", "acme", "--secret", "redir",
           "--host", "redirect.allowed.test", "--port", "443", "--header", "X-Api-Key", "--format", "{secret}")
    gw.cli("vault", "binding", "add", "--id", "b-plain", "--tenant", "acme", "--secret", "plain",
           "--host", "api.allowed.test", "--port", "80", "--query", "key", "--allow-plaintext")
    gw.admin_token = gw.cli("vault", "token", "create", "--scope", "admin").strip().split()[-1]
    gw.start()
    yield gw
    gw.stop()


def _headers(body: str) -> list[tuple[str, str]]:
    return [tuple(h) for h in json.loads(body)["header_list"]]


def test_credential_injected_replacing_sandbox_value_exactly_once(cgw):
    r = cgw.curl("https://echo.allowed.test/v1/chat", "--cacert", str(cgw.ca_cert),
                 "-H", "Authorization: Bearer sandbox-own", "-H", "authorization: Bearer second")
    assert r.status == 200, r
    auth = [v for k, v in _headers(r.body) if k.lower() == "authorization"]
    # The upstream saw exactly one Authorization: ours (scrubbed in the echo on the way back).
    assert auth == ["Bearer [REDACTED]"], auth
    assert SECRET not in r.body and "sandbox-own" not in r.body
    rec = cgw.wait_record(lambda x: x["event"] == "request" and x.get("path") == "/v1/chat")
    assert rec["extra"]["secret"] == "openai" and rec["extra"]["version"] == 1
    assert len(rec["extra"]["fingerprint"]) >= 8 and SECRET not in json.dumps(rec)


def test_bound_host_is_intercepted_unbound_host_passes_through(cgw, lab):
    out = lab.call_gw(rawclient.tls_through_tunnel, cgw.proxy_port, "passthrough.allowed.test:443",
                      rawclient.auth_header("sb-1", cgw.tokens["sb-1"]), sni="passthrough.allowed.test",
                      cafile=str(lab.ca.bundle_path))
    assert out["handshake"] == "ok"  # upstream's own certificate
    out = lab.call_gw(rawclient.tls_through_tunnel, cgw.proxy_port, "echo.allowed.test:443",
                      rawclient.auth_header("sb-1", cgw.tokens["sb-1"]), sni="echo.allowed.test",
                      cafile=str(cgw.ca_cert))
    assert out["handshake"] == "ok"  # our interception CA


def test_upstream_echoing_headers_never_shows_the_secret(cgw):
    r = cgw.curl("https://echo.allowed.test/echo-headers", "--cacert", str(cgw.ca_cert), "-D", "/dev/stderr")
    assert r.status == 200, r
    assert SECRET not in r.stderr and SECRET not in r.body
    assert "[REDACTED]" in r.stderr  # X-Echo-Authorization was scrubbed, not dropped silently
    b64 = base64.b64encode(SECRET.encode()).decode()
    assert b64 not in r.stderr and b64 not in r.body


def test_redirect_to_another_host_carries_no_credential(cgw):
    target = "https://echo.allowed.test/landing"
    r = cgw.curl("https://redirect.allowed.test/redirect?to=" + urllib.parse.quote(target, safe=""),
                 "--cacert", str(cgw.ca_cert), "-L")
    assert r.status == 200, r
    headers = _headers(r.body)
    assert json.loads(r.body)["path"] == "/landing"
    assert not [v for k, v in headers if k.lower() == "x-api-key"], headers
    assert REDIR_SECRET not in r.body


def test_plaintext_injection_refused_unless_binding_allows(cgw):
    r = cgw.curl("http://echo.allowed.test/v1/plain")
    assert r.status == 403, r
    assert "plaintext_injection_refused" in r.body
    r = cgw.curl("http://api.allowed.test/q?x=1")
    assert r.status == 200, r
    assert json.loads(r.body)["path"].endswith("key=[REDACTED]") or PLAIN_SECRET not in r.body


def _placeholder(cgw, sandbox="sb-1") -> str:
    out = cgw.cli("identity", "placeholders", sandbox)
    return out.strip().split("=", 1)[1]


def test_placeholder_swapped_on_bound_request(cgw):
    ph = _placeholder(cgw)
    assert ph.startswith("cgph_") and ph != _placeholder(cgw, "sb-2")
    r = cgw.curl("https://echo.allowed.test/v1/ph", "--cacert", str(cgw.ca_cert), "-H", f"Authorization: Bearer {ph}")
    assert r.status == 200, r
    assert [v for k, v in _headers(r.body) if k.lower() == "authorization"] == ["Bearer [REDACTED]"]


@pytest.mark.parametrize("where", ["header", "query", "body"])
@pytest.mark.parametrize("what", ["placeholder", "secret", "secret_b64"])
def test_secret_or_placeholder_to_unbound_host_is_blocked(cgw, where, what):
    value = {"placeholder": _placeholder(cgw), "secret": SECRET,
             "secret_b64": base64.b64encode(SECRET.encode()).decode()}[what]
    url = "http://passthrough.allowed.test/leak"
    args: list[str] = []
    if where == "header":
        args = ["-H", f"X-Exfil: {value}"]
    elif where == "query":
        url += "?q=" + urllib.parse.quote(value)
    else:
        args = ["--data-binary", f"payload={value}"]
    r = cgw.curl(url, *args)
    assert r.status == 403, r
    assert "credential_leak" in r.body and value not in r.body
    rec = cgw.wait_record(lambda x: x.get("reason") == "credential_leak" and x.get("host") == "passthrough.allowed.test")
    assert value not in json.dumps(rec)


def test_rotation_takes_effect_on_next_request(cgw):
    cgw.curl("https://echo.allowed.test/v1/before", "--cacert", str(cgw.ca_cert))
    cgw.cli("vault", "secret", "rotate", "acme", "openai", "--previous", "keep", input=SECRET_V2 + "\n")
    r = cgw.curl("https://echo.allowed.test/v1/after", "--cacert", str(cgw.ca_cert))
    assert r.status == 200 and SECRET_V2 not in r.body
    rec = cgw.wait_record(lambda x: x["event"] == "request" and x.get("path") == "/v1/after")
    assert rec["extra"]["version"] == 2


def test_sealed_vault_fails_closed_with_503_then_recovers(cgw, lab):
    def admin(path, body=None):
        args = ["-s", "-o", "/dev/stdout", "-w", "\n%{http_code}", "-H", f"Authorization: Bearer {cgw.admin_token}"]
        if body is not None:
            args += ["-X", "POST", "-H", "Content-Type: application/json", "--data", json.dumps(body)]
        r = lab.curl(*args, f"http://127.0.0.1:{cgw.proxy_port + 2}{path}", cacert=False, lab_dns=False)
        return r.stdout.rpartition("\n")[2]

    assert admin("/v1/seal", {}) == "200"
    try:
        r = cgw.curl("https://echo.allowed.test/v1/sealed", "--cacert", str(cgw.ca_cert))
        assert r.status == 503 and "vault_sealed" in r.body, r
        code, body = cgw.ops_status("/readyz")
        assert code == 503 and "sealed" in body
        # Unbound traffic is unaffected.
        assert cgw.curl("https://passthrough.allowed.test/").status == 200
    finally:
        assert admin("/v1/unseal", {"key_file": str(cgw.state_dir / "vault.key")}) == "200"
    assert cgw.curl("https://echo.allowed.test/v1/unsealed", "--cacert", str(cgw.ca_cert)).status == 200
    cgw.wait_record(lambda x: x["event"] == "admin" and x.get("extra", {}).get("action", "").startswith(("seal", "unseal")))


def test_admin_api_unreachable_through_the_proxy(cgw, lab):
    s, head = lab.call_gw(rawclient.connect_tunnel, cgw.proxy_port, f"127.0.0.1:{cgw.proxy_port + 2}",
                          rawclient.auth_header("sb-1", cgw.tokens["sb-1"]))
    s.close()
    assert rawclient.connect_status(head) == 403
    r = cgw.curl(f"http://localhost:{cgw.proxy_port + 2}/v1/status")
    assert r.status == 403, r


def test_binding_to_host_no_policy_allows_is_refused(cgw):
    r = cgw.cli("vault", "binding", "add", "--id", "b-bad", "--tenant", "acme", "--secret", "openai", "--host", "denied.test",
                "--header", "Authorization", check=False)
    assert r.returncode != 0 and "denied.test" in (r.stderr + r.stdout)
    r = cgw.cli("vault", "binding", "add", "--id", "b-bad2", "--tenant", "acme", "--secret", "openai", "--host", "api.allowed.test",
                "--header", "Content-Length", check=False)
    assert r.returncode != 0


def test_no_secret_value_anywhere_on_disk_or_in_metrics(cgw):
    code, metrics = cgw.ops_status("/metrics")
    forms = []
    for s in (SECRET, SECRET_V2, REDIR_SECRET, PLAIN_SECRET):
        forms += [s, base64.b64encode(s.encode()).decode(), urllib.parse.quote(s), s.encode().hex()]
    assert not [f for f in forms if f in metrics]
    hits = []
    for path in Path(cgw.dir).rglob("*"):
        if path.is_file() and path.suffix in (".jsonl", ".log", ".yaml", ".txt", ".pem") or path.name.endswith("index.db"):
            data = path.read_bytes()
            hits += [(str(path), f) for f in forms if f.encode() in data]
    assert not hits, hits
