"""The fast path's memo of policy denials at CONNECT answers exactly what deciding again would.

Property: over any sequence of CONNECT decisions (hosts in many spellings, ports, identities
equal by value but distinct objects, re-labelled identities), policy swaps and a clock moving
past grants' expiry instants, DenyMemo.decide gives the same verdict and sets the same
connection state as decide_destination without any cache, decided at that moment.
"""
from __future__ import annotations

import asyncio
import json
import os

from dnslib.server import DNSServer
from hypothesis import given, settings, strategies as st_

from egress import netguard, records
from egress.conn_state import ConnState
from egress.destination import DecisionCache, decide_destination
from egress.fastpath import heads
from egress.fastpath.deny_memo import DenyMemo
from egress.identity import Identity
from egress.policy import load_policy_files
from egress.policy.effective import EffectivePolicy
from egress.policy.grants import GrantIndex, parse_grant
from testbed.dnsserver import ZoneResolver, _QuietLogger

POLICY_A = """\
name: base
default: deny
rules:
  - {name: api, action: allow, match: {hosts: [api.x.test], ports: [443]}}
  - {name: bad, action: deny, match: {hosts: ["*.bad.test"]}}
"""
POLICY_B = """\
name: base
default: deny
rules:
  - {name: bad, action: deny, match: {hosts: ["*.bad.test", "api.x.test"]}}
"""
TEAM = """\
name: team
applies_to: {labels: {team: a}}
default: deny
rules:
  - {name: gh, action: allow, match: {hosts: ["*.gh.test"]}}
"""
HOSTS = ["api.x.test", "API.X.Test.", "a.gh.test", "A.GH.TEST", "x.bad.test", "new.test", "other.test",
         "old.test", "cubegate.internal", "93.184.216.34", "127.0.0.1", "0x7f.1", "[::1]", "xn--bcher-kva.test",
         "bad..name", "-x.test"]
IDENTITIES = [Identity("sb-1", {}), Identity("sb-1", {}), Identity("sb-1", {"team": "a"}),
              Identity("sb-2", {"team": "a"}), Identity("sb-2", {"team": "b"})]


class _Policies:            # what decide_destination reads of LivePolicies: the policy in force
    current = None


def _policy(tmp_path, texts, name, clock):
    paths = []
    for i, text in enumerate(texts):
        paths.append(tmp_path / f"{name}{i}.yaml")
        paths[-1].write_text(text)
    grants = GrantIndex([parse_grant("soon", {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"],
                                              "expires": 110.0}),
                         parse_grant("later", {"applies_to": {"labels": {"team": "a"}}, "hosts": ["other.test"],
                                               "expires": 200.0})])
    return EffectivePolicy(load_policy_files(paths), grants, clock=clock)


def _state() -> ConnState:
    return ConnState(conn_id="c", client="10.0.0.2:5000", started=0.0)


step = st_.one_of(
    st_.tuples(st_.just("connect"), st_.sampled_from(HOSTS), st_.sampled_from([443, 80, 8443]),
               st_.integers(0, len(IDENTITIES) - 1)),
    st_.tuples(st_.just("clock"), st_.floats(0.0, 60.0)),
    st_.tuples(st_.just("swap"), st_.integers(0, 1)),
)


@settings(max_examples=60, deadline=None)
@given(steps=st_.lists(step, min_size=1, max_size=40))
def test_the_memo_answers_what_deciding_again_answers(tmp_path_factory, steps):
    tmp = tmp_path_factory.mktemp("memo")
    now = [95.0]
    clock = lambda: now[0]                                   # noqa: E731
    policies_ab = [_policy(tmp, [POLICY_A], "a", clock), _policy(tmp, [POLICY_B, TEAM], "b", clock)]
    live = _Policies()
    live.current = policies_ab[0]
    guard = netguard.AddressGuard()
    # allowed names are resolved: a resolver that answers nothing (no server on the discard port), fast
    resolver = netguard.GuardedResolver(guard, nameservers=["127.0.0.1:9"], timeout=0.05)
    memo = DenyMemo(DecisionCache())
    remembered = 0

    async def run():
        nonlocal remembered
        for s in steps:
            if s[0] == "clock":
                now[0] += s[1]                               # forward only, past expiry instants too
                continue
            if s[0] == "swap":
                live.current = policies_ab[s[1]]
                continue
            _, host, port, i = s
            ident = IDENTITIES[i]
            for _attempt in range(2):                        # the second one may be answered from the memo
                got_st, want_st = _state(), _state()
                got_st.identity = want_st.identity = ident
                got, denied = await memo.decide(got_st, host, port, policies=live, guard=guard, resolver=resolver)
                want = await decide_destination(want_st, host, port, policies=live, guard=guard, resolver=resolver,
                                                scheme=None, method=None, path=None)
                assert got == want
                assert (got_st.host, got_st.port, got_st.ip_literal) == (want_st.host, want_st.port, want_st.ip_literal)
                if denied is not None:
                    remembered += 1
                    assert want.refusal is None and want.decision.action == "deny"
                    assert denied.refusal == records.policy_refusal(want.decision)
                    fields = records.decision_fields(want.decision)
                    del fields["decision"], fields["reason"]
                    assert denied.fields == fields
                    assert denied.page == heads.refusal_response(denied.refusal.status, denied.refusal.reason,
                                                                 denied.refusal.detail, st=want_st,
                                                                 decision=want.decision)

    asyncio.run(run())


