"""The gate's hooks on synthetic flows (mitmproxy's taddons/tflow), without a network namespace.

Real parts, small: policies from a YAML file, identities and the vault in SQLite
files under tmp_path (the vault created with a test key and unsealed), the audit
log in tmp_path, the SSRF guard and a guarded resolver asking a real DNS server
(testbed's zone server) on loopback. Each test drives the hooks in mitmproxy's
order (client_connected → http_connect → tls_clienthello → requestheaders →
request → responseheaders → response) and reads what a sandbox and an operator
would see: the flow's response, its headers, the audit records, the metrics.
The lab tests (test_explicit_proxy.py, test_credentials.py, ...) drive the same
through real sockets.
"""
from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from dnslib.server import DNSServer
from mitmproxy import http, tls
from mitmproxy.connection import Client
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.test import taddons, tflow, tutils

import vault as vaultlib
from egress import mitm_internals, netguard
from egress.audit.log import AuditLog
from egress.credentials import VaultCredentials
from egress.gate import PolicyGate
from egress.identity import Identity, IdentityStore
from egress.metrics import GatewayMetrics
from egress.policy.reload import PolicyStore
from egress.reasons import REASONS
from testbed.dnsserver import ZoneResolver, _QuietLogger
from tests.gateway.test_fastpath_units import client_hello

SECRET = "sk-live-unit-4b1d9e77c0a2f3e5"          # injected into api.allowed.test
OTHER_SECRET = "sk-live-billing-93e1aa04c7d2b6f8"  # bound to billing.allowed.test only
POLICY = """\
name: units
tenant: acme
default: deny
rules:
  - name: lab
    action: allow
    match: {hosts: [api.allowed.test, other.allowed.test, private.allowed.test], ports: [443, 80]}
  - name: denied
    action: deny
    match: {hosts: [denied.test]}
"""
ZONE = {"api.allowed.test": ["198.18.0.10"], "other.allowed.test": ["198.18.0.11"],
        "private.allowed.test": ["10.1.2.3"]}
SANDBOX_IP = "10.200.0.7"


# ---------------------------------------------------------------- real parts
@pytest.fixture(scope="module")
def nameserver(tmp_path_factory):
    zone = tmp_path_factory.mktemp("zone") / "zone.json"
    zone.write_text(json.dumps(ZONE))
    server = DNSServer(ZoneResolver(str(zone)), address="127.0.0.1", port=0, logger=_QuietLogger())
    server.start_thread()
    yield f"127.0.0.1:{server.server.server_address[1]}"
    server.stop()
    server.server.server_close()


class Lookup:
    """Transparent mode's source-address lookup (the cubevs registry's duck type)."""

    def __init__(self, known: dict[str, Identity]):
        self.known = known

    def lookup_by_ip(self, ip: str) -> Identity | None:
        return self.known.get(ip)


@dataclass
class Parts:
    gate: PolicyGate
    metrics: GatewayMetrics
    audit_dir: Path
    token: str

    def auth(self, sandbox: str = "sb-1", token: str | None = None) -> str:
        return "Basic " + base64.b64encode(f"{sandbox}:{token or self.token}".encode()).decode()

    def records(self) -> list[dict]:
        return [json.loads(line) for line in (self.audit_dir / "audit-current.jsonl").read_text().splitlines()]

    def counted(self, action: str, reason: str, stage: str, sandbox: str = "sb-1") -> float:
        return self.metrics.registry.get_sample_value(
            "cubegate_decisions_total", {"sandbox": sandbox, "action": action, "reason": reason, "stage": stage}) or 0


