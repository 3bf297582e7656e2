"""What is keyed by a sandbox id goes with the sandbox (attack pass 2, finding 2), and
approving an access request never answers 500 nor leaves state half-changed (finding 6).

Real components (policy store, access store, denial ring, the cubegate.internal endpoint,
the policy API on loopback) composed as the daemon composes them; no network namespace."""
from __future__ import annotations

import asyncio
import json
import threading
import types

import httpx
import pytest

from cubegate.access_store import AccessStore
from cubegate.admin_tokens import AdminTokens, ensure_token_file
from cubegate.agent_endpoint import AgentEndpoint
from cubegate.denials import DenialRing
from cubegate.dns_accounting import NewNameLimiter
from cubegate.runtime_hooks import DaemonHooks
from egress.identity import Identity, IdentityStore
from egress.policy import RequestInfo
from egress.policy.live import LivePolicies
from egress.policy.reload import PolicyStore
from egress.policy.repo import PolicyRepo

POLICY = """\
name: acme
tenant: acme
applies_to: {labels: {tenant: acme}}
default: deny
rules:
  - {name: web, action: allow, match: {hosts: [api.allowed.test], ports: [443]}}
"""


class _Loop:
    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


@pytest.fixture
def daemon(tmp_path):
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "acme.yaml").write_text(POLICY)
    d = types.SimpleNamespace()
    d.policy_repo = PolicyRepo(tmp_path / "policies.db")
    d.policies = LivePolicies(PolicyStore(tmp_path / "policies"), d.policy_repo)
    d.identities = IdentityStore(tmp_path / "identities.db")
    d.access = AccessStore(tmp_path / "access.db")
    d.denials = DenialRing()
    d.agent_endpoint = AgentEndpoint(denials=d.denials, access=d.access, notify=lambda r: None,
                                     requests_per_minute=2, max_pending=10, max_reason_chars=200)
    d._dns = types.SimpleNamespace(limiter=NewNameLimiter(5))
    d._loop = _Loop()
    ensure_token_file(tmp_path / "admin.token")
    d.token = (tmp_path / "admin.token").read_text().strip()
    from cubegate import policy_api
    loop, started = asyncio.new_event_loop(), threading.Event()

    def run():   # the policy API on loopback, in its own thread and event loop (as in the daemon)
        asyncio.set_event_loop(loop)

        async def start():
            d.api = policy_api.serve(d.policies, d.access, AdminTokens(tmp_path / "admin.token"), port=0)
            started.set()
        loop.run_until_complete(start())
        loop.run_forever()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10)
    d.hooks = DaemonHooks(d)
    yield d
    loop.call_soon_threadsafe(d.api.stop)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)
    d.access.close()
    d.policy_repo.close()


def admin(d, method, path, **kw):
    r = httpx.request(method, f"http://127.0.0.1:{d.api.port}/v1{path}", headers={"Authorization": f"Bearer {d.token}"},
                      timeout=10, trust_env=False, **kw)
    return r.status_code, r.json() if r.content else None


def file_request(d, sid, host, port=443, labels=None):
    ident = Identity(sid, labels or {"tenant": "acme"})
    code, doc = d.agent_endpoint.answer(ident, "POST", "/v1/access-requests",
                                        json.dumps({"host": host, "port": port, "reason": "private note"}).encode())
    assert code == 201, doc
    return doc["request"]["id"]


def decide(d, sid, host, port=443, labels=None):
    return d.policies.current.decide(RequestInfo(sid, labels or {"tenant": "acme"}, host, port,
                                                 is_ip_literal=host[0].isdigit()))


