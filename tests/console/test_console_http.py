"""The console over HTTP against a real daemon: cookies, CSP, CSRF, sessions, write-only secrets, audit.

One daemon (plain HTTP) for most tests; a second one with TLS and a 1 s idle timeout
for the Secure cookie and session expiry."""
from __future__ import annotations

import datetime
import json
import re
import time
from http.cookies import SimpleCookie

import pytest

from httpkit import STRICT_CSP
from tests.console.consolekit import Browserish, ConsoleDaemon
from tests.waiting import wait_for

SECRET = "sk-console-http-7f3e9a1c5b2d4e6f"
ROTATED = "sk-console-rotated-0a9b8c7d6e5f4321"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = ConsoleDaemon(tmp_path_factory.mktemp("console")).start()
    yield d
    d.stop()


def cookies_of(r) -> dict[str, str]:
    """name -> the raw Set-Cookie header line."""
    out = {}
    for line in r.headers.get_list("set-cookie"):
        out[line.split("=", 1)[0]] = line
    return out


def test_every_answer_carries_the_strict_csp_and_no_inline_code(daemon):
    b = daemon.login()
    answers = [b.get(p) for p in ("/", "/sandboxes", "/vault", "/audit", "/nope", "/api/overview",
                                  "/static/console.js", "/static/console.css", "/login")]
    answers.append(daemon.client().get("/"))                           # redirect to the login page
    answers.append(daemon.client().post("/vault/secrets", data={}))    # refused
    for r in answers:
        assert r.headers.get("content-security-policy") == STRICT_CSP, (r.request.url, r.headers)
        assert r.headers.get("x-frame-options") == "DENY" and r.headers.get("x-content-type-options") == "nosniff"
    assert "unsafe-inline" not in STRICT_CSP and "script-src 'self'" in STRICT_CSP and "style-src 'self'" in STRICT_CSP
    for r in answers:
        if "text/html" in r.headers.get("content-type", ""):
            assert "<script>" not in r.text and " style=" not in r.text and "onclick" not in r.text.lower(), r.request.url
            assert r.headers["cache-control"] == "no-store"


def test_login_sets_an_httponly_samesite_strict_cookie_and_is_audited(daemon):
    b = Browserish(daemon)
    page = b.get("/login")
    login_cookie = cookies_of(page)["login_csrf"]
    assert "HttpOnly" in login_cookie and "SameSite=Strict" in login_cookie and "Secure" not in login_cookie
    r = b.post("/login", {"token": daemon.tokens["admin"]})
    assert r.status_code == 303
    session = cookies_of(r)["cubegate_console"]
    assert "HttpOnly" in session and "SameSite=Strict" in session and "Path=/" in session
    assert "Secure" not in session       # plain HTTP on loopback; see the TLS test
    rec = daemon.wait_record(lambda x: x.get("extra", {}).get("action") == "console.login"
                             and x["extra"].get("actor") == daemon.tokens["admin_id"])
    assert rec["decision"] == "allow" and rec["event"] == "admin"
    assert daemon.tokens["admin"] not in daemon.audit_text() and daemon.tokens["admin"] not in daemon.log()


def test_login_refuses_a_wrong_token_and_a_missing_login_csrf(daemon):
    b = Browserish(daemon)
    b.get("/login")
    wrong = daemon.tokens["admin"][:-4] + "AAAA"
    r = b.post("/login", {"token": wrong})
    assert r.status_code == 401 and "cubegate_console" not in cookies_of(r)
    daemon.wait_record(lambda x: x.get("extra", {}).get("action") == "console.login" and x.get("status") == 401)
    assert wrong not in daemon.audit_text()
    r = b.post("/login", {"token": daemon.tokens["admin"]}, csrf=False)          # no login CSRF token
    assert r.status_code == 403 and "cubegate_console" not in cookies_of(r)
    fresh = daemon.client()                                                        # no login cookie at all
    r = fresh.post("/login", data={"token": daemon.tokens["admin"], "_csrf": "x" * 32},
                   headers={"Origin": daemon.base})
    assert r.status_code == 403 and "cubegate_console" not in cookies_of(r)


