"""The policy in force: admin policies (files + API) + grants + per-sandbox narrowing. Pure.

Order of one decision (on top of PRECEDENCE.md):
  1. the admin policy set decides (invalid input, global deny, selection, rules);
  2. a grant that selects the sandbox and covers host:port turns a policy deny
     (rule, default, no policy, IP literal, report-mode would-deny) into allow
     (`grant_allow`); never an invalid_* or global_deny;
  3. the sandbox's network options, when it has any, may turn an allow into a
     deny (`sandbox_network_deny`, `sandbox_network_not_allowed`): they only narrow.
After resolution, `address_denial` refuses each address of an allowed name that a
global denied CIDR or a network-options deny address entry covers
(`resolved_global_deny`, `resolved_sandbox_network_deny`; egress.destination).
The SSRF guard runs after all of this in the gate, whatever was decided here.
Time: a grant past its expiry is not in force. The decisions take `now` (unix
seconds); left out, it is read from the injected clock, so the logic stays pure
and table-testable while a grant never outlives its expiry by a sweep interval.
Same duck type as CompiledPolicySet for the gate, the resolver and the runtime.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from .compiled import CompiledPolicySet
from .grants import GrantIndex
from .hosts import InvalidHost, deny_views, normalize_host_addr, parse_ip
from .model import ALLOW, DENY, Decision, RequestInfo
from .network import SandboxNetwork

FINAL_REASONS = frozenset({"invalid_host", "invalid_port", "invalid_path", "global_deny"})
GRANTABLE = frozenset({"rule_deny", "default_deny", "no_policy", "ip_literal_not_allowed"})


class EffectivePolicy:
    def __init__(self, base: CompiledPolicySet, grants: GrantIndex | None = None,
                 networks: Mapping[str, SandboxNetwork] | None = None, *, digest: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.base = base
        self.clock = clock
        self.grants = grants or GrantIndex(())
        self.networks = dict(networks or {})
        self.digest = digest if digest is not None else base.digest

    # -- what the rest reads of a CompiledPolicySet ---------------------------------
    @property
    def sources(self):
        return self.base.sources

    @property
    def policies(self):
        return self.base.policies

    @property
    def global_denied_domains(self):
        return self.base.global_denied_domains

    @property
    def global_denied_cidrs(self):
        return self.base.global_denied_cidrs

    def policy(self, name: str):
        return self.base.policy(name)

    def policy_for(self, sandbox_id: str, labels: Mapping[str, str]):
        return self.base.policy_for(sandbox_id, labels)

    def network_for(self, sandbox_id: str) -> SandboxNetwork | None:
        return self.networks.get(sandbox_id)

    # -- decisions --------------------------------------------------------------------
    def decide(self, req: RequestInfo, now: float | None = None) -> Decision:
        d = self.base.decide(req)
        if d.reason in FINAL_REASONS:
            return d
        net = self.networks.get(req.sandbox_id)
        if not self.grants and net is None:
            return d
        try:
            host, addr = normalize_host_addr(req.host)
        except InvalidHost:
            return d   # the base already said invalid_host
        if (d.action == DENY and d.reason in GRANTABLE) or d.would_deny:
            for g in self.grants.for_sandbox(req.sandbox_id, req.labels, self.clock() if now is None else now):
                if g.covers(host, addr, req.port):
                    d = Decision(ALLOW, "grant_allow", g.name, g.name, "enforce", False, False, d.tenant)
                    break
        if net is not None and d.action == ALLOW:
            narrowed = net.verdict(host, addr, req.port)
            if narrowed is not None:
                reason, entry = narrowed
                return Decision(DENY, reason, entry, f"network:{req.sandbox_id}", "enforce", False, False, d.tenant)
        return d

    def address_denial(self, sandbox_id: str, ip: str, port: int | None) -> tuple[str, str | None] | None:
        """For an address a name resolved to: (reason, entry) when a global denied CIDR or an address
        entry of the sandbox's network deny list covers it (a deny by CIDR holds whatever name led
        there), else None. Allow entries by CIDR never apply here: they allow IP literals only."""
        denial = self.base.address_denial(sandbox_id, ip, port)
        net = self.networks.get(sandbox_id)
        if denial is not None or net is None:
            return denial
        addr = parse_ip(ip)    # readable: the base refused an unreadable one
        for e in net.deny:
            if e.net is not None and any(e.matches("", view, port) for view in deny_views(addr)):
                reason = "resolved_sandbox_network_deny"
                return reason, e.text
        return None

    def name_may_resolve(self, sandbox_id: str, labels: Mapping[str, str], name: str,
                         now: float | None = None) -> bool:
        ok = self.base.name_may_resolve(sandbox_id, labels, name)
        if not ok and self.grants:
            try:
                host, addr = normalize_host_addr(name)
            except InvalidHost:
                return False
            if addr is None and not self.base._globally_denied(host, None):
                ok = any(g.names(host) for g in self.grants.for_sandbox(sandbox_id, labels,
                                                                       self.clock() if now is None else now))
        net = self.networks.get(sandbox_id)
        if ok and net is not None:
            try:
                host, _ = normalize_host_addr(name)
            except InvalidHost:
                return False
            ok = net.may_resolve(host)
        return ok

    def resolve_scope(self, sandbox_id: str, labels: Mapping[str, str], name: str,
                      now: float | None = None) -> str | None:
        if self.grants:
            try:
                host, addr = normalize_host_addr(name)
            except InvalidHost:
                host, addr = "", None
            for g in self.grants.for_sandbox(sandbox_id, labels, self.clock() if now is None else now):
                if addr is None and any(not p.wildcard and p.name == host for p in g.hosts):
                    return None   # an exact grant, like an exact host rule, is not rate limited
        return self.base.resolve_scope(sandbox_id, labels, name)

    def hosts_allowed(self, sandbox_id: str, labels: Mapping[str, str]) -> Callable[[str], bool]:
        labels = dict(labels)
        return lambda name: self.name_may_resolve(sandbox_id, labels, name)

    def expired_grants(self, now: float | None = None) -> tuple[str, ...]:
        """Names of the grants past their expiry (not yet swept): a key for caches of decisions."""
        return self.grants.expired(self.clock() if now is None else now)

    def __repr__(self) -> str:
        return (f"EffectivePolicy({self.base!r}, grants={len(self.grants.grants)}, "
                f"networks={len(self.networks)})")
