"""The gateway as a real process in a lab namespace, driven by real clients."""
from __future__ import annotations

import json

import pytest
from cryptography import x509

from tests.gateway import rawclient

pytestmark = pytest.mark.netns


def _auth(gw, sb="sb-1"):
    return rawclient.auth_header(sb, gw.tokens[sb])


# ------------------------------------------------------------------ allow/deny
def test_allowed_request_is_passed_through_with_upstreams_own_certificate(gateway, lab):
    r = gateway.curl("https://passthrough.allowed.test/hello")
    assert r.status == 200, r
    assert r.json()["path"] == "/hello"
    # Passthrough: the client verified the upstream's certificate against the lab CA,
    # so the gateway did not intercept. Check the issuer explicitly too.
    out = lab.call_gw(rawclient.tls_through_tunnel, gateway.proxy_port, "passthrough.allowed.test:443",
                      _auth(gateway), sni="passthrough.allowed.test", cafile=str(lab.ca.bundle_path))
    assert out["handshake"] == "ok", out
    cert = x509.load_der_x509_certificate(out["peer_cert_der"])
    lab_ca = x509.load_pem_x509_certificate(lab.ca.bundle_path.read_bytes())
    assert cert.issuer == lab_ca.subject
    rec = gateway.wait_record(lambda r: r["event"] == "connection_closed" and r.get("host") == "passthrough.allowed.test"
                              and r.get("extra", {}).get("kind") == "passthrough")
    assert rec["bytes_in"] > 0 and rec["bytes_out"] > 0
    assert rec["upstream"].startswith("198.18.0.11:")


def test_denied_at_connect_with_reason_and_no_upstream_connection(gateway, lab):
    r = gateway.curl("https://denied.test/never-contacted-1")
    assert r.connect_status == 403, r
    rec = gateway.wait_record(lambda r: r["event"] == "decision" and r.get("host") == "denied.test")
    assert rec["decision"] == "deny" and rec["reason"] == "default_deny"
    assert rec["sandbox"] == "sb-1"
    assert "never-contacted-1" not in lab.logs("upstream"), "denied host must never be contacted"


def test_proxy_auth_required_and_wrong_token_refused(gateway, lab):
    r = lab.curl("-x", f"http://127.0.0.1:{gateway.proxy_port}", "-o", "/dev/null", "-w", "%{http_connect}",
                 "https://api.allowed.test/", lab_dns=False)
    assert r.stdout.strip() == "407"
    r = gateway.curl("https://api.allowed.test/", token="wrong-token")
    assert r.connect_status == 407, r
    r = gateway.curl("https://api.allowed.test/", sandbox="sb-1", token=gateway.tokens["sb-2"])
    assert r.connect_status == 407, r
    gateway.wait_record(lambda r: r.get("reason") == "proxy_auth_invalid")


def test_wildcard_matching_end_to_end(gateway):
    assert gateway.curl("https://x.github.test/").status == 200
    assert gateway.curl("https://a.b.github.test/").status == 200
    assert gateway.curl("https://github.test/").connect_status == 403
    assert gateway.curl("https://evil-github.test/").connect_status == 403


def test_seed_format_policy_selected_by_label(gateway):
    assert gateway.curl("https://api.allowed.test/", sandbox="sb-seed").status == 200
    assert gateway.curl("https://x.github.test/", sandbox="sb-seed").status == 200
    assert gateway.curl("https://passthrough.allowed.test/", sandbox="sb-seed").connect_status == 403


def test_report_mode_allows_but_records_would_deny(gateway):
    r = gateway.curl("https://passthrough.allowed.test/", sandbox="sb-report")
    assert r.status == 200, r
    rec = gateway.wait_record(lambda r: r["event"] == "decision" and r.get("sandbox") == "sb-report"
                              and r.get("host") == "passthrough.allowed.test")
    assert rec["decision"] == "allow" and rec["would_deny"] is True and rec["mode"] == "report"


def test_case_trailing_dot_and_port_are_normalised(gateway, lab):
    for target in ("API.Allowed.TEST:443", "api.allowed.test.:443"):
        s, head = lab.call_gw(rawclient.connect_tunnel, gateway.proxy_port, target, _auth(gateway))
        s.close()
        assert rawclient.connect_status(head) == 200, (target, head)