def test_without_a_session_nothing_is_served_or_changed(daemon):
    c = daemon.client()
    r = c.get("/vault")
    assert r.status_code == 302 and r.headers["location"] == "/login"
    assert c.get("/api/overview").status_code == 401
    assert c.get("/api/audit/stream").status_code == 401
    assert c.get("/audit/export").status_code == 302
    r = c.post("/vault/secrets", data={"tenant": "acme", "id": "nosession", "value": SECRET},
               headers={"Origin": daemon.base})
    assert r.status_code == 401
    c.cookies.set("cubegate_console", "forged-session-id")
    assert c.post("/vault/secrets", data={"tenant": "acme", "id": "nosession", "value": SECRET},
                  headers={"Origin": daemon.base}).status_code == 401
    b = daemon.login()
    assert "nosession" not in b.get("/vault").text


def test_every_state_change_needs_the_sessions_csrf_token(daemon):
    b = daemon.login()
    puts = lambda: [x for x in daemon.audit_records()  # noqa: E731
                    if x.get("extra", {}).get("action") == "console.secret.put" and x["status"] == 403]
    before = len(puts())
    form = {"tenant": "acme", "id": "csrf-check", "value": SECRET}
    assert b.post("/vault/secrets", form, csrf=False).status_code == 403
    assert b.post("/vault/secrets", {**form, "_csrf": "0" * 43}, csrf=False).status_code == 403
    other = daemon.login()                                   # another session's token is no good here
    assert b.post("/vault/secrets", {**form, "_csrf": other.csrf}, csrf=False).status_code == 403
    r = b.post("/vault/secrets", form, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403                              # right token, foreign origin
    assert b.post("/logout", csrf=False).status_code == 403
    assert "csrf-check" not in b.get("/vault").text
    daemon.wait_record(lambda x: len(puts()) == before + 4)
    assert all(x["decision"] == "deny" and x["extra"]["actor"] == daemon.tokens["admin_id"] for x in puts())
    # the header works as well as the form field (the page's script uses it)
    r = b.c.post("/vault/secrets", data=form, headers={"X-CSRF-Token": b.csrf, "Origin": daemon.base})
    assert r.status_code == 303
    assert "csrf-check" in b.get("/vault").text


def test_a_secret_value_is_never_sent_back(daemon):
    b = daemon.login()
    r = b.post("/vault/secrets", {"tenant": "acme", "id": "openai", "value": SECRET, "description": "llm key"})
    assert r.status_code == 303
    vault_page = b.get("/vault")
    assert "acme/<strong>openai</strong>" in vault_page.text and "v1 active" in vault_page.text
    assert b.post("/vault/secrets", {"tenant": "acme", "id": "openai", "value": SECRET}).status_code == 409
    assert b.post("/vault/secrets", {"tenant": "acme", "id": "short", "value": "abc"}).status_code == 400
    r = b.post("/vault/secrets/acme/openai/rotate", {"value": ROTATED, "previous": "disable"})
    assert r.status_code == 303
    assert b.post("/vault/secrets/acme/openai/rotate", {"value": SECRET, "previous": "bogus"}).status_code == 400
    assert b.post("/vault/secrets/acme/nope/rotate", {"value": SECRET}).status_code == 404
    page = b.get("/vault")
    assert "v2 active" in page.text and "v1 disabled" in page.text
    for path in ("/", "/sandboxes", "/audit", "/audit/export", "/api/overview", "/vault?tenant=acme"):
        b.get(path)
    for r in b.seen:
        for value in (SECRET, ROTATED):
            assert value not in r.text and value not in str(r.headers), (r.request.url, r.status_code)
    assert SECRET not in daemon.audit_text() and ROTATED not in daemon.audit_text()
    assert SECRET not in daemon.log() and ROTATED not in daemon.log()
    put = daemon.wait_record(lambda x: x.get("extra", {}).get("action") == "console.secret.put"
                             and x["extra"].get("secret_id") == "openai" and x.get("status") == 303)
    assert put["extra"]["actor"] == daemon.tokens["admin_id"] and put["extra"]["version"] == 1


def test_a_failed_form_is_shown_again_in_place_without_the_secret(daemon):
    b = daemon.login()
    r = b.post("/vault/secrets", {"tenant": "bad tenant!", "id": "x", "value": SECRET, "description": "kept"})
    assert r.status_code == 400 and 'id="form-error"' in r.text and 'id="put-form"' in r.text
    assert 'value="kept"' in r.text and SECRET not in r.text


def test_bindings_get_the_clis_checks(daemon):
    b = daemon.login()
    b.post("/vault/secrets", {"tenant": "acme", "id": "gh", "value": SECRET})
    base = {"id": "gh-api", "tenant": "acme", "secret_id": "gh", "hosts": "a.test", "ports": "443",
            "inject": "header", "header": "Authorization", "format": "token {secret}"}
    r = b.post("/vault/bindings", {**base, "header": "Host"})
    assert r.status_code == 400 and "framing" in r.text, r.text[:300]
    r = b.post("/vault/bindings", {**base, "inject": "query", "query": ""})
    assert r.status_code == 400 and "exactly one" in r.text
    r = b.post("/vault/bindings", {**base, "hosts": "not-allowed.test"})   # no policy of the tenant allows it
    assert r.status_code == 400, r.text[:300]
    r = b.post("/vault/bindings", base)
    assert r.status_code == 303, r.text[r.text.find('id="form-error"'):][:300]
    page = b.get("/vault")
    assert 'data-binding="gh-api"' in page.text and "token {secret}" in page.text
    r = b.post("/vault/bindings", base)
    assert r.status_code == 400 and 'id="form-error"' in r.text    # the same id twice
    assert b.post("/vault/bindings/gh-api/delete").status_code == 303
    assert 'data-binding="gh-api"' not in b.get("/vault").text
    assert b.post("/vault/bindings/gh-api/delete").status_code == 404


def test_a_read_scope_session_sees_but_cannot_change(daemon):
    b = daemon.login(daemon.tokens["read"])
    page = b.get("/vault")
    assert page.status_code == 200 and "Read-only session" in page.text and 'id="put-form"' not in page.text
    r = b.post("/vault/secrets", {"tenant": "acme", "id": "by-reader", "value": SECRET})
    assert r.status_code == 403
    assert b.post("/logout").status_code == 303


def test_revoking_a_token_ends_its_sessions(daemon):
    victim = daemon.login(daemon.tokens["other"])
    assert victim.get("/vault").status_code == 200
    admin = daemon.login()
    assert admin.post(f"/vault/tokens/{daemon.tokens['other_id']}/revoke").status_code == 303
    r = victim.get("/vault")
    assert r.status_code == 302 and r.headers["location"] == "/login"
    daemon.wait_record(lambda x: x.get("extra", {}).get("action") == "console.token.revoke"
                       and x["extra"].get("token_id") == daemon.tokens["other_id"])


def test_logout_ends_the_session(daemon):
    b = daemon.login()
    cookie = b.c.cookies.get("cubegate_console")
    assert b.post("/logout").status_code == 303
    c = daemon.client()
    c.cookies.set("cubegate_console", cookie)
    assert c.get("/").status_code == 302


def test_audit_filters_export_and_escaping(daemon):
    b = daemon.login()
    r = b.get("/audit", params={"since": "yesterday-ish"})
    assert r.status_code == 400 and "bad time" in r.text and 'id="audit-filters"' in r.text
    r = b.get("/audit", params={"sandbox": "<script>alert(1)</script>"})
    assert r.status_code == 200 and "<script>alert(1)" not in r.text and "&lt;script&gt;alert(1)" in r.text

    def login_listed():   # the daemon's index syncs every second (more under load): poll, don't sleep
        r = b.get("/audit", params={"reason": "console.login", "since": "1h"})
        # the results' count, not the filter form (which echoes "console.login" back at once)
        m = re.search(r"Records <small>\((\d+), newest first\)", r.text)
        return r.status_code == 200 and m is not None and int(m.group(1)) > 0

    wait_for(login_listed, 15, "the login in the console's audit page")
    wait_for(lambda: b.get("/audit/export", params={"decision": "allow"}).text.strip() != "", 15,
             "allowed records in the export")
    r = b.get("/audit/export", params={"decision": "allow"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    assert "attachment" in r.headers["content-disposition"]
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert lines and all(x["decision"] == "allow" for x in lines)
    assert [x["ts"] for x in lines] == sorted(x["ts"] for x in lines)          # oldest first
    daemon.wait_record(lambda x: x.get("extra", {}).get("action") == "console.audit.export")


def test_the_live_tail_streams_new_records(daemon):
    b = daemon.login()
    got = []
    with b.c.stream("GET", "/api/audit/stream", params={"reason": "console.logout"}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        lines = s.iter_lines()
        assert next(lines) == "event: hello"
        other = daemon.login()
        other.post("/logout")                                 # a new record the filter selects
        deadline = time.monotonic() + 10
        for line in lines:
            if line.startswith("data: ") and '"extra"' in line:
                got.append(json.loads(line[6:]))
                break
            assert time.monotonic() < deadline
    assert got and got[0]["extra"]["actor"] == daemon.tokens["admin_id"]


def test_overview_data_has_checks_capacity_and_series(daemon):
    b = daemon.login()
    daemon.wait_ready()       # its workers start late on a loaded box; the page says what /readyz says
    deadline = time.monotonic() + 30
    while len((d := b.get("/api/overview").json())["series"]["t"]) < 2:    # it samples every second
        assert time.monotonic() < deadline, d["series"]
        time.sleep(0.2)
    assert d["ready"] is True and set(d["checks"]) >= {"policy", "ca", "listeners", "vault", "audit", "tasks"}
    assert "console-metrics" in d["checks"]["tasks"]["detail"]
    assert d["capacity"]["mem_total_mb"] > 0 and d["capacity"]["cpus"] >= 1 and d["capacity"]["runtime"] is False
    s = d["series"]
    assert len(s["t"]) >= 2 and len(s["decisions"]["allow"]) == len(s["t"]) == len(s["bytes"]["in"])


def test_a_foreign_host_name_is_refused(daemon):
    r = daemon.client().get("/login", headers={"Host": "rebound.example:80"})
    assert r.status_code == 421


# -- TLS + short idle timeout ----------------------------------------------------------
def _self_signed(dir_):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    (dir_ / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (dir_ / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    return str(dir_ / "c.pem"), str(dir_ / "k.pem")


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console-tls")
    cert, key = _self_signed(tmp)
    d = ConsoleDaemon(tmp / "d", console={"tls_cert": cert, "tls_key": key, "idle_timeout": 1.0}).start()
    yield d
    d.stop()


def test_over_tls_the_cookies_are_secure_and_host_prefixed(tls_daemon):
    b = Browserish(tls_daemon)
    page = b.get("/login")
    assert "Secure" in cookies_of(page)["__Host-login_csrf"]
    r = b.post("/login", {"token": tls_daemon.tokens["admin"]})
    assert r.status_code == 303
    line = cookies_of(r)["__Host-cubegate_console"]
    assert "Secure" in line and "HttpOnly" in line and "SameSite=Strict" in line and "Path=/" in line
    assert "Domain" not in line
    assert SimpleCookie(line)


def test_an_idle_session_expires_and_polling_does_not_keep_it(tls_daemon):
    b = tls_daemon.login()
    assert b.get("/vault").status_code == 200
    deadline = time.monotonic() + 1.6
    while time.monotonic() < deadline:         # the overview's poll: no activity
        assert b.get("/api/overview").status_code in (200, 401)
        time.sleep(0.3)
    assert b.get("/api/overview").status_code == 401
    r = b.get("/vault")
    assert r.status_code == 302 and r.headers["location"] == "/login"
    active = tls_daemon.login()
    for _ in range(4):                         # page views are activity: it stays alive
        time.sleep(0.5)
        assert active.get("/vault").status_code == 200


# -- policies and access requests ----------------------------------------------------------
GOOD = "name: web\ntenant: acme\napplies_to: {labels: {team: web}}\ndefault: deny\nrules:\n" \
       "  - name: docs\n    action: allow\n    match: {hosts: [docs.test], ports: [443]}\n"


def test_a_broken_policy_edit_is_refused_in_place_and_nothing_changes(daemon):
    b = daemon.login()
    assert b.get("/policies/new", params={"name": "web"}).headers["location"] == "/policies/web?new=1"
    page = b.get("/policies/web?new=1")
    assert page.status_code == 200 and 'id="policy-form"' in page.text
    broken = GOOD.replace("action: allow", "action: permit").replace("hosts: [docs.test]", "hosts: [\"*x.test\"]")
    r = b.post("/policies/web", {"text": broken})
    assert r.status_code == 400 and 'id="policy-problems"' in r.text
    assert "/rules/0/action" in r.text and "/rules/0/match/hosts/0" in r.text
    assert "action: permit" in r.text                                 # the text stays in the editor
    assert 'data-policy="web"' not in b.get("/policies").text         # nothing changed
    assert b.post("/policies/web", {"text": "rules: [unclosed"}).status_code == 400
    assert b.post("/policies/web", {"text": GOOD}).status_code == 303
    listed = b.get("/policies").text
    assert 'data-policy="web"' in listed and "API v1" in listed
    v2 = GOOD.replace("docs.test", "docs2.test")
    assert b.post("/policies/web", {"text": v2}).status_code == 303
    page = b.get("/policies/web")
    assert "version 2" in page.text
    diff = page.text[page.text.index('data-version="2"'):page.text.index('data-version="1"')]
    assert re.search(r'<span class="del">-\s+- docs\.test</span>', diff), diff
    assert re.search(r'<span class="add">\+\s+- docs2\.test</span>', diff), diff
    assert b.post("/policies/web/rollback", {"version": "1"}).status_code == 303
    d = b.get("/policies/explain", params={"sandbox": "sb-x", "labels": "team=web", "host": "docs.test"})
    assert d.status_code == 200 and 'id="explain-result"' in d.text and "rule_allow" in d.text
    d = b.get("/policies/explain", params={"sandbox": "sb-x", "labels": "team=web", "host": "docs2.test"})
    assert "deny" in d.text                                              # rolled back: docs2 is not allowed
    puts = [x["extra"] for x in daemon.audit_records() if x.get("extra", {}).get("action") in
            ("console.policy.put", "console.policy.rollback")]
    assert [(p["action"], p.get("version")) for p in puts if p.get("outcome") == "ok"] == \
        [("console.policy.put", 1), ("console.policy.put", 2), ("console.policy.rollback", 3)]
    assert b.post("/policies/web/delete").status_code == 303
    assert b.post("/policies/t/delete").status_code == 409               # a file policy: refused


def test_access_requests_are_approved_with_scope_and_expiry_or_denied(daemon):
    from cubegate.access_store import AccessStore
    store = AccessStore(daemon.state / "access.db")
    try:
        one = store.file("sb-asker", {"tenant": "acme"}, "api.asked.test", 443, "needs the docs")
        two = store.file("sb-asker", {"tenant": "acme"}, "other.asked.test", 443, "<b>bold</b> reason")
    finally:
        store.close()
    b = daemon.login()
    page = b.get("/policies")
    assert f'data-request="{one["id"]}"' in page.text and "&lt;b&gt;bold&lt;/b&gt;" in page.text
    assert b.post(f"/access/{one['id']}/approve", {"scope": "everything"}).status_code == 400
    r = b.post(f"/access/{one['id']}/approve", {"scope": "sandbox", "expires_in": "3600", "note": "ok"})
    assert r.status_code == 303
    assert b.post(f"/access/{two['id']}/deny", {"note": "no"}).status_code == 303
    assert b.post(f"/access/{two['id']}/deny").status_code == 404       # decided already
    page = b.get("/policies").text
    assert f'data-grant="grant.{one["id"]}"' in page and f'data-request="{one["id"]}"' not in page
    d = b.get("/policies/explain", params={"sandbox": "sb-asker", "labels": "tenant=acme", "host": "api.asked.test"})
    assert "grant_allow" in d.text
    assert b.post(f"/grants/grant.{one['id']}/revoke").status_code == 303
    assert f'data-grant="grant.{one["id"]}"' not in b.get("/policies").text
    approved = daemon.wait_record(lambda x: x.get("extra", {}).get("action") == "console.access.approve"
                                  and x["extra"].get("outcome") == "ok")
    assert approved["extra"]["request_id"] == one["id"] and approved["extra"]["scope"] == "sandbox"
    reader = daemon.login(daemon.tokens["read"])
    assert reader.post("/policies/web", {"text": GOOD}).status_code == 403
