"""Attack pass 5 on the daemon's side APIs (vault admin, policy, console): a real `cubegate run`
(no root), real vault and SQLite stores, plain HTTP as a client would send it."""
from __future__ import annotations

import httpx
import pytest
import yaml

from tests.console.consolekit import Browserish, ConsoleDaemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = ConsoleDaemon(tmp_path_factory.mktemp("attack5"))
    # "other" is tenant globex's E2B API key (an admin-scope vault token, as the README says to make one)
    settings = yaml.safe_load(d.settings_path.read_text())
    settings["e2b"] = {"tenant": "acme", "token_tenants": {d.tokens["other_id"]: "globex"}}
    d.settings_path.write_text(yaml.safe_dump(settings))
    d.start()
    d.wait_ready()
    d.settings = settings
    try:
        yield d
    finally:
        d.stop()


def _api(d, which: str, method: str, path: str, token: str, headers: dict | None = None, **kw) -> httpx.Response:
    port = d.settings[which]["port" if which == "policy_api" else "api_port"]
    return httpx.request(method, f"http://127.0.0.1:{port}/v1{path}",
                         headers={"Authorization": f"Bearer {token}", **(headers or {})},
                         timeout=10, trust_env=False, **kw)


def test_a_tenants_e2b_key_is_no_operator_token(daemon):
    """FINDING: `e2b.token_tenants` gives a vault admin token to a tenant as its E2B API key, and
    that very token was admin on every other API of the host: the vault admin API (list, rotate,
    destroy and re-bind acme's secrets — a binding to a host of its choosing would send acme's key
    there), the policy API (widen acme's policy) and the console (and, in a runtime lab, exec in
    acme's sandboxes: tests/e2b/test_attack_pass_5.py). A tenant key is refused by all of them;
    an operator's admin token still works (the control)."""
    key, operator = daemon.tokens["other"], daemon.tokens["admin"]
    assert _api(daemon, "vault", "GET", "/secrets?tenant=acme", operator).status_code == 200
    assert _api(daemon, "policy_api", "GET", "/policies", operator).status_code == 200
    for which, method, path, body in (("vault", "GET", "/secrets?tenant=acme", None),
                                      ("vault", "GET", "/bindings", None),
                                      ("vault", "POST", "/secrets", {"tenant": "acme", "id": "planted",
                                                                     "value": "planted-value-123"}),
                                      ("vault", "POST", "/seal", None),
                                      ("policy_api", "GET", "/policies", None)):
        r = _api(daemon, which, method, path, key, **({"json": body} if body is not None else {}))
        assert r.status_code == 401, (which, method, path, r.status_code, r.text)
    r = _api(daemon, "vault", "GET", "/status", operator)
    assert r.status_code == 200 and not r.json().get("sealed"), r.text      # the key's seal did nothing
    # the console: the tenant key does not log in; the operator's does
    b = Browserish(daemon)
    assert b.get("/login").status_code == 200
    r = b.post("/login", {"token": key})
    assert r.status_code == 401 and "cubegate_console" not in r.cookies, r.status_code
    daemon.login()


def test_every_api_port_of_the_daemon_is_an_own_listener(tmp_path):
    """FINDING: the SSRF guard's own endpoints (never an upstream, whatever `upstream.allow_cidrs`
    exempts) named the proxy, ops, vault, policy and console ports but not the sandbox API
    (runtime.api_port) nor the E2B API (e2b.port). With loopback exempted (an operator reaching a
    local service: `allow_cidrs: [127.0.0.0/8]`) and a policy allowing it, an agent on the explicit
    proxy could CONNECT to them. The guard the workers build from the real settings refuses each."""
    import asyncio

    from cubegate.dataplane import build_guard
    from cubegate.settings import load_settings
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump({
        "state_dir": str(tmp_path / "state"),
        "proxy": {"transparent_port": 18999},
        "upstream": {"allow_cidrs": ["127.0.0.0/8"]},
        "runtime": {"enabled": True, "api_port": 19092},
        "e2b": {"enabled": True, "port": 13000},
        "console": {"enabled": True, "port": 19094}}))
    s = load_settings(path, environ={})
    guard, _ = asyncio.run(build_guard(s))
    for port in (19092, 13000, 19094, s.vault.api_port, s.policy_api.port, s.ops.port, s.proxy.explicit_port):
        assert guard.check("127.0.0.1", port) == "own_listener", port
        assert guard.check("::ffff:127.0.0.1", port) == "own_listener", port
    assert guard.check("127.0.0.1", 5432) is None      # the exemption itself still works