def test_idn_host_is_matched_as_punycode(gateway, lab):
    # Raw UTF-8 in the request line is refused by the HTTP parser; the punycode
    # spelling is decided on its ASCII form (policy patterns are punycoded at load).
    s, head = lab.call_gw(rawclient.connect_tunnel, gateway.proxy_port, "bücher.test:443", _auth(gateway))
    s.close()
    assert rawclient.connect_status(head) in (400, 403), head
    s, head = lab.call_gw(rawclient.connect_tunnel, gateway.proxy_port, "XN--BCHER-KVA.test:443", _auth(gateway))
    s.close()
    assert rawclient.connect_status(head) == 403, head
    gateway.wait_record(lambda r: r.get("host") == "xn--bcher-kva.test" and r.get("decision") == "deny")


# --------------------------------------------------------------------- SNI
def test_sni_different_from_connect_host_is_refused_before_tls(gateway, lab):
    out = lab.call_gw(rawclient.tls_through_tunnel, gateway.proxy_port, "api.allowed.test:443", _auth(gateway),
                      sni="denied.test", cafile=None)
    assert out["connect_status"] == 200
    assert out["handshake"].startswith("failed"), out
    rec = gateway.wait_record(lambda r: r.get("reason") == "sni_mismatch")
    assert rec["sni"] == "denied.test" and rec["host"] == "api.allowed.test"


def test_empty_sni_passes_through_to_the_connect_host(gateway, lab):
    out = lab.call_gw(rawclient.tls_through_tunnel, gateway.proxy_port, "api.allowed.test:443", _auth(gateway),
                      sni=None, cafile=None,
                      request=b"GET /nosni HTTP/1.1\r\nHost: api.allowed.test\r\nConnection: close\r\n\r\n")
    assert out["handshake"] == "ok", out
    assert b'"/nosni"' in out["response"]


# ------------------------------------------------------------------- SSRF
@pytest.mark.parametrize("name,reason", [
    ("loopback.evil.test", "ssrf_loopback"),
    ("private.evil.test", "ssrf_private"),
    ("metadata.evil.test", "ssrf_link_local"),
    ("cgnat.evil.test", "ssrf_cgnat"),
    ("mapped.evil.test", "ssrf_"),
    ("ula.evil.test", "ssrf_unique_local"),
])
def test_names_resolving_to_internal_addresses_are_refused(gateway, name, reason):
    r = gateway.curl(f"https://{name}/")
    assert r.connect_status == 403, r
    rec = gateway.wait_record(lambda r: r.get("host") == name and r.get("decision") == "deny")
    assert rec["reason"].startswith(reason), rec


@pytest.mark.parametrize("literal", [
    "127.0.0.1", "2130706433", "0x7f000001", "0177.0.0.1", "127.1", "[::1]", "[::ffff:127.0.0.1]",
    "169.254.169.254", "0.0.0.0", "10.1.2.3", "100.64.0.1", "224.0.0.1", "255.255.255.255", "[fd00::1]",
    "0x7f.0.0.1", "[::ffff:7f00:1]",
])
def test_ip_literals_in_every_spelling_are_refused(gateway, lab, literal):
    s, head = lab.call_gw(rawclient.connect_tunnel, gateway.proxy_port, f"{literal}:443", _auth(gateway))
    s.close()
    assert rawclient.connect_status(head) == 403, (literal, head)
    assert b"ssrf_" in head, head


def test_gateway_own_listener_is_refused(gateway, lab):
    s, head = lab.call_gw(rawclient.connect_tunnel, gateway.proxy_port, f"127.0.0.1:{gateway.proxy_port}",
                          _auth(gateway))
    s.close()
    assert rawclient.connect_status(head) == 403


def test_ip_literal_allowed_only_through_a_cidr_rule(gateway, lab):
    s, head = lab.call_gw(rawclient.connect_tunnel, gateway.proxy_port, "198.18.0.10:443", _auth(gateway))
    s.close()
    assert rawclient.connect_status(head) == 200, head
    s, head = lab.call_gw(rawclient.connect_tunnel, gateway.proxy_port, "198.18.0.11:443", _auth(gateway))
    s.close()
    assert rawclient.connect_status(head) == 403, head


def test_dns_rebinding_never_reaches_the_internal_answer(gateway):
    # rebind.allowed.test alternates 198.18.0.10 / 127.0.0.1 with TTL 0. The
    # gateway checks at CONNECT and again where it connects; whatever the
    # answer at connect time, only a checked address is ever dialled.
    for _ in range(6):
        gateway.curl("https://rebind.allowed.test/")
    recs = [r for r in gateway.audit_records() if r.get("host") == "rebind.allowed.test"]
    upstreams = [r["upstream"] for r in recs if r.get("upstream")]
    assert all(u.startswith("198.18.0.10:") for u in upstreams), upstreams
    blocked = [r for r in recs if r.get("reason") in ("upstream_blocked", "ssrf_loopback")]
    assert len(blocked) + len(upstreams) >= 6, recs
    assert all("127.0.0.1: loopback" in r.get("extra", {}).get("error", "127.0.0.1: loopback")
               for r in blocked if r.get("reason") == "upstream_blocked")


