"""Every reason the gateway can write: audit `reason`, X-Cubegate-Reason, metric `reason` label.

Pure data. One entry per reason: the layer that decides it, whether it allows or
denies, the HTTP status it is answered (or recorded) with where it has one, and a
line saying what it means. Call sites keep their string literals;
tests/gateway/test_reasons.py reads the code's AST and fails on a reason used but
not listed here, or listed but never used, and checks the switch's reasons against
cubevs.switch_schema.REASON_CODES (itself checked against switch.o's BTF). The
README's reason table is `markdown_table()` (`python -m egress.reasons`).

Layers: `policy` (a decision of egress.policy), `gateway` (the gate and the fast path:
identity, protocol, headers, bodies, credentials, upstream), `ssrf` (the address guard,
egress/netguard.py, written as ``ssrf_<guard reason>``), `dns` (the sandbox resolver),
`switch` (L3/L4 verdicts of the cubevs datapath, a namespace of their own, counted in
cubegate_switch_packets_total and net_drop records), `netwatch` (the gateway's reading
of switch events).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

LAYERS = ("policy", "gateway", "ssrf", "dns", "switch", "netwatch")


@dataclass(frozen=True)
class Reason:
    name: str
    layer: str
    outcome: str              # "allow", "deny" or "either" (the agent endpoint answers both)
    status: tuple[int, ...]   # HTTP status answered or recorded; () = none (reset, close, DNS, packet)
    meaning: str


_ALL = (
    # ---- policy: egress.policy decisions (PRECEDENCE.md)
    Reason("rule_allow", "policy", "allow", (), "an allow rule of the sandbox's policy matched"),
    Reason("default_allow", "policy", "allow", (), "no rule matched; the policy's default is allow"),
    Reason("grant_allow", "policy", "allow", (), "an access grant for the sandbox covers host:port"),
    Reason("inspect_required", "policy", "allow", (),
           "allowed so far; method/path rules decide each request after interception"),
    Reason("rule_deny", "policy", "deny", (403,), "a deny rule of the sandbox's policy matched"),
    Reason("default_deny", "policy", "deny", (403,), "no rule matched; the policy's default is deny"),
    Reason("no_policy", "policy", "deny", (403,), "no policy selects the sandbox"),
    Reason("global_deny", "policy", "deny", (403,), "a global deny (built-in metadata names/CIDRs, `global:`) matched"),
    Reason("ip_literal_not_allowed", "policy", "deny", (403,), "an IP-literal destination no `cidrs` rule allows"),
    Reason("invalid_host", "policy", "deny", (400,),
           "the host cannot be read unambiguously (400 from the parsers and as a policy decision)"),
    Reason("invalid_port", "policy", "deny", (403,), "the port is not 1-65535"),
    Reason("invalid_path", "policy", "deny", (403,), "the path cannot be read unambiguously"),
    Reason("sandbox_network_deny", "policy", "deny", (403,), "the sandbox's own network options deny the destination"),
    Reason("sandbox_network_not_allowed", "policy", "deny", (403,),
           "the sandbox's own network options list allows and none covers the destination"),
    Reason("resolved_global_deny", "policy", "deny", (403,),
           "a name resolved only into a global denied range (built-in metadata CIDRs, `global.denied_cidrs`)"),
    Reason("resolved_sandbox_network_deny", "policy", "deny", (403,),
           "a name resolved only into a range the sandbox's network options deny (a `deny` address entry)"),

    # ---- gateway: identity and connection
    Reason("proxy_auth_missing", "gateway", "deny", (407,), "explicit proxy: no Proxy-Authorization"),
    Reason("proxy_auth_invalid", "gateway", "deny", (407,), "explicit proxy: Proxy-Authorization names no identity"),
    Reason("proxy_auth_wrong_source", "gateway", "deny", (407,),
           "explicit proxy: a sandbox's token sent from an address other than that sandbox's"),
    Reason("unknown_source", "gateway", "deny", (), "transparent: the source address is no sandbox's"),
    Reason("not_steered", "gateway", "deny", (), "transparent: a port the switch does not steer (not 80/443)"),
    Reason("sandbox_connection_limit", "gateway", "deny", (429,), "the sandbox holds its limit of connections"),
    Reason("no_connection_state", "gateway", "deny", (503,), "internal: a CONNECT on a connection the gate never saw"),
    Reason("connection_denied", "gateway", "deny", (403,), "a request on a connection that was already refused"),
    Reason("internal_error", "gateway", "deny", (502, 503),
           "a bug or an unplanned failure in the gate's hooks or the fast path: refused (503 for a request, "
           "502 for a response, else reset; fail closed)"),
    Reason("refusals_counted", "gateway", "deny", (),
           "refusals past a source's per-interval budget, counted by reason and host in one record"),
    Reason("audit_unavailable", "gateway", "deny", (503,), "the audit log cannot be written (fail closed)"),
    Reason("policy_revoked", "gateway", "deny", (), "an open connection the policy now denies was closed"),
    Reason("header_timeout", "gateway", "deny", (), "the request head or ClientHello did not arrive in time"),
    Reason("agent_endpoint", "gateway", "either", (),
           "a request to cubegate.internal, answered by the gateway itself (its own status)"),
    Reason("agent_endpoint_plain_http_only", "gateway", "deny", (403,),
           "cubegate.internal asked for other than plain HTTP on port 80"),
    Reason("agent_request_refused", "gateway", "deny", (413,),
           "a cubegate.internal request not on port 80 or with a body over its limit"),
    # ---- gateway: protocol and TLS
    Reason("tls_without_connect", "gateway", "deny", (403,), "TLS to the explicit proxy port without CONNECT"),
    Reason("tls_on_plain_port", "gateway", "deny", (403,), "a TLS ClientHello on a plain-HTTP port"),
    Reason("sni_missing", "gateway", "deny", (403,), "transparent TLS without SNI: destination unknown"),
    Reason("invalid_sni", "gateway", "deny", (403,), "the SNI is not exactly one valid host name"),
    Reason("sni_mismatch", "gateway", "deny", (403,), "the SNI differs from the CONNECT host"),
    Reason("invalid_client_hello", "gateway", "deny", (), "the first bytes are not a readable ClientHello (or one over 16 KiB)"),
    Reason("non_tls_on_tls_port", "gateway", "deny", (), "non-TLS, non-HTTP bytes on a TLS port"),
    Reason("plaintext_on_tls_port", "gateway", "deny", (), "plain HTTP on a TLS port"),
    Reason("non_http_on_http_port", "gateway", "deny", (), "non-HTTP bytes on a plain-HTTP port"),
    Reason("relay_failed", "gateway", "deny", (400, 413, 502),
           "mitmproxy could not relay the message (protocol error, upstream failure); the audit log has the cause"),
    Reason("upgrade_refused", "gateway", "deny", (502,), "a 101 upgrade other than WebSocket on an inspected connection"),
    # ---- gateway: request heads
    Reason("head_too_large", "gateway", "deny", (431,), "the request head is over the size limit before it ends"),
    Reason("too_many_headers", "gateway", "deny", (431,), "more request headers than max_header_count"),
    Reason("headers_too_large", "gateway", "deny", (431,), "request headers over max_header_bytes"),
    Reason("bad_header_value", "gateway", "deny", (400,), "a header value contains CR, LF or NUL"),
    Reason("duplicate_content_length", "gateway", "deny", (400,), "more than one Content-Length (smuggling shape)"),
    Reason("content_length_and_transfer_encoding", "gateway", "deny", (400,),
           "both Content-Length and Transfer-Encoding (smuggling shape)"),
    Reason("bad_content_length", "gateway", "deny", (400,), "Content-Length is not a number"),
    Reason("bad_transfer_encoding", "gateway", "deny", (400,), "Transfer-Encoding other than one 'chunked'"),
    Reason("duplicate_host", "gateway", "deny", (400,), "more than one Host header"),
    Reason("host_missing", "gateway", "deny", (400,), "transparent plain HTTP without a Host header"),
    Reason("authority_mismatch", "gateway", "deny", (421,),
           "the request names another host or port than its connection's (fronting, coalescing)"),
    Reason("bad_method_override", "gateway", "deny", (400,),
           "a method override header or `_method` parameter that is not one HTTP method"),
    Reason("ambiguous_method_override", "gateway", "deny", (400,),
           "the request names two different override methods (which one a server takes is its own choice)"),
    Reason("trailers_refused", "gateway", "deny", (400,), "HTTP/1 request trailers (mitmproxy cannot relay them)"),
    Reason("invalid_request", "gateway", "deny", (400,),
           "fast plain-HTTP path: llhttp refused the request (bad chunk size, token, version, ...)"),
    Reason("bad_connection_header", "gateway", "deny", (400,),
           "Connection names a framing header (Content-Length, Transfer-Encoding, Host, Trailer)"),
    Reason("pipelined_request_refused", "gateway", "deny", (400,),
           "a request that needs interception arrived pipelined behind another: its raw bytes are not known"),
    Reason("sni_changed_on_retry", "gateway", "deny", (),
           "passthrough TLS: the ClientHello after a HelloRetryRequest names another server (or one unread)"),
    Reason("tls_handshake_unreadable", "gateway", "deny", (),
           "passthrough TLS: the first hello or the server's first record cannot be framed, or the second hello read"),
    Reason("tls_handshake_held_too_long", "gateway", "deny", (),
           "passthrough TLS: over 64 KiB from the client before the server's first handshake message"),
    Reason("upstream_invalid_response", "gateway", "deny", (502,),
           "fast plain-HTTP path: the upstream's response cannot be framed one way (cut, bad chunk, huge head, 101)"),
    # ---- gateway: credentials and bodies
    Reason("vault_sealed", "gateway", "deny", (503,), "the vault is sealed: bound or checked requests are refused"),
    Reason("vault_error", "gateway", "deny", (503,), "a vault lookup failed (fail closed)"),
    Reason("binding_ambiguous", "gateway", "deny", (503,), "more than one credential binding matches the request"),
    Reason("plaintext_injection_refused", "gateway", "deny", (403,), "a binding would inject a credential over plain HTTP"),
    Reason("method_override_binding", "gateway", "deny", (403,),
           "a request bound to a credential names an override method the same binding does not cover"),
    Reason("credential_leak", "gateway", "deny", (403,),
           "the request carries a secret or placeholder to a host it is not bound to"),
    Reason("body_too_large", "gateway", "deny", (413, 502), "a body to inspect decodes past max_body_bytes (or a bomb)"),
    Reason("body_uninspectable", "gateway", "deny", (413,), "a request body's encoded form yields too little to check"),
    Reason("request_undecodable", "gateway", "deny", (400, 415), "a request body to inspect cannot be decoded"),
    Reason("response_undecodable", "gateway", "deny", (502,), "a response to scrub cannot be decoded"),
    Reason("response_unscrubbable", "gateway", "deny", (502,),
           "a response carries the injected credential in a form that cannot be removed"),
    Reason("inspection_failed", "gateway", "deny", (502,), "a body check failed unexpectedly (fail closed)"),
    Reason("range_on_injected_flow", "gateway", "deny", (502,), "a partial (206) response on a flow that carried a credential"),
    Reason("refused_body_too_large", "gateway", "deny", (),
           "a refused request's body went past its allowance: the connection is closed"),
    Reason("websocket_message_too_large", "gateway", "deny", (),
           "a WebSocket message past max_buffered_bytes_per_sandbox: the connection is closed (1009)"),
    # ---- gateway: upstream
    Reason("unresolvable", "gateway", "deny", (502,), "the destination name does not resolve"),
    Reason("upstream_blocked", "gateway", "deny", (502,), "mitmproxy's upstream address was refused by the guard"),
    Reason("upstream_connect_failed", "gateway", "deny", (502,), "no TCP connection to the upstream"),
    Reason("upstream_connect_timeout", "gateway", "deny", (502,), "no TCP connection to the upstream within connect_timeout"),
    Reason("upstream_timeout", "gateway", "deny", (502,), "no response head from the upstream within upstream_timeout"),

    # ---- ssrf: egress/netguard.py's AddressGuard, written as ssrf_<reason>
    Reason("ssrf_unspecified", "ssrf", "deny", (403,), "the address is unspecified (0.0.0.0/8, ::)"),
    Reason("ssrf_loopback", "ssrf", "deny", (403,), "the address is loopback"),
    Reason("ssrf_private", "ssrf", "deny", (403,), "the address is RFC 1918 private"),
    Reason("ssrf_link_local", "ssrf", "deny", (403,), "the address is link-local (cloud metadata)"),
    Reason("ssrf_cgnat", "ssrf", "deny", (403,), "the address is carrier-grade NAT (100.64.0.0/10)"),
    Reason("ssrf_documentation", "ssrf", "deny", (403,), "the address is a documentation range"),
    Reason("ssrf_benchmarking", "ssrf", "deny", (403,), "the address is a benchmarking range"),
    Reason("ssrf_multicast", "ssrf", "deny", (403,), "the address is multicast"),
    Reason("ssrf_broadcast", "ssrf", "deny", (403,), "the address is the limited broadcast"),
    Reason("ssrf_reserved", "ssrf", "deny", (403,), "the address is reserved (or IPv6 outside 2000::/3)"),
    Reason("ssrf_unique_local", "ssrf", "deny", (403,), "the address is IPv6 unique-local"),
    Reason("ssrf_ipv4_mapped", "ssrf", "deny", (403,), "an IPv4-mapped IPv6 form"),
    Reason("ssrf_ipv4_translated", "ssrf", "deny", (403,), "an IPv4-translated IPv6 form"),
    Reason("ssrf_nat64", "ssrf", "deny", (403,), "a NAT64 form of a refused IPv4 address"),
    Reason("ssrf_own_listener", "ssrf", "deny", (403,), "the gateway's own listener (a proxy loop)"),
    Reason("ssrf_denied_cidr", "ssrf", "deny", (403,), "an operator-denied range (upstream.deny_cidrs)"),
    Reason("ssrf_blocked", "ssrf", "deny", (403,), "every address of the name was refused (no single reason)"),

    # ---- dns: the sandbox resolver (cubegate/sandbox_dns.py)
    Reason("dns_allowed", "dns", "allow", (), "allowed names answered in one interval (aggregated record)"),
    Reason("dns_not_allowed", "dns", "deny", (), "NXDOMAIN: the sandbox's policy allows no request to the name"),
    Reason("dns_name_rate_limited", "dns", "deny", (),
           "NXDOMAIN: too many new names under one wildcard per minute"),
    Reason("dns_limiter_full", "dns", "deny", (), "NXDOMAIN: the new-name limiter's table is full"),
    Reason("dns_denials_counted", "dns", "deny", (),
           "refusals past a sandbox's per-interval share, counted in one record"),
    Reason("dns_audit_overflow", "dns", "deny", (), "queries beyond the aggregated names cap, counted in one record"),

    # ---- switch: L3/L4 verdicts of cubevs/bpf/switch.c (enum reason) and the nftables backend
    Reason("unknown_sandbox", "switch", "deny", (), "drop: the interface has no sandbox entry (fail closed)"),
    Reason("gateway", "switch", "allow", (), "TCP to the gateway's address and port"),
    Reason("dns", "switch", "allow", (), "DNS to the gateway's resolver"),
    Reason("web", "switch", "allow", (), "TCP 80/443 to the outside (steered to the gateway)"),
    Reason("l4_allow", "switch", "allow", (), "an L4 port the policy lists"),
    Reason("arp", "switch", "allow", (), "valid ARP from the sandbox"),
    Reason("spoof_ip", "switch", "deny", (), "drop: source IP is not the sandbox's"),
    Reason("spoof_mac", "switch", "deny", (), "drop: source MAC is not the sandbox's"),
    Reason("arp_spoof", "switch", "deny", (), "drop: ARP claiming another address"),
    Reason("ipv6", "switch", "deny", (), "drop: IPv6"),
    Reason("sandbox_to_sandbox", "switch", "deny", (), "drop: to another sandbox"),
    Reason("host_service", "switch", "deny", (),
           "drop: to a host service other than the gateway and DNS (also an L4-allowed destination the hub "
           "routes to itself: any of its addresses, a broadcast)"),
    Reason("quic", "switch", "deny", (), "drop: UDP 443"),
    Reason("foreign_dns", "switch", "deny", (), "drop: DNS to a resolver other than ours"),
    Reason("port_not_allowed", "switch", "deny", (), "drop: a port neither steered nor listed"),
    Reason("fragment", "switch", "deny", (), "drop: an IP fragment"),
    Reason("malformed", "switch", "deny", (), "drop: a packet too short or malformed"),
    Reason("ethertype", "switch", "deny", (), "drop: an ethertype other than IPv4/ARP"),

    # ---- netwatch: the gateway's net_drop records
    Reason("unknown", "netwatch", "deny", (), "a switch drop event without a reason"),
)

REASONS: Mapping[str, Reason] = MappingProxyType({r.name: r for r in _ALL})
assert len(REASONS) == len(_ALL), "a reason is listed twice"


def of_layer(layer: str) -> frozenset[str]:
    return frozenset(name for name, r in REASONS.items() if r.layer == layer)


def markdown_table() -> str:
    """The README's reason table, by layer then in listed order."""
    rows = ["| reason | layer | outcome | HTTP status | meaning |", "|---|---|---|---|---|"]
    for layer in LAYERS:
        for r in _ALL:
            if r.layer == layer:
                status = " / ".join(map(str, r.status)) or "—"
                rows.append(f"| `{r.name}` | {r.layer} | {r.outcome} | {status} | {r.meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