DEEP = "[" * 5000      # 5 KB: well inside every body limit


def test_a_deeply_nested_policy_is_a_clear_400_and_changes_nothing(daemon):
    """FINDING: the policy loader walks YAML with PyYAML's recursive composer: a body nested a few
    thousand levels deep raised RecursionError, which the policy API answered 500 (and the console's
    editor too). Now it is a 400 naming the problem; nothing is stored."""
    token = daemon.tokens["admin"]
    before = _api(daemon, "policy_api", "GET", "/policies", token).json()
    for method, path in (("PUT", "/policies/deep"), ("POST", "/policies/deep/validate")):
        for body in (DEEP, "rules: " + DEEP, '{"rules": ' * 3000):
            r = _api(daemon, "policy_api", method, path, token, content=body.encode(),
                     headers={"Content-Type": "application/yaml"})
            assert r.status_code == 400, (method, path, body[:20], r.status_code, r.text[:300])
            assert "nest" in r.text, r.text[:300]
    assert _api(daemon, "policy_api", "GET", "/policies", token).json() == before
    assert _api(daemon, "policy_api", "GET", "/policies/deep", token).status_code == 404


def test_a_deeply_nested_policy_file_is_a_reported_reload_error(daemon):
    """FINDING (same cause, the file side): the RecursionError escaped the reload, so the watcher
    logged a traceback and /readyz, `last_error` and the reload counter never said the file was
    refused. Now it is refused like any broken file (file:line, old policy in force)."""
    bad = daemon.dir / "policies" / "deep.yaml"
    bad.write_text(DEEP)
    try:
        import time
        deadline, doc = time.monotonic() + 15, None
        while time.monotonic() < deadline:
            # (file reloads are still parsed on the daemon's loop: a deep file holds it ~2 s here)
            doc = httpx.get(f"http://127.0.0.1:{daemon.ops_port}/readyz", timeout=10, trust_env=False).json()
            if "deep.yaml" in str(doc):
                break
            time.sleep(0.3)
        assert "deep.yaml" in str(doc) and "nest" in str(doc), doc
        assert "RecursionError" not in daemon.log(), daemon.log()[-2000:]
    finally:
        bad.unlink()
        time.sleep(1.5)        # the module's daemon goes on with its files as they were


def test_a_slow_policy_body_neither_stalls_the_daemon_nor_is_unbounded(daemon):
    """FINDING: policy bodies were parsed (pure-Python YAML, a few seconds per 100 KB of flow
    lists on these cores) on the daemon's event loop, and a `read` token may validate: one
    request stalled every API, /readyz and the sandbox resolver until it was done, and the body
    could be 1 MiB. Now a policy is at most 256 KiB (400 beyond), and it is parsed off the loop:
    a vault status asked meanwhile is answered before the slow validate is (ordering, not speed)."""
    import threading
    token = daemon.tokens["read"]
    huge = ("rules: [" + "[1]," * (300 * 1024 // 4) + "]").encode()
    r = _api(daemon, "policy_api", "POST", "/policies/big/validate", token, content=huge)
    assert r.status_code in (400, 413) and "256 KiB" in r.text, (r.status_code, r.text[:300])
    slow = ("rules: [" + "[1]," * (200 * 1024 // 4) + "]").encode()
    done: list[tuple[str, float]] = []

    def validate():
        v = httpx.post(f"http://127.0.0.1:{daemon.settings['policy_api']['port']}/v1/policies/slow/validate",
                       headers={"Authorization": f"Bearer {token}"}, content=slow, timeout=120, trust_env=False)
        done.append(("validate", v.status_code))

    t = threading.Thread(target=validate)
    t.start()
    import time
    time.sleep(0.5)                      # the validate is being parsed
    status = _api(daemon, "vault", "GET", "/status", daemon.tokens["admin"])
    done.append(("status", status.status_code))
    t.join(120)
    assert done == [("status", 200), ("validate", 400)], done
