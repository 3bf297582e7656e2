"""Policy denials at CONNECT, remembered: a sandbox retrying a denied host is answered without
deciding again (no host normalised, no request built, no refusal made).

Exact, never stale: an entry is the verdict decide_destination gave for the same raw host, port
and Identity object (the identity store hands out a new object when an identity changes), made
within one generation of the fast path's DecisionCache (a new policy object, or a grant's expiry
reached, starts a new one and this memo empties). Only policy denials of names are kept: they
need no I/O (no resolve), and the SSRF guard's refusals of IP literals are not the policy's to
answer. tests/gateway/test_deny_memo.py checks the memo against the full decision.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from egress import records
from egress.conn_state import ConnState
from egress.destination import DecisionCache, Verdict, decide_destination
from egress.fastpath import heads
from egress.http_checks import Refusal
from egress.identity import Identity
from egress.policy import Decision


@dataclass(frozen=True)
class Denied:
    identity: Identity        # held: the key's id() names this object while the entry lives
    host: str                 # normalised
    decision: Decision
    refusal: Refusal          # records.policy_refusal(decision)
    fields: dict[str, Any]    # records.decision_fields(decision) without decision and reason (read only)
    page: bytes               # the refusal page (heads.refusal_response: it names the host, port, rule, policy)


class DenyMemo:
    MAX_ENTRIES = 4096        # bounded: emptied whole when full

    def __init__(self, decisions: DecisionCache) -> None:
        self.decisions = decisions
        self._generation = -1
        self._entries: dict[tuple[str, int, int], Denied] = {}

    def lookup(self, policy, identity: Identity, raw_host: str, port: int) -> Denied | None:
        generation = self.decisions.generation_for(policy)
        if generation != self._generation:
            self._generation, self._entries = generation, {}
            return None
        hit = self._entries.get((raw_host, port, id(identity)))
        return hit if hit is not None and hit.identity is identity else None

    async def decide(self, st: ConnState, raw_host: str, port: int, *, policies, guard, resolver
                     ) -> tuple[Verdict, Denied | None]:
        """decide_destination at CONNECT (connection stage, the DecisionCache's), with its policy
        denials remembered; the Denied entry when the verdict is one (st set as decide_destination
        sets it)."""
        identity = st.identity
        hit = self.lookup(policies.current, identity, raw_host, port)
        if hit is not None:
            st.host, st.port, st.ip_literal = hit.host, port, False
            return Verdict(hit.decision, None), hit
        generation = self.decisions.generation_for(policies.current)
        verdict = await decide_destination(st, raw_host, port, policies=policies, guard=guard, resolver=resolver,
                                           scheme=None, method=None, path=None, cache=self.decisions)
        decision = verdict.decision
        if (verdict.refusal is not None or decision is None or decision.action == "allow" or st.ip_literal
                or verdict.resolved):    # a deny of what the name resolved to: the next answer may differ
            return verdict, None
        if self.decisions.generation_for(policies.current) != generation or generation != self._generation:
            return verdict, None         # decided across a change: not remembered
        fields = records.decision_fields(decision)
        del fields["decision"], fields["reason"]      # the refusal's own
        refusal = records.policy_refusal(decision)
        page = heads.refusal_response(refusal.status, refusal.reason, refusal.detail, st=st, decision=decision)
        entry = Denied(identity, st.host, decision, refusal, fields, page)
        if len(self._entries) >= self.MAX_ENTRIES:
            self._entries = {}
        self._entries[(raw_host, port, id(identity))] = entry
        return verdict, entry
