import asyncio
import base64
import json
import logging
import os
import re
import sqlite3
import threading
import time

import httpx
import pytest

from vault.api import ROUTES, check_bind_address, make_app, serve

from vaulttest_helpers import SECRET, SECRET2, header_binding

WRITES = [
    ("POST", "/v1/secrets", {"tenant": "acme", "id": "new", "value": "new-value-123456"}),
    ("DELETE", "/v1/secrets/acme/openai", None),
    ("POST", "/v1/secrets/acme/openai/rotate", {"value": SECRET2}),
    ("POST", "/v1/secrets/acme/openai/versions/1/disable", None),
    ("POST", "/v1/secrets/acme/openai/versions/1/enable", None),
    ("POST", "/v1/secrets/acme/openai/versions/1/destroy", None),
    ("POST", "/v1/bindings", header_binding(bid="b2", hosts=["x.example"])),
    ("DELETE", "/v1/bindings/b-openai", None),
    ("POST", "/v1/seal", None),
    ("POST", "/v1/unseal", {"key_file": "/nonexistent"}),
]
READS = ["/v1/secrets", "/v1/secrets?tenant=acme", "/v1/secrets/acme/openai", "/v1/bindings",
         "/v1/bindings/b-openai", "/v1/status", "/v1/openapi.json"]


def call(api, method, path, token=None, body=None, headers=None):
    h = dict(headers or {})
    if token:
        h["Authorization"] = f"Bearer {token}"
    return httpx.request(method, api.url + path, headers=h, json=body, timeout=10)


@pytest.mark.parametrize("auth", [None, "Bearer", "Bearer wrong", "Basic abc",
                                  "Bearer cgvt_aaaaaaaaaaaa_" + "A" * 43])
def test_401_without_valid_token(api, auth):
    for method, path, body in WRITES[:3] + [("GET", p, None) for p in READS]:
        r = call(api, method, path, body=body, headers={"Authorization": auth} if auth else {})
        assert r.status_code == 401, (method, path)
        assert r.json()["error"] == "unauthorized"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert api.vault.get_secret("acme", "openai").current_version == 1  # nothing changed


def test_401_for_token_with_right_id_but_wrong_secret(api):
    tid = api.admin.split("_")[1]
    forged = f"cgvt_{tid}_" + "B" * 43
    assert call(api, "GET", "/v1/status", forged).status_code == 401


def test_401_for_expired_token(api, vault_path):
    info, tok = api.vault.tokens.create("admin", 3600)
    assert call(api, "GET", "/v1/status", tok).status_code == 200
    c = sqlite3.connect(vault_path)
    c.execute("UPDATE tokens SET expires=? WHERE id=?", (time.time() - 1, info.id))
    c.commit()
    c.close()
    assert call(api, "GET", "/v1/status", tok).status_code == 401
    api.vault.tokens.revoke(api.read.split("_")[1])
    assert call(api, "GET", "/v1/status", api.read).status_code == 401


def test_read_scope_cannot_write(api):
    for method, path, body in WRITES:
        r = call(api, method, path, api.read, body)
        assert r.status_code == 403, (method, path)
        assert r.json()["error"] == "forbidden"
    assert not api.vault.sealed
    info = api.vault.get_secret("acme", "openai")
    assert [(v.version, v.state) for v in info.versions] == [(1, "active")]
    for path in READS:
        assert call(api, "GET", path, api.read).status_code == 200, path