@pytest.fixture
def parts(tmp_path, nameserver):
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "units.yaml").write_text(POLICY)
    identities = IdentityStore(tmp_path / "identities.db")
    token = identities.add("sb-1")
    vault = vaultlib.Vault.init(tmp_path / "vault.db", vaultlib.create_key_file(tmp_path / "vault.key"))
    vault.put_secret("acme", "openai", SECRET)
    vault.put_secret("acme", "billing", OTHER_SECRET)
    vault.add_binding({"id": "b-api", "tenant": "acme", "secret_id": "openai",
                       "match": {"hosts": ["api.allowed.test"], "ports": [443]},
                       "inject": {"type": "header", "name": "Authorization", "format": "Bearer {secret}"}})
    vault.add_binding({"id": "b-billing", "tenant": "acme", "secret_id": "billing",
                       "match": {"hosts": ["billing.allowed.test"], "ports": [443]},
                       "inject": {"type": "header", "name": "X-Api-Key", "format": "{secret}"}})
    audit = AuditLog(tmp_path / "audit", fsync="never")
    metrics = GatewayMetrics()
    guard = netguard.AddressGuard(allow_cidrs=["198.18.0.0/24"])
    gate = PolicyGate(policies=PolicyStore(tmp_path / "policies"), identities=identities, guard=guard,
                      resolver=netguard.GuardedResolver(guard, nameservers=[nameserver], timeout=2.0),
                      audit=audit, metrics=metrics, credentials=VaultCredentials(vault, metrics=metrics),
                      sandbox_lookup=Lookup({SANDBOX_IP: Identity("sb-1")}))
    p = Parts(gate, metrics, tmp_path / "audit", token)
    yield p
    # Every reason these flows wrote is one the registry knows (egress/reasons.py).
    if (p.audit_dir / "audit-current.jsonl").exists():
        assert {r["reason"] for r in p.records() if r.get("reason")} <= set(REASONS)
    audit.close()
    vault.close()
    identities.close()


def run(parts: Parts, scenario):
    """Run `scenario(tctx)` on an event loop with the gate loaded in a mitmproxy test context."""
    async def main():
        with taddons.context(parts.gate) as tctx:
            return await scenario(tctx)
    return asyncio.run(main())


# ---------------------------------------------------------------- flows
def connected(parts: Parts, *, transparent: bool = False, port: int = 443) -> Client:
    client = tflow.tclient_conn()
    if transparent:
        client.peername, client.sockname = (SANDBOX_IP, 40000), ("198.18.0.10", port)
        client.proxy_mode = ProxyMode.parse("transparent")
    parts.gate.client_connected(client)
    return client


def connect_flow(client: Client, host: str, port: int = 443, auth: str | None = None) -> http.HTTPFlow:
    headers = http.Headers(host=f"{host}:{port}")
    if auth is not None:
        headers["Proxy-Authorization"] = auth
    req = tutils.treq(method=b"CONNECT", scheme=b"", host=host, port=port, authority=f"{host}:{port}".encode(),
                      path=b"", headers=headers, content=b"")
    return tflow.tflow(client_conn=client, req=req)


def hello(tctx, client: Client, sni: str | None) -> tls.ClientHelloData:
    """The tls_clienthello hook's data for a real ClientHello (Python's ssl module wrote it)."""
    return tls.ClientHelloData(Context(client, tctx.options), mitm_internals.parse_client_hello(client_hello(sni)))


async def tunnel(parts: Parts, tctx, host: str) -> tuple[Client, tls.ClientHelloData]:
    """An explicit-proxy CONNECT + ClientHello to `host`, allowed."""
    client = connected(parts)
    f = connect_flow(client, host, auth=parts.auth())
    await parts.gate.http_connect(f)
    assert f.response is None, f.response and f.response.get_text()
    data = hello(tctx, client, host)
    await parts.gate.tls_clienthello(data)
    return client, data


def inner_request(client: Client, host: str, path: str = "/v1/chat", *, hosts: list[str] | None = None,
                  headers=(), authority: str = "", method: str = "GET", content: bytes = b"") -> http.HTTPFlow:
    """A request inside the tunnel, with Host headers `hosts` (default: `host`)."""
    names = [host] if hosts is None else hosts
    h = http.Headers([*((b"host", n.encode()) for n in names), *((k.encode(), v.encode()) for k, v in headers)])
    req = tutils.treq(method=method.encode(), scheme=b"https", host=host.split(":")[0], port=443,
                      authority=authority.encode(), path=path.encode(), headers=h, content=content)
    return tflow.tflow(client_conn=client, req=req)


def deny_doc(f: http.HTTPFlow) -> dict:
    assert f.response is not None, "not refused"
    assert f.response.headers["Content-Type"] == "application/json"
    assert f.response.headers["X-Cubegate-Reason"] == json.loads(f.response.get_text())["reason"]
    return json.loads(f.response.get_text())


