"""Attack pass 2 on #13 (cubegate.internal, per-sandbox network options, grants, revocation):
the real daemon in transparent mode, namespace sandboxes on the cubevs switch, code inside
them playing the attacker. Each test asserts the secure behaviour.
"""
from __future__ import annotations

import ipaddress
import json
import time

import pytest

from tests.gateway.switchlab import HUB_IP
from tests.sandbox_runtime.daemonlab import policy_call as admin
from tests.sandbox_runtime.daemonlab import runtime_call as runtime
from tests.sandbox_runtime.daemonlab import sandbox_create as create
from tests.sandbox_runtime.daemonlab import sandbox_https as https
from tests.sandbox_runtime.daemonlab import sandbox_internal as internal
from tests.sandbox_runtime.daemonlab import sandbox_sh as sh
from tests.sandbox_runtime.daemonlab import runtime_daemon

TPORT, API_PORT, POLICY_PORT = 18374, 18373, 18375
L4_NET, L4_PORT = "198.18.0.20/32", 5432
POLICY = f"""\
name: acme
tenant: acme
applies_to: {{labels: {{tenant: acme}}}}
default: deny
rules:
  - name: web
    action: allow
    match: {{hosts: [api.allowed.test], ports: [443, 80]}}
  - name: db
    action: allow
    match: {{cidrs: [{L4_NET}], ports: [{L4_PORT}]}}
"""


# ---------------------------------------------------------------- pure (no lab)

def test_network_deny_entry_written_as_ipv4_mapped_ipv6_still_denies_the_ipv4_address():
    """Requests are normalised to IPv4 (::ffff:a.b.c.d → a.b.c.d, egress.policy.hosts.parse_ip);
    a deny entry in the mapped spelling must deny the same address, else the narrowing is
    silently void (fail open). Either it matches, or it is refused when the options are set."""
    from egress.policy import PolicyError
    from egress.policy.network import parse_network

    try:
        net = parse_network({"deny": ["[::ffff:198.18.0.10]", "[::ffff:198.18.0.0/120]:443"]})
    except PolicyError:
        return   # refused at set time: acceptable
    addr = ipaddress.ip_address("198.18.0.10")
    assert net.verdict("198.18.0.10", addr, 443) is not None, "mapped deny entry does not deny the IPv4 address"


# ---------------------------------------------------------------- the lab



@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attack2")
    settings = {"dns": {"listen_host": HUB_IP, "port": 53},
                "runtime": {"enabled": True, "api_port": API_PORT, "memory_mb": 1024, "cpus": 1.0,
                            "max_sandboxes": 6, "host_reserve_mb": 256},
                "policy_api": {"port": POLICY_PORT},
                "access": {"grant_sweep_seconds": 0.5, "requests_per_minute": 30}}
    with runtime_daemon(lab, tmp, POLICY, tport=TPORT, prefix="a2", settings=settings) as (gw, sw):
        gw.sw = sw
        yield gw


def destroy(lab, gw, sid: str) -> None:
    runtime(lab, gw, "DELETE", f"/sandboxes/{sid}")


@pytest.mark.netns
def test_sandbox_network_options_also_narrow_the_switch_l4_allow_list(env, lab):
    """FINDING: the admin policy's `cidrs` allow rule is pushed into the switch as a direct
    L4 path (cubegate/l4sync.py), and that translation ignores the sandbox's network
    options. A sandbox created with `network: {allow: [api.allowed.test:443]}` (or a deny
    of the CIDR) can still open TCP straight to 198.18.0.20:5432 through the switch,
    past the gateway. Narrowing must apply to every path out."""
    gw = env
    create(lab, gw, "a2-l4-open")
    create(lab, gw, "a2-l4-allow", network={"allow": ["api.allowed.test:443"]})
    create(lab, gw, "a2-l4-deny", network={"deny": [L4_NET]})
    rule = (L4_NET, L4_PORT, "tcp")
    try:
        def l4(sid):
            return [tuple(r) for e in gw.sw.registry.all() if e.sandbox_id == sid for r in e.l4_allow]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and rule not in l4("a2-l4-open"):
            time.sleep(0.3)
        assert rule in l4("a2-l4-open")          # the control: the rule reaches the switch
        time.sleep(1.5)                          # a netwatch sync round or more
        # what the sandbox's own code sees: a SYN to the CIDR passes the switch as l4_allow
        probe = ("python3 -c \"import socket; s=socket.socket(); s.settimeout(1.5)\n"
                 f"try: s.connect(('198.18.0.20', {L4_PORT}))\nexcept OSError as e: print(type(e).__name__)\"")
        for sid in ("a2-l4-allow", "a2-l4-deny"):
            sh(lab, gw, sid, probe)
        passed = {sid: sum(p for (s, reason, verdict), (p, _) in gw.sw.counters(sid).items()
                           if s == sid and reason == "l4_allow")
                  for sid in ("a2-l4-allow", "a2-l4-deny")}
        assert rule not in l4("a2-l4-allow") and rule not in l4("a2-l4-deny") and not any(passed.values()), \
            {"l4_allow": {sid: l4(sid) for sid in ("a2-l4-allow", "a2-l4-deny")}, "packets_passed": passed}
    finally:
        for sid in ("a2-l4-open", "a2-l4-allow", "a2-l4-deny"):
            destroy(lab, gw, sid)


