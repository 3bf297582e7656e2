"""A destination, decided: host parsed and normalised once, SSRF guard, policy, guarded resolve,
the policy's deny CIDRs on the resolved addresses.

Shared by the mitmproxy gate and the fast path. No upstream I/O but DNS.
"""
from __future__ import annotations

import functools
import socket
import time
from dataclasses import dataclass

from egress import netguard
from egress.conn_state import ConnState
from egress.http_checks import Refusal
from egress.policy import Decision, RequestInfo, normalize_host

AGENT_HOST = "cubegate.internal"   # served by the gateway itself to each sandbox (cubegate/agent_endpoint.py)


@dataclass
class Verdict:
    decision: Decision | None
    refusal: Refusal | None
    addresses: tuple[tuple[int, str], ...] = ()   # allowed (family, ip) to connect to, when resolved
    resolved: bool = False    # read a DNS answer: the next resolve may answer otherwise (never remembered)


class DecisionCache:
    """Connection-stage decisions (no scheme, method or path) of the policy object in force, per
    (sandbox, labels, host, port, literal?). Never stale: every change to policies, grants or network
    options swaps in a new policy object (egress.policy.live), and the cache belongs to one object,
    held by reference (compared with `is`, so an id is never reused); identity changes change the
    key (labels) or fail authentication first; a grant expiry is the only change time brings, so
    entries live until the next expiry of a grant in force. Bounded: cleared whole when full."""

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._policy = None
        self._until = float("inf")
        self._since = float("-inf")      # the clock at the last reset: an earlier time is not covered
        self._entries: dict[tuple, Decision] = {}
        self.generation = 0          # bumped whenever the entries go stale (egress/fastpath/deny_memo.py)

    def generation_for(self, policy) -> int:
        """The generation whose entries are `policy`'s now (stale ones dropped first)."""
        now = getattr(policy, "clock", time.time)()
        if policy is not self._policy or not self._since <= now < self._until:
            self._reset(policy, now)
        return self.generation

    def decide(self, policy, req: RequestInfo) -> Decision:
        key = self._key(req)
        if key is None:
            return policy.decide(req)
        now = getattr(policy, "clock", time.time)()
        if policy is not self._policy or not self._since <= now < self._until:
            self._reset(policy, now)
        decision = self._entries.get(key)
        if decision is None:
            decision = policy.decide(req, now) if hasattr(policy, "clock") else policy.decide(req)
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = decision
        return decision

    def _key(self, req: RequestInfo) -> tuple | None:
        """Everything of `req` the decision reads; None: not cached (request-stage decisions here)."""
        if req.scheme is not None or req.method is not None or req.path is not None:
            return None
        return (req.sandbox_id, tuple(sorted(req.labels.items())), req.host, req.port, req.is_ip_literal)

    def _reset(self, policy, now: float) -> None:
        grants = getattr(getattr(policy, "grants", None), "grants", ())
        self.generation += 1
        self._policy = policy
        self._since = now                # a clock set back: a grant expired since may be in force again
        self._until = min((g.expires for g in grants if g.expires is not None and g.expires > now),
                          default=float("inf"))
        self._entries = {}


MAX_CACHED_HOST = 255     # longer is no valid name: parsed each time, never held


def parse_destination_host(raw_host: str):
    """(IP literal or None, canonical host or None, why it is invalid or None). Pure, so the
    hosts of a keep-alive connection's requests are parsed once (bounded: short hosts only)."""
    if len(raw_host) <= MAX_CACHED_HOST:
        return _parse_host_cached(raw_host)
    return _parse_host(raw_host)


def _parse_host(raw_host: str):
    literal = netguard.parse_ip_literal(raw_host)
    if literal is not None:
        return literal, str(literal), None
    try:
        return None, normalize_host(raw_host), None
    except ValueError as e:
        return None, None, str(e)


_parse_host_cached = functools.lru_cache(maxsize=4096)(_parse_host)