def test_full_admin_flow_never_returns_values(api, key_path):
    a = api.admin
    r = call(api, "POST", "/v1/secrets", a, {"tenant": "acme", "id": "gh", "value": "ghp_secretvalue-abc123",
                                             "description": "github"})
    assert r.status_code == 201 and r.json()["current_version"] == 1
    assert call(api, "POST", "/v1/secrets", a, {"tenant": "acme", "id": "gh", "value": "x" * 20}).status_code == 409
    r = call(api, "POST", "/v1/secrets/acme/openai/rotate", a, {"value": SECRET2})
    assert r.status_code == 200 and r.json()["current_version"] == 2
    inj = api.vault.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET", path="/")
    assert inj.version == 2 and inj.occurs_in(SECRET2)  # hot rotation through the API
    r = call(api, "POST", "/v1/bindings", a, header_binding(bid="gh", secret_id="gh", hosts=["api.github.com"]))
    assert r.status_code == 201
    r = call(api, "POST", "/v1/bindings", a, {**header_binding(bid="bad"), "inject": {"type": "header",
                                                                                      "name": "Host", "format": "{secret}"}})
    assert r.status_code == 400 and r.json()["error"] == "invalid_binding" and r.json()["reasons"]
    assert call(api, "DELETE", "/v1/secrets/acme/openai", a).status_code == 409
    assert call(api, "GET", "/v1/secrets/acme/nope", a).status_code == 404
    assert call(api, "GET", "/v1/secrets/ACME/x", a).status_code == 404  # not a valid name: no route
    assert call(api, "GET", "/v1/nothing", a).status_code == 404

    bodies = []
    for path in READS + ["/v1/secrets/acme/gh", "/v1/bindings/gh", "/v1/bindings?tenant=acme"]:
        for tok in (a, api.read):
            r = call(api, "GET", path, tok)
            assert r.status_code == 200, path
            bodies.append(r.text)
    everything = "\n".join(bodies)
    for value in (SECRET, SECRET2, "ghp_secretvalue-abc123"):
        for form in (value, base64.b64encode(value.encode()).decode(), value.encode().hex()):
            assert form not in everything
    secret = json.loads(bodies[4])
    assert [v["state"] for v in secret["versions"]] == ["disabled", "active"]
    assert all(re.fullmatch(r"[0-9a-f]{12}", v["fingerprint"]) for v in secret["versions"])

    r = call(api, "POST", "/v1/secrets/acme/openai/versions/1/destroy", a)
    assert r.status_code == 200 and r.json()["versions"][0]["state"] == "destroyed"
    assert call(api, "POST", "/v1/secrets/acme/openai/versions/1/enable", a).status_code == 409

    assert call(api, "POST", "/v1/seal", a).json()["sealed"] is True
    r = call(api, "POST", "/v1/secrets/acme/openai/rotate", a, {"value": SECRET})
    assert r.status_code == 503 and r.json()["error"] == "sealed"
    assert call(api, "GET", "/v1/secrets", a).status_code == 200  # metadata readable while sealed
    bad_key = key_path.parent / "bad.key"
    bad_key.write_bytes(os.urandom(32))
    os.chmod(bad_key, 0o600)
    r = call(api, "POST", "/v1/unseal", a, {"key_file": str(bad_key)})
    assert r.status_code == 400 and r.json()["error"] == "key_error"   # one answer for every unusable
    os.chmod(bad_key, 0o644)                                           # key file (test_unseal_key_file_oracle)
    r = call(api, "POST", "/v1/unseal", a, {"key_file": str(bad_key)})
    assert r.status_code == 400 and r.json()["error"] == "key_error"
    r = call(api, "POST", "/v1/unseal", a, {"key_file": str(key_path)})
    assert r.status_code == 200 and r.json()["sealed"] is False
    assert call(api, "DELETE", "/v1/bindings/gh", a).status_code == 204
    assert call(api, "DELETE", "/v1/secrets/acme/gh", a).status_code == 204


def test_bad_bodies(api):
    a = api.admin
    r = httpx.post(api.url + "/v1/secrets", headers={"Authorization": f"Bearer {a}"}, content=b"{not json " + SECRET.encode())
    assert r.status_code == 400 and SECRET not in r.text
    assert call(api, "POST", "/v1/secrets", a, [1, 2]).status_code == 400
    r = call(api, "POST", "/v1/secrets", a, {"tenant": "acme", "id": "x", "value": "a\r\nb-injected-x"})
    assert r.status_code == 400 and "injected" not in r.text
    assert call(api, "POST", "/v1/secrets", a, {"tenant": "acme", "id": "x"}).status_code == 400
    assert call(api, "POST", "/v1/unseal", a, {}).status_code == 400
    assert call(api, "PUT", "/v1/status", a).status_code == 405


