"""The fast path's pure parts, without a network: heads, refusal pages, claims, records."""
from __future__ import annotations

import ssl

import pytest

from egress import records
from egress.conn_state import ConnectionClaims, ConnState
from egress.fastpath import heads
from egress.identity import Identity
from egress.policy import Decision


def client_hello(sni: str | None) -> bytes:
    """A real ClientHello, as Python's ssl module writes it."""
    ctx = ssl.create_default_context()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=sni) if sni else \
        ssl._create_unverified_context().wrap_bio(inc, out)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


# ------------------------------------------------------------------ CONNECT head
@pytest.mark.parametrize("buf, end", [
    (b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n", 35),
    (b"CONNECT a:443 HTTP/1.1\n\nrest", 24),
    (b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n", -1),
    (b"", -1),
])
def test_head_end(buf, end):
    assert heads.head_end(buf) == end


def test_connect_head_is_parsed_with_its_credentials():
    h = heads.parse_connect(b"CONNECT api.test:443 HTTP/1.1\r\nHost: api.test:443\r\n"
                            b"Proxy-Authorization: Basic eDp5\r\n\r\n")
    assert h == heads.ConnectHead("api.test", 443, "Basic eDp5", True)


def test_connect_without_credentials_and_with_two():
    assert heads.parse_connect(b"CONNECT api.test:443 HTTP/1.1\r\n\r\n").has_proxy_authorization is False
    two = heads.parse_connect(b"CONNECT api.test:443 HTTP/1.1\r\nProxy-Authorization: a\r\n"
                              b"Proxy-Authorization: b\r\n\r\n")
    assert two.proxy_authorization is None and two.has_proxy_authorization   # refused as invalid, never picked


@pytest.mark.parametrize("head", [
    b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n",        # plain HTTP: mitmproxy's
    b"CONNECT a.test HTTP/1.1\r\n\r\n",                            # no port
    b"CONNECT a.test:443 HTTP/1.1\r\nBad Header\r\n\r\n",          # malformed
    b"CONNECT a.test:99999 HTTP/1.1\r\n\r\n",
    "CONNECT bücher.test:443 HTTP/1.1\r\n\r\n".encode(),
    b"connect a.test:443 HTTP/1.1\r\n\r\n",
])
def test_heads_the_fast_path_does_not_answer_go_to_mitmproxy(head):
    assert heads.parse_connect(head) is None


# ------------------------------------------------------------------ ClientHello
def test_client_hello_gives_its_sni_once_complete():
    hello = client_hello("api.allowed.test")
    assert heads.read_hello(hello, False) == heads.Hello("tls", sni="api.allowed.test")
    assert heads.read_hello(hello[:10], False).state == "incomplete"
    assert heads.read_hello(hello[:10], True).state == "invalid"       # cut short by EOF
    assert heads.read_hello(b"\x16", False).state == "incomplete"


def test_client_hello_without_sni():
    assert heads.read_hello(client_hello(None), False) == heads.Hello("tls", sni=None)


@pytest.mark.parametrize("data, http", [
    (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", True),
    (b"SSH-2.0-OpenSSH\r\n", False),
    (b"\x00\x01\x02\x03", False),
    (b"GE", False),
])
def test_non_tls_first_bytes_are_told_apart_like_mitmproxy_does(data, http):
    h = heads.read_hello(data, True)
    assert h.state == "not_tls" and h.looks_like_http is http


def test_garbage_after_a_tls_record_header_is_invalid():
    assert heads.read_hello(b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00", False).state == "invalid"


# ------------------------------------------------------------------ our answers
def test_refusal_page_is_the_gates():
    raw = heads.refusal_response(407, "proxy_auth_missing", "send it", {"Proxy-Authenticate": 'Basic realm="x"'})
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 407 Proxy Authentication Required"
    hdrs = dict(line.split(": ", 1) for line in lines[1:])
    assert hdrs["X-Cubegate-Reason"] == "proxy_auth_missing" and hdrs["Connection"] == "close"
    assert hdrs["Proxy-Authenticate"] == 'Basic realm="x"' and int(hdrs["content-length"]) == len(body)
    assert body == records.deny_body(407, "proxy_auth_missing", "send it")


def test_refusal_page_reads_like_the_gates_json_refusal():
    """Same status, headers and JSON body (host, port, rule, policy, where to ask) as PolicyGate's."""
    import json

    from egress.gate import PolicyGate
    st = _st()
    st.host, st.port = "denied.example", 443
    d = Decision("deny", "rule_deny", "no-denied", "team-a", "enforce", False, False, None)
    want = PolicyGate._deny_response(403, "rule_deny", "policy team-a, rule no-denied", st=st, decision=d)
    raw = heads.refusal_response(403, "rule_deny", "policy team-a, rule no-denied", st=st, decision=d)
    head, _, body = raw.partition(b"\r\n\r\n")
    hdrs = {k.lower(): v for k, v in (line.split(": ", 1) for line in head.decode().split("\r\n")[1:])}
    assert head.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert body == want.content
    for name in ("content-type", "x-cubegate-reason", "connection"):
        assert hdrs[name] == want.headers[name]
    doc = json.loads(body)
    assert doc["host"] == "denied.example" and doc["rule"] == "no-denied" and doc["policy"] == "team-a"
    assert "cubegate.internal" in doc["ask_for_access"]


# ------------------------------------------------------------------ claims, records
def _st(n=1) -> ConnState:
    return ConnState(conn_id=f"c{n}", client="10.0.0.1:1", started=0.0)


def test_claims_are_bounded_per_sandbox_and_released_once():
    claims = ConnectionClaims(2)
    a, b, c = _st(1), _st(2), _st(3)
    sb = Identity("sb-1")
    assert claims.claim(a, sb) and claims.claim(a, sb) and claims.claim(b, sb)   # a twice = one claim
    assert not claims.claim(c, sb)
    assert claims.claim(c, Identity("sb-2"))       # another sandbox has its own budget
    claims.release(a)
    claims.release(a)                              # a second release changes nothing
    assert claims.open == {"sb-1": 1, "sb-2": 1}
    assert claims.claim(_st(4), sb)


def test_closed_record_fields_of_a_refused_and_a_relayed_connection():
    st = _st()
    st.kind, st.denied_reason = "denied", "sni_mismatch"
    st.decision = Decision("allow", "rule_allow", "r", "p", "enforce", False, False, None)
    f = records.closed_fields(st, 0.0125)
    assert (f["decision"], f["reason"], f["duration_ms"], f["extra"]["kind"]) == ("deny", "sni_mismatch", 12.5,
                                                                                  "denied")
    st.kind, st.denied_reason, st.bytes_in, st.bytes_out = "passthrough", None, 7, 9
    f = records.closed_fields(st, 1.0)
    assert (f["decision"], f["reason"], f["bytes_in"], f["bytes_out"]) == ("allow", "rule_allow", 7, 9)


def test_audit_record_carries_the_connection_and_drops_unset_fields():
    st = _st()
    st.identity, st.host, st.port = Identity("sb-1"), "a.test", 443
    rec = records.audit_record("decision", st, decision="deny", reason="x", status=None)
    assert rec["sandbox"] == "sb-1" and rec["host"] == "a.test" and "status" not in rec
    from egress.audit.record import to_line
    to_line(rec)   # fits the closed schema


# ------------------------------------------------------------------ the check after connecting
def test_the_connected_address_is_checked_again_unless_the_verdict_checked_it_under_the_same_policy():
    """connected_refusal is skipped only for a resolved verdict's address, under the policy object
    that verdict was made under, with the resolver guarding by the gate's guard."""
    from types import SimpleNamespace

    from egress.destination import Verdict
    from egress.fastpath.server import _checked_already
    guard, policy, other = object(), object(), object()
    gate = SimpleNamespace(policies=SimpleNamespace(current=policy), guard=guard,
                           resolver=SimpleNamespace(guard=guard))
    resolved = Verdict(None, None, ((2, "198.18.0.30"),), resolved=True)
    assert _checked_already(gate, resolved, policy)
    assert not _checked_already(gate, resolved, other)                       # a policy swapped in meanwhile
    assert not _checked_already(gate, Verdict(None, None, ((2, "198.18.0.30"),)), policy)   # an IP literal
    gate.resolver = SimpleNamespace(guard=object())
    assert not _checked_already(gate, resolved, policy)                      # another guard resolved it
    gate.resolver = SimpleNamespace()
    assert not _checked_already(gate, resolved, policy)