@pytest.mark.netns
def test_reused_sandbox_id_inherits_no_grant_and_no_access_requests(env, lab):
    """FINDING: a grant approved for scope `sandbox` names the sandbox id, and nothing removes
    it (nor the sandbox's access requests) when the sandbox is destroyed (runtime_hooks.forget
    drops identity, network options and denials only). Ids are chosen by the API caller:
    the next sandbox created with the same id, even in another tenant that no policy
    allows anything, gets the old grant (no_policy → grant_allow) and reads the old
    sandbox's requests and reason texts at cubegate.internal."""
    gw = env
    sid, host = "a2-reuse", "passthrough.allowed.test"
    create(lab, gw, sid)
    try:
        code, filed = internal(lab, gw, sid, "/v1/access-requests",
                               {"host": host, "port": 443, "reason": "private note of the first owner"})
        assert code == 201, filed
        status, done = admin(lab, gw, "POST", f"/access-requests/{filed['request']['id']}/approve",
                             json={"scope": "sandbox"})
        assert status == 200, done
        assert https(lab, gw, sid, host) == "200"
    finally:
        destroy(lab, gw, sid)
    create(lab, gw, sid, tenant="beta")       # a different owner, same id
    try:
        _, own = internal(lab, gw, sid, "/v1/access-requests")
        reached = https(lab, gw, sid, host)
        grants = admin(lab, gw, "GET", "/grants")[1]["grants"]
        assert own["requests"] == [] and reached != "200", \
            {"requests_seen_by_new_sandbox": own["requests"], "https_status": reached,
             "grants_still_naming_the_id": [g["name"] for g in grants
                                            if sid in g.get("applies_to", {}).get("sandboxes", [])]}
    finally:
        destroy(lab, gw, sid)
        for g in admin(lab, gw, "GET", "/grants")[1]["grants"]:
            admin(lab, gw, "DELETE", f"/grants/{g['name']}")


@pytest.mark.netns
def test_transparent_absolute_form_target_must_name_the_host_header(env, lab):
    """FINDING: in transparent plain HTTP the gate decides on the Host header only
    (PolicyGate._transparent_target) and forwards the request line unchanged. A request
    `GET http://denied.test/... HTTP/1.1` + `Host: api.allowed.test` reaches the allowed
    upstream with the absolute-form target naming a host the policy denies; RFC 9112 §3.2.2
    makes an origin (a CDN, a shared front end) ignore Host and route by that target:
    domain fronting past the policy. Explicit mode already refuses this mismatch
    (check_request_authority); transparent mode must refuse it too (or send origin-form)."""
    gw = env
    create(lab, gw, "a2-front")
    try:
        rc, out = sh(lab, gw, "a2-front",
                     "curl -s --max-time 8 -w '\\n%{http_code}' --request-target 'http://denied.test/a2-fronted' "
                     "-H 'Host: api.allowed.test' http://api.allowed.test/")
        body, _, code = out.rpartition("\n")
        assert code.isdigit(), out
        seen = json.loads(body) if code == "200" and body.startswith("{") else {}
        assert not (code == "200" and "denied.test" in seen.get("path", "")), \
            f"upstream got request-target {seen.get('path')!r} with Host {seen.get('host')!r}"
    finally:
        destroy(lab, gw, "a2-front")


@pytest.mark.netns
def test_approving_an_ip_literal_access_request_is_not_a_server_error(env, lab):
    """FINDING (low): a sandbox may file a request for an IP literal (normalize_host accepts
    it, and `ip_literal_not_allowed` is a grantable denial), but approving it builds a grant
    with the address in `hosts`, which the grant parser refuses: the admin gets a 500 and
    the request stays pending for ever. Approve must work (a /32 grant) or answer 4xx."""
    gw = env
    create(lab, gw, "a2-iplit")
    try:
        code, filed = internal(lab, gw, "a2-iplit", "/v1/access-requests",
                               {"host": "198.18.0.19", "port": 443, "reason": "ip"})
        if code == 400:
            return   # refused at filing: acceptable
        assert code == 201, filed
        status, doc = admin(lab, gw, "POST", f"/access-requests/{filed['request']['id']}/approve",
                            json={"scope": "sandbox"})
        assert status < 500, (status, doc)
    finally:
        destroy(lab, gw, "a2-iplit")
        for g in admin(lab, gw, "GET", "/grants")[1]["grants"]:
            admin(lab, gw, "DELETE", f"/grants/{g['name']}")