def test_a_denial_is_remembered_and_forgotten_at_a_grant_expiry(tmp_path):
    now = [100.0]
    live = _Policies()
    live.current = _policy(tmp_path, [POLICY_A], "a", lambda: now[0])
    guard = netguard.AddressGuard()
    resolver = netguard.GuardedResolver(guard, nameservers=["127.0.0.1:9"], timeout=0.05)
    memo = DenyMemo(DecisionCache())
    ident = IDENTITIES[0]

    async def decide(host):
        s = _state()
        s.identity = ident
        return await memo.decide(s, host, 443, policies=live, guard=guard, resolver=resolver)

    async def run():
        v, d = await decide("x.bad.test")
        assert v.decision.reason != "grant_allow" and d is not None
        assert memo.lookup(live.current, ident, "x.bad.test", 443) is d          # remembered
        assert memo.lookup(live.current, IDENTITIES[1], "x.bad.test", 443) is None   # another object: not
        now[0] = 110.0                                        # a grant's expiry: a new generation
        assert memo.lookup(live.current, ident, "x.bad.test", 443) is None
        v, d = await decide("new.test")                       # the grant expired: denied now
        assert v.decision.action == "deny" and d is not None

    asyncio.run(run())


RESOLVED = """\
name: base
default: deny
global: {denied_cidrs: [198.18.0.12/32]}
rules:
  - {name: cdn, action: allow, match: {hosts: [cdn.x.test], ports: [443]}}
"""


def test_a_denial_of_the_address_a_name_resolved_to_is_not_remembered(tmp_path):
    """A deny CIDR covering every answer of an allowed name is the resolve's, not the policy's
    about the name: once the name resolves elsewhere, the next CONNECT is allowed (as the full
    decision, and the mitmproxy path, answer), not refused from the memo until the next policy."""
    zone = tmp_path / "zone.json"

    def answer(ip):
        tmp = tmp_path / "zone.tmp"
        tmp.write_text(json.dumps({"cdn.x.test": {"addrs": [ip], "ttl": 0}}))
        os.replace(tmp, zone)                                 # a new inode: the server reloads it
    answer("198.18.0.12")
    server = DNSServer(ZoneResolver(str(zone)), address="127.0.0.1", port=0, logger=_QuietLogger())
    server.start_thread()
    try:
        live = _Policies()
        live.current = _policy(tmp_path, [RESOLVED], "r", lambda: 100.0)
        guard = netguard.AddressGuard(allow_cidrs=["198.18.0.0/24"])
        resolver = netguard.GuardedResolver(guard, nameservers=[f"127.0.0.1:{server.server.server_address[1]}"],
                                            timeout=2.0)
        memo = DenyMemo(DecisionCache())
        ident = IDENTITIES[0]

        async def decide():
            s = _state()
            s.identity = ident
            return await memo.decide(s, "cdn.x.test", 443, policies=live, guard=guard, resolver=resolver)

        async def run():
            v, _ = await decide()
            assert (v.decision.action, v.decision.reason) == ("deny", "resolved_global_deny")
            answer("198.18.0.10")                             # the name moved out of the denied range
            v, d = await decide()
            assert d is None and v.decision.action == "allow" and v.addresses == ((2, "198.18.0.10"),)

        asyncio.run(run())
    finally:
        server.stop()
        server.server.server_close()