# ---------------------------------------------------------------- decisions at CONNECT
def connect_once(parts: Parts, host: str, auth: str | None) -> http.HTTPFlow:
    """One CONNECT on a new connection, through the gate's http_connect hook."""
    async def scenario(tctx):
        f = connect_flow(connected(parts), host, auth=auth)
        await parts.gate.http_connect(f)
        return f
    return run(parts, scenario)


def test_connect_denied_by_rule_answers_readable_json_with_the_reason(parts):
    f = connect_once(parts, "denied.test", parts.auth())
    assert f.response.status_code == 403 and f.response.headers["Connection"] == "close"
    doc = deny_doc(f)
    assert doc["error"] == "refused_by_cubegate" and doc["reason"] == "rule_deny"
    assert (doc["host"], doc["port"], doc["rule"], doc["policy"]) == ("denied.test", 443, "denied", "units")
    assert "/v1/access-requests" in doc["ask_for_access"]
    rec = parts.records()[-1]
    assert rec["event"] == "decision" and rec["decision"] == "deny" and rec["reason"] == "rule_deny"
    assert (rec["sandbox"], rec["host"], rec["port"], rec["method"], rec["status"]) == \
        ("sb-1", "denied.test", 443, "CONNECT", 403)
    assert parts.counted("deny", "rule_deny", "connect") == 1


@pytest.mark.parametrize("auth, reason", [(None, "proxy_auth_missing"), ("wrong", "proxy_auth_invalid")])
def test_connect_without_valid_proxy_auth_is_407(parts, auth, reason):
    f = connect_once(parts, "api.allowed.test", None if auth is None else parts.auth(token=auth))
    assert f.response.status_code == 407 and f.response.headers["Proxy-Authenticate"] == 'Basic realm="cubegate"'
    assert deny_doc(f)["reason"] == reason
    rec = parts.records()[-1]
    assert (rec["reason"], rec["status"], rec["sandbox"]) == (reason, 407, None)
    assert parts.token not in json.dumps(parts.records())


def test_connect_to_a_name_resolving_to_a_private_address_is_refused_after_resolution(parts):
    f = connect_once(parts, "private.allowed.test", parts.auth())
    assert f.response.status_code == 403 and deny_doc(f)["reason"] == "ssrf_private"
    rec = parts.records()[-1]
    assert rec["rule"] == "lab" and rec["reason"] == "ssrf_private"   # the policy allowed it; the guard did not


def test_allowed_connect_is_audited_before_the_tunnel_with_its_decision(parts):
    async def scenario(tctx):
        client = connected(parts)
        f = connect_flow(client, "api.allowed.test", auth=parts.auth())
        await parts.gate.http_connect(f)
        st = parts.gate.conns[client.id]
        assert f.response is None and st.tunnel and st.intercept      # a binding: intercepted
        parts.gate.client_disconnected(client)
    run(parts, scenario)
    decision, closed = parts.records()[-2:]
    assert decision["event"] == "decision" and decision["decision"] == "allow"
    assert {k: decision[k] for k in ("sandbox", "host", "port", "method", "status", "reason", "rule", "policy",
                                     "mode")} == {"sandbox": "sb-1", "host": "api.allowed.test", "port": 443,
                                                  "method": "CONNECT", "status": 200, "reason": "rule_allow",
                                                  "rule": "lab", "policy": "units", "mode": "enforce"}
    assert decision["extra"] == {"intercept": True} and decision["conn_id"] == closed["conn_id"]
    assert closed["event"] == "connection_closed" and closed["decision"] == "allow"
    assert {"bytes_in", "bytes_out", "duration_ms"} <= set(closed) and closed["extra"]["kind"] == "pending"
    assert parts.counted("allow", "rule_allow", "connect") == 1


def test_unbound_allowed_host_passes_through_without_interception(parts):
    async def scenario(tctx):
        client, data = await tunnel(parts, tctx, "other.allowed.test")
        return parts.gate.conns[client.id], data
    st, data = run(parts, scenario)
    assert st.kind == "passthrough" and not st.intercept and data.ignore_connection