@pytest.mark.netns
def test_held_cubegate_internal_answers_only_the_caller_in_every_spelling(env, lab):
    """Held: Host spellings, explicit-proxy requests from inside, TLS to the name, chunked
    and oversized bodies, query/path tricks — always the caller's own identity or a refusal."""
    gw = env
    create(lab, gw, "a2-v1")
    create(lab, gw, "a2-v2")
    try:
        assert https(lab, gw, "a2-v2", "denied.test") != "200"           # v2 has a denial, v1 must never see it
        gw.wait_record(lambda r: r.get("sandbox") == "a2-v2" and r.get("host") == "denied.test")
        for host in ("CUBEGATE.INTERNAL.", "cubegate.internal:80", "cubegate.internal."):
            rc, out = sh(lab, gw, "a2-v1", f"curl -s --max-time 8 -H 'Host: {host}' "
                                           f"'http://cubegate.internal/v1/denials?sandbox=a2-v2'")
            doc = json.loads(out)
            assert doc["sandbox"] == "a2-v1" and "denied.test" not in out, (host, out)
        for path in ("/v1/denials/../access-requests", "//v1/denials", "/v1/denials%2f", "/V1/DENIALS"):
            rc, out = sh(lab, gw, "a2-v1", f"curl -s --path-as-is --max-time 8 'http://cubegate.internal{path}'")
            assert "denied.test" not in out and "a2-v2" not in out, (path, out)
        # TLS to the name, and a chunked / oversized body: refused
        assert https(lab, gw, "a2-v1", "cubegate.internal") == "000"
        rc, out = sh(lab, gw, "a2-v1", "curl -s -o /dev/null -w '%{http_code}' --max-time 8 -H 'Transfer-Encoding: "
                                       "chunked' --data-binary @/etc/hostname http://cubegate.internal/v1/access-requests")
        assert out == "413", out
        # HTTP/2 cleartext to the name (prior knowledge, and an h2c upgrade): the caller's identity or a refusal
        for flag in ("--http2-prior-knowledge", "--http2"):
            rc, out = sh(lab, gw, "a2-v1", f"curl -s --max-time 8 {flag} http://cubegate.internal/v1/denials")
            assert "denied.test" not in out and "a2-v2" not in out, (flag, out)
        # explicit-proxy form from inside the sandbox (the proxy port is reachable on the hub address)
        rc, out = sh(lab, gw, "a2-v1", f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 8 "
                                       f"-x http://a2-v2:x@{HUB_IP}:{gw.proxy_port} http://cubegate.internal/v1/denials")
        assert out in ("407", "000"), out
    finally:
        destroy(lab, gw, "a2-v1")
        destroy(lab, gw, "a2-v2")


KEEPALIVE_CLIENT = r"""
import http.client, os, ssl, sys, time
host = sys.argv[1]
ctx = ssl.create_default_context(cafile="/workspace/ca.pem")
c = http.client.HTTPSConnection(host, 443, timeout=5, context=ctx)
c.auto_open = 0
c.connect()
c.request("GET", "/first"); r = c.getresponse(); r.read()
print("first", r.status, flush=True)
while not os.path.exists("/tmp/go"):
    time.sleep(0.05)
try:
    c.request("GET", "/second"); r = c.getresponse(); r.read()
    print("second", r.status, flush=True)
except Exception as e:
    print("second-error", type(e).__name__, flush=True)
"""


@pytest.mark.netns
@pytest.mark.parametrize("how", ["grant_deleted", "grant_expired"])
def test_held_open_tunnel_allowed_by_a_grant_is_closed_when_the_grant_goes(env, lab, how):
    """Held: a keep-alive TLS tunnel opened under a grant is closed (policy_revoked) when the
    grant is deleted or expires; the next request on it does not reach the upstream."""
    gw, sid, host = env, f"a2-rv-{how[6:9]}", "passthrough.allowed.test"
    create(lab, gw, sid)
    try:
        code, filed = internal(lab, gw, sid, "/v1/access-requests", {"host": host, "port": 443, "reason": "t"})
        assert code == 201, filed
        body = {"scope": "sandbox"} | ({"expires_in_seconds": 3} if how == "grant_expired" else {})
        status, done = admin(lab, gw, "POST", f"/access-requests/{filed['request']['id']}/approve", json=body)
        assert status == 200, done
        sh(lab, gw, sid, f"cat > /tmp/ka.py <<'PY'\n{KEEPALIVE_CLIENT}\nPY\n"
                         f"nohup python3 /tmp/ka.py {host} > /tmp/ka.out 2>&1 &")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "first" not in sh(lab, gw, sid, "cat /tmp/ka.out")[1]:
            time.sleep(0.2)
        assert "first 200" in sh(lab, gw, sid, "cat /tmp/ka.out")[1]
        if how == "grant_deleted":
            assert admin(lab, gw, "DELETE", f"/grants/{done['grant']}")[0] == 200
        else:
            gw.wait_record(lambda r: r.get("sandbox") == sid and r.get("reason") == "policy_revoked", timeout=10)
        sh(lab, gw, sid, "touch /tmp/go")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "second" not in sh(lab, gw, sid, "cat /tmp/ka.out")[1]:
            time.sleep(0.2)
        out = sh(lab, gw, sid, "cat /tmp/ka.out")[1]
        assert "second-error" in out, out
    finally:
        destroy(lab, gw, sid)
        for g in admin(lab, gw, "GET", "/grants")[1]["grants"]:
            admin(lab, gw, "DELETE", f"/grants/{g['name']}")