def test_audit_records_every_action_without_values(api):
    a = api.admin
    call(api, "POST", "/v1/secrets/acme/openai/rotate", a, {"value": SECRET2})
    call(api, "POST", "/v1/secrets/acme/openai/rotate", api.read, {"value": SECRET2})
    call(api, "POST", "/v1/secrets/acme/openai/rotate", None, {"value": SECRET2})
    call(api, "GET", "/v1/secrets/acme/openai", api.read)
    deadline = time.monotonic() + 5
    while len(api.records) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    rot, denied, anon, read = api.records[:4]
    assert rot == {**rot, "event": "admin", "action": "secret.rotate.post", "tenant": "acme",
                   "secret_id": "openai", "version": 2, "status": 200, "outcome": "ok",
                   "actor": a.split("_")[1]}
    assert denied["status"] == 403 and denied["outcome"] == "denied" and denied["actor"] == api.read.split("_")[1]
    assert anon["status"] == 401 and anon["actor"] is None
    assert read["action"] == "secret.get" and read["status"] == 200
    dump = json.dumps(api.records)
    assert SECRET not in dump and SECRET2 not in dump and a not in dump and api.read not in dump


def test_logs_never_contain_values(api, caplog):
    caplog.set_level(logging.DEBUG)
    a = api.admin
    call(api, "POST", "/v1/secrets", a, {"tenant": "acme", "id": "lg", "value": SECRET2})
    call(api, "POST", "/v1/secrets", a, {"tenant": "acme", "id": "lg", "value": SECRET2})
    call(api, "POST", "/v1/secrets", a, {"tenant": "BAD", "id": "lg", "value": SECRET2})
    assert SECRET2 not in caplog.text and a not in caplog.text


def _path_of(rule) -> str:
    pattern = rule.matcher.regex.pattern.rstrip("$")
    names = iter(["tenant", "id", "version"] if "versions" in pattern else
                 (["id"] if pattern.startswith("/v1/bindings") else ["tenant", "id"]))
    return re.sub(r"\([^)]*\)", lambda m: "{" + next(names) + "}", pattern)


def test_openapi_lists_every_route_and_method(api):
    doc = call(api, "GET", "/v1/openapi.json", api.read).json()
    assert doc["openapi"].startswith("3.1")
    app = make_app(api.vault)
    served = {}
    for rule in app.wildcard_router.rules:
        handler = rule.target
        methods = {m for m in ("get", "post", "delete", "put", "patch", "head") if m in vars(handler)}
        served[_path_of(rule)] = methods
    documented = {p: set(ops) for p, ops in doc["paths"].items()}
    assert served == documented
    assert len(served) == len(ROUTES) == 12
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert "401" in op["responses"] and op["security"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.10", "10.0.0.1", "example.com"])
def test_bind_refuses_non_loopback(bound_vault, host):
    with pytest.raises(ValueError, match="loopback"):
        check_bind_address(host)
    with pytest.raises(ValueError, match="loopback"):
        serve(bound_vault, host=host, port=0)


def test_bind_allows_loopback_and_override():
    for host in ("127.0.0.1", "127.5.5.5", "::1", "localhost"):
        check_bind_address(host)
    check_bind_address("0.0.0.0", allow_non_loopback=True)


def test_unix_socket(bound_vault, tmp_path):
    sock = str(tmp_path / "admin.sock")
    _, tok = bound_vault.tokens.create("read", 60)
    loop = asyncio.new_event_loop()
    holder, ready = {}, threading.Event()

    def run():
        asyncio.set_event_loop(loop)

        async def start():
            holder["srv"] = serve(bound_vault, unix_socket=sock)
            ready.set()
        loop.run_until_complete(start())
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert ready.wait(10)
        assert os.stat(sock).st_mode & 0o777 == 0o600
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=10) as c:
            assert c.get("http://vault/v1/status").status_code == 401
            r = c.get("http://vault/v1/status", headers={"Authorization": f"Bearer {tok}"})
            assert r.status_code == 200 and r.json()["secrets"] == 1
    finally:
        loop.call_soon_threadsafe(holder["srv"].stop)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
    assert not os.path.exists(sock)
