"""Policies as a live API, against the real gateway process in the lab (issue #13 items 1 and 3).

A change through the API applies to the next connection and closes an open
tunnel that is now denied (audited policy_revoked); a restart keeps every
version; a broken body is refused with a JSON pointer and changes nothing;
an explicit-proxy refusal carries a JSON body an agent can read."""
from __future__ import annotations

import base64
import json
import socket
import ssl
import time

import httpx
import pytest

from tests.gateway.harness import Gateway

pytestmark = pytest.mark.netns

MAIN = """\
name: main
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [api.allowed.test, passthrough.allowed.test], ports: [443]}
"""


def _api(gw, method, path, **kw):
    token = (gw.state_dir / "admin.token").read_text().strip()

    def call():
        r = httpx.request(method, f"http://127.0.0.1:{gw.policy_api_port}/v1{path}",
                          headers={"Authorization": f"Bearer {token}"}, timeout=10, trust_env=False, **kw)
        return r.status_code, (r.json() if r.content else None)
    return gw.lab.call_gw(call)


def gw_cli(gw, *args: str) -> str:
    """`cubegate ...` in the gw namespace, where the daemon's loopback APIs listen."""
    from tests.gateway.harness import CUBEGATE, REPO
    r = gw.lab.run_gw([*CUBEGATE, "-c", str(gw.settings_path), *args], lab_dns=False, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _policy(*hosts: str) -> str:
    return json.dumps({"default": "deny", "rules": [
        {"name": "lab", "action": "allow", "match": {"hosts": list(hosts), "ports": [443]}}]})


LEARN = ("name: learn\napplies_to: {sandboxes: [sb-r]}\nmode: report\ndefault: deny\nrules:\n"
         "  - {name: api, action: allow, match: {hosts: [api.allowed.test]}}\n")


@pytest.fixture
def gw(lab, tmp_path):
    """A gateway of the test's own: for tests that change policies."""
    g = Gateway(lab, tmp_path / "gw", {"main.yaml": MAIN}, sandboxes={"sb-1": {"team": "a"}})
    g.policy_api_port = g.proxy_port + 3
    g.start()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def shared_gw(lab, tmp_path_factory):
    """One gateway for the tests that change no policy (a gateway start costs seconds): main from
    its file for sb-1, and report mode for sb-r (the learn-mode test)."""
    g = Gateway(lab, tmp_path_factory.mktemp("shared-gw"), {"main.yaml": MAIN, "learn.yaml": LEARN},
                sandboxes={"sb-1": {"team": "a"}, "sb-r": {}})
    g.policy_api_port = g.proxy_port + 3
    g.start()
    yield g
    g.stop()


def _hold_tunnel_then(gw, host: str, change) -> dict:
    """In the gw namespace: open a TLS tunnel to host through the proxy, run change(), and see how
    long the tunnel stays open afterwards (bounded: 8 s)."""
    auth = base64.b64encode(f"sb-1:{gw.tokens['sb-1']}".encode()).decode()
    ctx = ssl.create_default_context(cafile=str(gw.lab.ca.bundle_path))

    def run():
        s = socket.create_connection(("127.0.0.1", gw.proxy_port), timeout=10)
        s.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
                  .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(1024)
        assert head.startswith(b"HTTP/1.1 200"), head
        tls = ctx.wrap_socket(s, server_hostname=host)
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        first = tls.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first
        while b"\r\n\r\n" not in first:   # read the rest of this answer; the connection stays open (keep-alive)
            first += tls.recv(4096)
        status = change()
        t0 = time.monotonic()
        tls.settimeout(8)
        closed = False
        while not closed and time.monotonic() - t0 < 8:   # the rest of the first body may still come
            try:
                closed = tls.recv(4096) == b""
            except socket.timeout:
                break
            except (ConnectionError, ssl.SSLError, OSError):
                closed = True
        return {"status": status, "closed": closed, "after_s": time.monotonic() - t0}
    return gw.lab.call_gw(run)


def test_api_change_applies_to_the_next_connection_and_closes_a_now_denied_tunnel(gw):
    assert gw.curl("https://passthrough.allowed.test/").status == 200
    denied = gw.curl("https://spare1.test/")
    assert denied.connect_status == 403
    # the change: spare1 allowed, passthrough no longer
    out = _hold_tunnel_then(gw, "passthrough.allowed.test",
                            lambda: _api(gw, "PUT", "/policies/main", content=_policy("api.allowed.test",
                                                                                      "spare1.test"))[0])
    assert out["status"] == 201 and out["closed"] and out["after_s"] < 2, out
    rec = gw.wait_record(lambda r: r.get("reason") == "policy_revoked")
    assert rec["host"] == "passthrough.allowed.test" and rec["sandbox"] == "sb-1"
    assert rec["extra"]["denied_by"] == "default_deny"
    assert gw.curl("https://spare1.test/").status == 200          # the next connection
    assert gw.curl("https://passthrough.allowed.test/").connect_status == 403
    admin = gw.wait_record(lambda r: r["event"] == "admin" and (r.get("extra") or {}).get("name") == "main")
    assert admin["extra"]["actor"] == "local" and admin["extra"]["version"] == 1
    # a tunnel the new policy still allows stays open
    kept = _hold_tunnel_then(gw, "api.allowed.test",
                             lambda: _api(gw, "PUT", "/policies/main",
                                          content=_policy("api.allowed.test", "spare1.test", "x.github.test"))[0])
    assert kept["status"] == 200 and not kept["closed"], kept


def test_broken_body_is_refused_with_a_pointer_and_changes_nothing(shared_gw):
    gw = shared_gw
    before = _api(gw, "GET", "/policies")[1]["digest"]
    status, body = _api(gw, "PUT", "/policies/main", content=json.dumps(
        {"default": "deny", "rules": [{"name": "r", "action": "allow", "match": {"hosts": ["*x.test"],
                                                                              "ports": [70000]}}]}))
    assert status == 400 and body["error"] == "invalid_policy"
    pointers = {e["pointer"] for e in body["errors"]}
    assert pointers == {"/rules/0/match/hosts/0", "/rules/0/match/ports/0"}, body
    assert _api(gw, "GET", "/policies")[1]["digest"] == before
    assert _api(gw, "GET", "/policies/main")[1]["source"] == "file"
    assert gw.curl("https://api.allowed.test/").status == 200


def test_restart_keeps_every_version_and_rollback(gw):
    for hosts in (("spare1.test",), ("spare2.test",), ("spare1.test", "spare2.test")):
        assert _api(gw, "PUT", "/policies/extra", content=json.dumps(
            {"applies_to": {"labels": {"team": "a"}}, "default": "deny", "rules": [
                {"name": "r", "action": "allow", "match": {"hosts": list(hosts), "ports": [443]}}]}))[0] in (200, 201)
    gw.stop()
    gw.start()
    status, hist = _api(gw, "GET", "/policies/extra/history")
    assert status == 200 and [v["version"] for v in hist["versions"]] == [3, 2, 1]
    assert gw.curl("https://spare2.test/").status == 200
    assert _api(gw, "POST", "/policies/extra/rollback", json={"version": 1})[1]["version"] == 4
    assert gw.curl("https://spare2.test/").connect_status == 403
    assert gw.curl("https://spare1.test/").status == 200
    # the CLI against the daemon's API
    assert gw_cli(gw, "policy", "history", "extra").splitlines()[0].split()[:2] == ["v4", "rollback"]
    assert "api v4" in gw_cli(gw, "policy", "ls")
    d = json.loads(gw_cli(gw, "policy", "decide", "--sandbox", "sb-1", "--label", "team=a", "--host", "spare2.test"))
    assert (d["action"], d["policy"]) == ("deny", "extra")
    gw_cli(gw, "policy", "rm", "extra")
    assert gw.curl("https://spare1.test/").connect_status == 403


def test_explicit_proxy_refusal_is_json_an_agent_can_read(shared_gw):
    gw = shared_gw
    r = gw.curl("https://denied.test/", "-s")
    assert r.connect_status == 403
    auth = base64.b64encode(f"sb-1:{gw.tokens['sb-1']}".encode()).decode()

    def connect():
        with socket.create_connection(("127.0.0.1", gw.proxy_port), timeout=10) as c:
            c.sendall(b"CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n"
                      b"Proxy-Authorization: Basic " + auth.encode() + b"\r\n\r\n")
            data = b""
            while chunk := c.recv(4096):
                data += chunk
            return data.decode()
    head, _, body = gw.lab.call_gw(connect).partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 403") and "X-Cubegate-Reason: default_deny" in head, head
    doc = json.loads(body)
    assert doc["reason"] == "default_deny" and doc["host"] == "denied.test" and doc["port"] == 443
    assert doc["policy"] == "main" and "cubegate.internal" in doc["ask_for_access"]
    # and through the proxy, the agent reads its own denials at cubegate.internal
    own = gw.lab.curl("-s", "-x", gw.proxy_url(), "http://cubegate.internal/v1/denials", cacert=False,
                      lab_dns=False)
    denials = json.loads(own.stdout)
    assert denials["sandbox"] == "sb-1" and any(d["host"] == "denied.test" for d in denials["denials"])


def test_learn_mode_suggests_the_smallest_allow_policy_from_report_mode(shared_gw):
    g = shared_gw
    for url in ("https://x.github.test/", "https://a.b.github.test/", "https://spare1.test/",
                "https://api.allowed.test/"):
        assert g.curl(url, sandbox="sb-r").status == 200          # report mode lets it through
    for host in ("x.github.test", "a.b.github.test", "spare1.test"):   # all in the log: the CLI syncs its index
        g.wait_record(lambda r: r.get("host") == host and r.get("would_deny") and r.get("sandbox") == "sb-r")
    doc = __import__("yaml").safe_load(g.cli("policy", "suggest", "--sandbox", "sb-r", "--since", "1h",
                                             "--min-siblings", "2"))
    hosts = sorted(h for r in doc["rules"] for h in r["match"]["hosts"])
    assert hosts == ["*.github.test", "spare1.test"], doc        # api.allowed.test was allowed already
    assert doc["applies_to"] == {"sandboxes": ["sb-r"]} and all(r["match"]["ports"] == [443] for r in doc["rules"])