def test_mixed_answers_connect_only_to_the_public_address(gateway):
    for _ in range(3):
        r = gateway.curl("https://mixed.evil.test/")
        assert r.status == 200, r
    recs = [r for r in gateway.audit_records()
            if r["event"] == "connection_closed" and r.get("host") == "mixed.evil.test" and r.get("upstream")]
    assert recs and all(r["upstream"].startswith("198.18.0.10:") for r in recs)


# --------------------------------------------------------------- plain HTTP
def test_plain_http_goes_through_the_same_policy(gateway):
    r = gateway.curl("http://api.allowed.test/plain")
    assert r.status == 200, r
    body = r.json()
    assert "proxy-authorization" not in {k.lower() for k in body["headers"]}, "proxy credentials leaked upstream"
    assert gateway.curl("http://denied.test/").status == 403
    r = gateway.curl("http://api.allowed.test/", "-H", "Host: denied.test")
    assert r.status == 421, r


# -------------------------------------------------------------- interception
def test_path_rules_intercept_and_decide_per_request(gateway):
    ca = str(gateway.ca_cert)
    r = gateway.curl("https://echo.allowed.test/ok", "--cacert", ca)
    assert r.status == 200, r
    assert r.json()["path"] == "/ok"
    r = gateway.curl("https://echo.allowed.test/admin/users", "--cacert", ca)
    assert r.status == 403, r
    rec = gateway.wait_record(lambda r: r["event"] == "request" and r.get("path") == "/admin/users")
    assert rec["rule"] == "echo-admin" and rec["decision"] == "deny"


def test_host_header_different_from_tunnel_host_is_421(gateway):
    r = gateway.curl("https://echo.allowed.test/", "--cacert", str(gateway.ca_cert), "-H", "Host: api.allowed.test")
    assert r.status == 421, r


def test_http2_authority_different_from_sni_is_421(gateway, lab):
    def h2(*extra):
        r = lab.curl("-x", gateway.proxy_url(), "--http2", "--cacert", str(gateway.ca_cert), "-o", "/dev/null",
                     "-w", "%{http_version} %{http_code}", *extra, "https://echo.allowed.test/h2", lab_dns=False)
        return r.stdout.split()

    assert h2() == ["2", "200"]
    # curl sends a Host header as the HTTP/2 :authority pseudo-header.
    assert h2("-H", "Host: api.allowed.test") == ["2", "421"]


# --------------------------------------------------------------------- HTTP
SMUGGLING = [
    ("cl_and_te", b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"),
    ("duplicate_cl", b"Content-Length: 5\r\nContent-Length: 6\r\n"),
    ("obfuscated_te", b"Transfer-Encoding: xchunked\r\n"),
    ("te_list", b"Transfer-Encoding: chunked, identity\r\n"),
]


@pytest.mark.parametrize("name,headers", SMUGGLING)
def test_request_smuggling_shapes_are_refused(gateway, lab, name, headers):
    marker = f"smuggle-{name}"
    req = (f"POST http://api.allowed.test/{marker} HTTP/1.1".encode() + b"\r\nHost: api.allowed.test\r\n" + headers
           + _auth(gateway).encode() + b"\r\n\r\n0\r\n\r\n")
    out = lab.call_gw(rawclient.send_raw, gateway.proxy_port, req)
    assert out.startswith(b"HTTP/1.1 400"), (name, out[:200])
    assert marker not in lab.logs("upstream")


def test_bare_cr_in_header_value_is_refused(gateway, lab):
    req = (b"GET http://api.allowed.test/ HTTP/1.1\r\nHost: api.allowed.test\r\nX-A: a\rb\r\n"
           + _auth(gateway).encode() + b"\r\n\r\n")
    out = lab.call_gw(rawclient.send_raw, gateway.proxy_port, req)
    assert out.startswith(b"HTTP/1.1 400"), out[:200]


def test_oversized_and_too_many_headers_are_refused(gateway, lab):
    big = b"X-Big: " + b"a" * 40000 + b"\r\n"
    req = b"GET http://api.allowed.test/ HTTP/1.1\r\nHost: api.allowed.test\r\n" + big + _auth(gateway).encode() + b"\r\n\r\n"
    out = lab.call_gw(rawclient.send_raw, gateway.proxy_port, req)
    assert out[:12] in (b"HTTP/1.1 431", b"HTTP/1.1 400"), out[:200]
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(150))
    req = b"GET http://api.allowed.test/ HTTP/1.1\r\nHost: api.allowed.test\r\n" + many + _auth(gateway).encode() + b"\r\n\r\n"
    out = lab.call_gw(rawclient.send_raw, gateway.proxy_port, req)
    assert out.startswith(b"HTTP/1.1 431"), out[:200]