async def decide_destination(st: ConnState, raw_host: str, port: int, *, policies, guard: netguard.AddressGuard,
                             resolver: netguard.GuardedResolver, scheme, method, path,
                             cache: DecisionCache | None = None,
                             connected_to: tuple[str, int] | None = None) -> Verdict:
    """Sets st.host/st.port/st.ip_literal; the caller reads the verdict. `policies.current` is the
    policy in force (egress.policy.effective: admin policies + grants + the sandbox's network options);
    `cache` (the fast path's) answers repeated decisions of that same object (connection-stage:
    DecisionCache; the plain-HTTP path's requests: egress.fastpath.request_decisions).
    `connected_to`: the (host, port) of an upstream connection the caller already holds (its address
    guarded when it was made): an allowed request to it is not resolved again (no addresses returned).
    The verdict is that of the policy in force when it is returned (a change during the resolve is seen)."""
    literal, host, invalid = parse_destination_host(raw_host)
    if literal is not None:
        reason = guard.check(literal, port)
        if reason is not None:
            return Verdict(None, Refusal(403, f"ssrf_{reason}", f"destination {literal} is {reason}"))
    elif invalid is not None:
        return Verdict(None, Refusal(400, "invalid_host", invalid))
    st.ip_literal = literal is not None
    if host == AGENT_HOST:
        return Verdict(None, Refusal(403, "agent_endpoint_plain_http_only",
                                     f"{AGENT_HOST} is the gateway itself: plain HTTP on port 80 only"))
    identity = st.identity
    req = RequestInfo(sandbox_id=identity.sandbox_id, labels=identity.labels, host=host, port=port,
                      scheme=scheme, method=method, path=path, is_ip_literal=literal is not None)
    policy = policies.current
    decision = cache.decide(policy, req) if cache is not None else policy.decide(req)
    st.host, st.port = host, port
    if decision.action != "allow":
        return Verdict(decision, None)
    if literal is not None:
        family = socket.AF_INET if literal.version == 4 else socket.AF_INET6
        return Verdict(decision, None, ((family, host),))
    if connected_to == (host, port):
        return Verdict(decision, None)
    # Resolve now so a name pointing at a private address gets a clear 403 instead of a
    # dead tunnel. Whoever connects uses guarded addresses only (these, or the gate's
    # guarded getaddrinfo), so a rebinding answer cannot slip through in between.
    try:
        addresses = await resolver.resolve(host, port)
    except netguard.DestinationBlocked as e:
        return Verdict(decision, Refusal(403, f"ssrf_{e.reason}", str(e)))
    except netguard.DestinationUnresolvable as e:
        return Verdict(decision, Refusal(502, "unresolvable", str(e)))
    if policies.current is not policy:
        # The policy changed during the resolve: its revocation ran over the open connections before
        # the caller could register this one, so the verdict must be the new policy's (decided again:
        # pure, no await between this and the caller's registration).
        policy = policies.current
        decision = cache.decide(policy, req) if cache is not None else policy.decide(req)
        if decision.action != "allow":
            return Verdict(decision, None)
    kept, denied = keep_undenied(policy, identity.sandbox_id, decision, addresses, port)
    if denied is not None:
        return Verdict(denied, None, resolved=True)
    return Verdict(decision, None, kept, resolved=True)


def keep_undenied(policy, sandbox_id: str, decision: Decision | None, addresses, port: int | None
                  ) -> tuple[tuple[tuple[int, str], ...], Decision | None]:
    """The guarded (family, ip) answers for an allowed name that no deny CIDR of the policy in force
    covers (global `denied_cidrs`, the sandbox's network-options deny address entries): the one
    post-resolution policy check, next to the SSRF guard's. Pure. When none is left, the deny
    Decision in place of `decision` (rule: the denying range or entry), enforced in any mode."""
    kept, first = [], None
    for family, ip in addresses:
        denial = policy.address_denial(sandbox_id, ip, port)
        if denial is None:
            kept.append((family, ip))
        elif first is None:
            first = denial
    if kept or first is None:
        return tuple(kept), None
    reason, entry = first
    by = f"network:{sandbox_id}" if reason == "resolved_sandbox_network_deny" else "global"
    return (), Decision("deny", reason, entry, by, "enforce", False, False,
                        decision.tenant if decision is not None else None)


def needs_interception(decision: Decision, credentials, host: str, port: int) -> bool:
    """The one predicate for 'this flow must be decrypted': method/path rules or a credential binding."""
    return decision.needs_inspection or credentials.needs_interception(decision.tenant, host, port)


def connected_refusal(guard: netguard.AddressGuard, policy, sandbox_id: str | None, ip: str, port: int) -> str | None:
    """The reason to drop a connection just made to `ip:port` (before a byte is sent), or None:
    the SSRF guard, then the policy's deny CIDRs for the sandbox. Pure."""
    reason = guard.check(ip, port)
    if reason is not None:
        return f"ssrf_{reason}"
    denial = policy.address_denial(sandbox_id or "", ip, port) if policy is not None else None
    return denial[0] if denial is not None else None