def test_destroying_a_sandbox_takes_its_grants_requests_and_counters_with_it(daemon):
    d = daemon
    d.hooks.register("sb-1", "acme", {"tenant": "acme"})
    d.hooks.register("sb-2", "acme", {"tenant": "acme"})
    d.hooks.set_network("sb-1", {"deny": ["x.test"]}, actor="t")
    own = file_request(d, "sb-1", "new.test")
    shared = file_request(d, "sb-1", "shared.test")
    assert admin(d, "POST", f"/access-requests/{own}/approve", json={"scope": "sandbox"})[0] == 200
    assert admin(d, "POST", f"/access-requests/{shared}/approve", json={"scope": "tenant"})[0] == 200
    # a grant that names this sandbox and another one (edited through the store)
    g = d.policies.grants()[f"grant.{own}"].to_doc()
    g["applies_to"]["sandboxes"] = ["sb-1", "sb-2"]
    d.policies.put_grant("grant.both", {k: v for k, v in g.items() if k != "request"}, actor="t")
    d.denials.observe({"sandbox": "sb-1", "decision": "deny", "event": "decision", "host": "denied.test"})
    d._dns.limiter.admit("sb-1", "*.x.test", "a.x.test", 0.0)
    assert decide(d, "sb-1", "new.test").reason == "grant_allow"
    assert d.agent_endpoint.answer(Identity("sb-1", {"tenant": "acme"}), "POST", "/v1/access-requests",
                                   b'{"host": "third.test"}')[0] == 429     # the filing budget (2/minute) is used

    d.hooks.forget("sb-1")

    grants = d.policies.grants()
    assert f"grant.{own}" not in grants                               # scoped to the id: gone
    assert grants["grant.both"].sandboxes == frozenset({"sb-2"})      # names another sandbox: keeps that one
    assert f"grant.{shared}" in grants                                # tenant-wide: not the sandbox's
    assert d.access.list(sandbox="sb-1") == [] and d.denials.recent("sb-1") == []
    assert d.policies.network("sb-1") is None and d._dns.limiter.keys == 0
    # the next sandbox of that id, in another tenant: nothing of the first one
    d.hooks.register("sb-1", "beta", {"tenant": "beta"})
    assert decide(d, "sb-1", "new.test", labels={"tenant": "beta"}).reason == "no_policy"
    assert d.agent_endpoint.answer(Identity("sb-1", {"tenant": "beta"}), "GET", "/v1/access-requests", b"")[1][
        "requests"] == []
    assert d.agent_endpoint.answer(Identity("sb-1", {"tenant": "beta"}), "POST", "/v1/access-requests",
                                   b'{"host": "again.test"}')[0] == 201      # a fresh filing budget
    assert decide(d, "sb-2", "new.test").reason == "grant_allow"


def test_register_drops_what_an_earlier_sandbox_of_the_id_left(daemon):
    """State written before the destroy hook existed (or by a crash between the steps)."""
    d = daemon
    d.policies.put_grant("grant.old", {"applies_to": {"sandboxes": ["sb-9"]}, "hosts": ["new.test"]}, actor="t")
    d.access.file("sb-9", {"tenant": "acme"}, "new.test", 443, "old")
    d.hooks.register("sb-9", "acme", {"tenant": "acme"})
    assert "grant.old" not in d.policies.grants() and d.access.list(sandbox="sb-9") == []


def test_listeners_hear_of_every_sandbox_that_goes(daemon):
    gone = []
    daemon.hooks.on_forget(gone.append)
    daemon.hooks.register("sb-3", "acme", {"tenant": "acme"})
    daemon.hooks.forget("sb-3")
    assert gone == ["sb-3", "sb-3"]     # register (stale state of the id), then the destroy


@pytest.mark.parametrize("host,cidr", [("198.18.0.19", "198.18.0.19/32"), ("[::ffff:198.18.0.19]", "198.18.0.19/32"),
                                       ("[2001:db8::5]", "2001:db8::5/128")])
def test_approving_an_ip_literal_grants_its_own_address(daemon, host, cidr):
    d = daemon
    d.hooks.register("sb-ip", "acme", {"tenant": "acme"})
    rid = file_request(d, "sb-ip", host)
    status, done = admin(d, "POST", f"/access-requests/{rid}/approve", json={"scope": "sandbox"})
    assert status == 200 and done["state"] == "approved", (status, done)
    grant = d.policies.grants()[done["grant"]]
    assert [str(c) for c in grant.cidrs] == [cidr] and grant.hosts == ()
    addr = cidr.split("/")[0]
    assert decide(d, "sb-ip", addr).reason == "grant_allow"
    assert not decide(d, "sb-ip", "198.18.0.18").allowed


def test_an_approval_that_cannot_be_granted_is_4xx_and_changes_nothing(daemon):
    d = daemon
    d.hooks.register("sb-x", "acme", {})
    rid = d.access.file("sb-x", {}, "new.test", 443, "no labels")["id"]
    status, doc = admin(d, "POST", f"/access-requests/{rid}/approve", json={"scope": "labels"})
    assert status == 400, doc
    assert d.access.get(rid)["state"] == "pending" and d.policies.grants() == {}


def test_an_approval_racing_the_sandbox_destroy_leaves_no_grant(daemon):
    """The request is removed (sandbox destroyed) between the read and the decide: 409, no grant."""
    d = daemon
    d.hooks.register("sb-r", "acme", {"tenant": "acme"})
    rid = file_request(d, "sb-r", "new.test")
    real_decide = d.access.decide

    def destroyed_meanwhile(*a, **kw):
        d.hooks.forget("sb-r")
        return real_decide(*a, **kw)
    d.access.decide = destroyed_meanwhile
    status, doc = admin(d, "POST", f"/access-requests/{rid}/approve", json={"scope": "sandbox"})
    assert status == 409, doc
    assert d.policies.grants() == {}