def test_pipelined_requests_to_different_hosts_are_decided_separately(gateway, lab):
    a = _auth(gateway).encode()
    req = (b"GET http://api.allowed.test/one HTTP/1.1\r\nHost: api.allowed.test\r\n" + a + b"\r\n\r\n"
           b"GET http://denied.test/two HTTP/1.1\r\nHost: denied.test\r\n" + a + b"\r\nConnection: close\r\n\r\n")
    out = lab.call_gw(rawclient.send_raw, gateway.proxy_port, req)
    assert out.startswith(b"HTTP/1.1 200"), out[:300]
    assert b"HTTP/1.1 403" in out, out[-300:]
    assert b"/two" not in out.split(b"HTTP/1.1 403")[0]


def test_non_tls_bytes_on_443_are_refused(gateway, lab):
    def go():
        s, head = rawclient.connect_tunnel(gateway.proxy_port, "api.allowed.test:443", _auth(gateway))
        s.sendall(b"GET / HTTP/1.1\r\nHost: api.allowed.test\r\n\r\n")
        return head, rawclient.recv_all(s, 3)

    head, out = lab.call_gw(go)
    assert rawclient.connect_status(head) == 200
    assert b"HTTP/1.1 200" not in out
    gateway.wait_record(lambda r: r.get("reason") == "plaintext_on_tls_port")


def test_tls_on_port_80_is_refused(gateway, lab):
    out = lab.call_gw(rawclient.tls_through_tunnel, gateway.proxy_port, "api.allowed.test:80", _auth(gateway),
                      sni="api.allowed.test", cafile=None)
    assert out["handshake"].startswith("failed"), out
    gateway.wait_record(lambda r: r.get("reason") == "tls_on_plain_port")


def test_slow_clients_do_not_starve_others(gateway, lab):
    import threading

    holder = threading.Thread(target=lambda: lab.call_gw(rawclient.slow_clients, gateway.proxy_port, 50, 4.0))
    holder.start()
    try:
        for _ in range(3):
            r = gateway.curl("https://api.allowed.test/", timeout=5)
            assert r.status == 200, r
    finally:
        holder.join(20)


def test_client_aborting_mid_body_leaves_gateway_serving(gateway, lab):
    req = (b"POST http://api.allowed.test/upload HTTP/1.1\r\nHost: api.allowed.test\r\nContent-Length: 100000\r\n"
           + _auth(gateway).encode() + b"\r\n\r\n" + b"x" * 100)

    def abort():
        import socket
        s = socket.create_connection(("127.0.0.1", gateway.proxy_port))
        s.sendall(req)
        s.close()

    for _ in range(5):
        lab.call_gw(abort)
    assert gateway.curl("https://api.allowed.test/").status == 200


# ------------------------------------------------------------ audit + ops
def test_audit_query_cli_filters(gateway):
    gateway.curl("https://denied.test/q")
    gateway.wait_record(lambda r: r.get("host") == "denied.test")   # in the log: the CLI syncs its index from it
    out = gateway.cli("audit", "query", "--dir", str(gateway.audit_dir), "--sandbox", "sb-1",
                      "--decision", "deny", "--host", "denied.test", "--json")
    rows = [json.loads(l) for l in out.splitlines() if l.strip()] if not out.lstrip().startswith("[") else json.loads(out)
    assert rows and all(r["decision"] == "deny" and r["host"] == "denied.test" for r in rows)
    table = gateway.cli("audit", "query", "--dir", str(gateway.audit_dir), "--decision", "allow", "--limit", "5")
    assert "allow" in table and "denied.test" not in table


def test_metrics_count_decisions_by_sandbox_reason_action(gateway):
    gateway.curl("https://denied.test/m")
    code, body = gateway.ops_status("/metrics")
    assert code == 200
    assert 'cubegate_decisions_total{action="deny",reason="default_deny",sandbox="sb-1",stage="connect"}' in body
    assert "cubegate_active_connections" in body
    assert "cubegate_decision_seconds_bucket" in body


def test_healthz_and_readyz(gateway):
    code, body = gateway.ops_status("/healthz")
    assert code == 200
    code, body = gateway.ops_status("/readyz")
    assert code == 200
    checks = json.loads(body)["checks"]
    assert set(checks) >= {"policy", "ca", "listeners", "audit"} and all(c["ok"] for c in checks.values())