def test_sni_naming_another_host_than_connect_is_refused(parts):
    async def scenario(tctx):
        client = connected(parts)
        await parts.gate.http_connect(connect_flow(client, "other.allowed.test", auth=parts.auth()))
        data = hello(tctx, client, "api.allowed.test")
        await parts.gate.tls_clienthello(data)
        return parts.gate.conns[client.id]
    st = run(parts, scenario)
    assert (st.kind, st.denied_reason) == ("denied", "sni_mismatch")
    rec = parts.records()[-1]
    assert (rec["reason"], rec["status"], rec["sni"]) == ("sni_mismatch", 403, "api.allowed.test")
    assert parts.counted("deny", "sni_mismatch", "sni") == 1


# ---------------------------------------------------------------- transparent mode
def test_transparent_unknown_source_is_refused_before_any_byte(parts):
    async def scenario(tctx):
        client = tflow.tclient_conn()
        client.peername, client.sockname = ("10.200.0.99", 40000), ("198.18.0.10", 443)
        client.proxy_mode = ProxyMode.parse("transparent")
        parts.gate.client_connected(client)
        return client
    client = run(parts, scenario)
    assert client.error == "unknown source address"
    rec = parts.records()[-1]
    assert (rec["reason"], rec["client"], rec["sandbox"]) == ("unknown_source", "10.200.0.99:40000", None)


def test_transparent_destination_is_the_sni_never_the_original_address(parts):
    async def scenario(tctx):
        client = connected(parts, transparent=True)
        data = hello(tctx, client, "other.allowed.test")
        await parts.gate.tls_clienthello(data)
        return parts.gate.conns[client.id], data
    st, data = run(parts, scenario)
    assert data.ignore_connection and st.kind == "passthrough"
    assert data.context.server.address == ("other.allowed.test", 443)
    rec = parts.records()[-1]
    assert (rec["sandbox"], rec["host"], rec["decision"], rec["reason"]) == \
        ("sb-1", "other.allowed.test", "allow", "rule_allow")


# ---------------------------------------------------------------- requests inside a tunnel
@pytest.mark.parametrize("hosts, authority, status, reason", [
    ([], "other.allowed.test", 421, "authority_mismatch"),                               # HTTP/2 :authority
    (["api.allowed.test"], "api.allowed.test:8443", 421, "authority_mismatch"),          # its port differs
    (["other.allowed.test"], "", 421, "authority_mismatch"),                             # Host: fronting
    (["api.allowed.test:8443"], "", 421, "authority_mismatch"),                          # Host: port differs
    (["api.allowed.test", "api.allowed.test"], "", 400, "duplicate_host"),
    (["api.allowed.test", "other.allowed.test"], "", 400, "duplicate_host"),
])
def test_requests_naming_another_destination_are_refused_before_injection(parts, hosts, authority, status, reason):
    async def scenario(tctx):
        client, _ = await tunnel(parts, tctx, "api.allowed.test")
        f = inner_request(client, "api.allowed.test", hosts=hosts, authority=authority)
        await parts.gate.requestheaders(f)
        return f
    f = run(parts, scenario)
    assert f.response.status_code == status and deny_doc(f)["reason"] == reason
    assert "authorization" not in f.request.headers      # no key was put on a fronted request
    rec = parts.records()[-1]
    assert (rec["event"], rec["reason"], rec["status"], rec["path"]) == ("request", reason, status, "/v1/chat")


def test_fronting_refusal_says_which_name_differs(parts):
    async def scenario(tctx):
        client, _ = await tunnel(parts, tctx, "api.allowed.test")
        f = inner_request(client, "api.allowed.test", hosts=["other.allowed.test"])
        await parts.gate.requestheaders(f)
        return f
    f = run(parts, scenario)
    detail = deny_doc(f)["detail"]
    assert "Host header names other.allowed.test:443" in detail and "api.allowed.test:443" in detail


def test_injection_replaces_every_sandbox_copy_with_one_header_and_drops_range(parts):
    async def scenario(tctx):
        client, _ = await tunnel(parts, tctx, "api.allowed.test")
        f = inner_request(client, "api.allowed.test", headers=[
            ("Authorization", "Bearer sandbox-own"), ("authorization", "Bearer second"), ("Range", "bytes=0-7"),
            ("If-Range", "x"), ("Proxy-Authorization", parts.auth()), ("Accept", "*/*")])
        await parts.gate.requestheaders(f)
        await parts.gate.request(f)
        return f
    f = run(parts, scenario)
    assert f.response is None
    h = f.request.headers
    assert h.get_all("authorization") == [f"Bearer {SECRET}"]
    assert "range" not in h and "if-range" not in h and "proxy-authorization" not in h and h["accept"] == "*/*"
    rec = parts.records()[-1]
    assert rec["event"] == "request" and rec["decision"] == "allow" and rec["reason"] == "rule_allow"
    assert rec["extra"]["secret"] == "openai" and rec["extra"]["binding"] == "b-api"
    assert SECRET not in json.dumps(parts.records()) and parts.token not in json.dumps(parts.records())


def test_partial_response_on_an_injected_flow_is_refused_and_its_body_dropped(parts):
    async def scenario(tctx):
        client, _ = await tunnel(parts, tctx, "api.allowed.test")
        f = inner_request(client, "api.allowed.test")
        await parts.gate.requestheaders(f)
        await parts.gate.request(f)
        f.response = tutils.tresp(status_code=206, headers=http.Headers(content_range="bytes 0-7/64"),
                                  content=SECRET[:8].encode())
        parts.gate.responseheaders(f)
        refused = f.response
        streamed = b"".join(refused.stream(SECRET[:8].encode()) + refused.stream(b""))   # the upstream's body
        await parts.gate.response(f)
        return f, streamed
    f, streamed = run(parts, scenario)
    assert f.response.status_code == 502 and deny_doc(f)["reason"] == "range_on_injected_flow"
    assert SECRET[:8] not in f.response.get_text() and SECRET[:8].encode() not in streamed
    assert json.loads(streamed)["reason"] == "range_on_injected_flow"     # ours went out in its place
    rec = parts.records()[-1]
    assert (rec["event"], rec["reason"], rec["status"], rec["extra"]) == \
        ("response", "range_on_injected_flow", 502, {"upstream_status": 206})


def test_a_secret_in_request_trailers_is_refused_before_they_are_sent(parts):
    async def scenario(tctx):
        client, _ = await tunnel(parts, tctx, "api.allowed.test")
        f = inner_request(client, "api.allowed.test", method="POST", content=b"{}",
                          headers=[("content-length", "2")])
        await parts.gate.requestheaders(f)
        f.request.trailers = http.Headers(x_checksum=OTHER_SECRET)
        await parts.gate.request(f)
        return f
    f = run(parts, scenario)
    assert f.response.status_code == 403 and deny_doc(f)["reason"] == "credential_leak"
    assert f.request.trailers is None
    rec = parts.records()[-1]
    assert (rec["reason"], rec["extra"]) == ("credential_leak", {"stage": "request_trailers"})
    assert OTHER_SECRET not in json.dumps(parts.records())
    assert parts.counted("deny", "credential_leak", "body") == 1


def test_http1_trailers_mitmproxy_cannot_relay_are_audited_as_refused(parts):
    async def scenario(tctx):
        client, _ = await tunnel(parts, tctx, "other.allowed.test")
        st = parts.gate.conns[client.id]
        st.kind = "intercept"   # as if a path rule had asked for interception
        f = inner_request(client, "other.allowed.test", method="POST")
        f.error = tflow.terr(mitm_internals.TRAILERS_REFUSED)
        parts.gate.error(f)
    run(parts, scenario)
    rec = parts.records()[-1]
    assert (rec["event"], rec["decision"], rec["reason"], rec["status"]) == \
        ("request", "deny", "trailers_refused", 400)
    assert parts.counted("deny", "trailers_refused", "body") == 1


def test_requests_on_a_refused_connection_are_refused(parts):
    async def scenario(tctx):
        client = connected(parts)
        await parts.gate.http_connect(connect_flow(client, "denied.test", auth=parts.auth()))
        f = inner_request(client, "denied.test", path="/x?key=sk-live-in-query")
        await parts.gate.requestheaders(f)
        return f
    f = run(parts, scenario)
    assert f.response.status_code == 403 and deny_doc(f)["reason"] == "connection_denied"
    assert "sk-live-in-query" not in json.dumps(parts.records())   # the audit log keeps paths only
