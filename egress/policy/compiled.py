"""Compile policies into an immutable, trie-indexed set and decide requests.

Decision cost depends on the number of labels in the host and on the few
rules attached to the trie nodes on that path, not on the total rule count.
Pure: no I/O, no clocks, no globals mutated after construction.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping

from .builtins import BUILTIN_DENIED_CIDRS, BUILTIN_DENIED_DOMAINS
from .errors import ErrorItem, PolicyError
from .hosts import (
    HostPattern,
    InvalidHost,
    InvalidPath,
    IPAddress,
    normalize_host_addr,
    normalize_path,
    deny_views,
    parse_host_pattern,
    parse_ip,
    path_prefix_matches,
)
from .model import (
    ALLOW,
    DENY,
    REPORT,
    Decision,
    GlobalDenies,
    IPNetwork,
    Policy,
    RequestInfo,
    Rule,
)

# Host specificity tiers (higher wins). Wildcards rank by suffix label count.
EXACT_HOST = 1_000
ANY_HOST = 0

_NO, _MAYBE, _YES = 0, 1, 2


class _CRule:
    """A rule flattened for the hot path."""

    __slots__ = ("name", "deny", "ports", "schemes", "methods", "paths", "max_path", "order")

    def __init__(self, rule: Rule, order: int):
        m = rule.match
        self.name = rule.name
        self.deny = rule.action == DENY
        self.ports = m.ports
        self.schemes = m.schemes
        self.methods = m.methods
        self.paths = tuple(sorted(m.paths, key=len, reverse=True)) if m.paths is not None else None
        self.max_path = len(self.paths[0]) if self.paths else 0
        self.order = order

    def test(self, port, scheme, method, path) -> tuple[int, int]:
        """(_NO | _MAYBE | _YES, matched path length). None inputs are unknown."""
        maybe = False
        if self.ports is not None:
            if port is None:
                maybe = True
            elif port not in self.ports:
                return _NO, 0
        if self.schemes is not None:
            if scheme is None:
                maybe = True
            elif scheme not in self.schemes:
                return _NO, 0
        if self.methods is not None:
            if method is None:
                maybe = True
            elif method not in self.methods:
                return _NO, 0
        plen = 0
        if self.paths is not None:
            if path is None:
                return _MAYBE, self.max_path
            for p in self.paths:
                if path_prefix_matches(p, path):
                    plen = len(p)
                    break
            else:
                return _NO, 0
        return (_MAYBE if maybe else _YES), plen


class _Node:
    __slots__ = ("children", "exact", "wild")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.exact: tuple = ()
        self.wild: tuple = ()


def _trie_insert(root: _Node, pattern: HostPattern, item) -> None:
    node = root
    for label in pattern.labels_reversed:
        nxt = node.children.get(label)
        if nxt is None:
            nxt = node.children[label] = _Node()
        node = nxt
    if pattern.wildcard:
        node.wild = node.wild + (item,)
    else:
        node.exact = node.exact + (item,)


def _trie_lookup(root: _Node, host: str) -> list[tuple[int, object]]:
    """(specificity, item) for every pattern matching ``host``."""
    labels = host.split(".")
    n = len(labels)
    node = root
    out: list[tuple[int, object]] = []
    for depth in range(1, n + 1):
        node = node.children.get(labels[n - depth])
        if node is None:
            break
        if depth < n:
            for item in node.wild:
                out.append((depth, item))
        else:
            for item in node.exact:
                out.append((EXACT_HOST, item))
    return out


class _CidrIndex:
    """Longest-prefix lookup: one dict per prefix length present."""

    def __init__(self, entries: Iterable[tuple[IPNetwork, object]]):
        tables: dict[tuple[int, int], dict[IPNetwork, tuple]] = {}
        for net, item in entries:
            t = tables.setdefault((net.version, net.prefixlen), {})
            t[net] = t.get(net, ()) + (item,)
        self._tables = {
            v: tuple(sorted(((plen, tables[(ver, plen)]) for ver, plen in tables if ver == v), reverse=True))
            for v in (4, 6)
        }

    def lookup(self, addr: IPAddress) -> list[tuple[int, object]]:
        out: list[tuple[int, object]] = []
        for plen, table in self._tables[addr.version]:
            net = ipaddress.ip_network((addr, plen), strict=False)
            for item in table.get(net, ()):
                out.append((plen, item))
        return out

    def __bool__(self) -> bool:
        return any(self._tables.values())


class _Outcome:
    __slots__ = ("deny", "rule", "inspect")

    def __init__(self, deny: bool, rule: _CRule | None, inspect: bool):
        self.deny, self.rule, self.inspect = deny, rule, inspect


def _pick(candidates, default_deny: bool, port, scheme, method, path) -> _Outcome:
    """Best definite match by (host specificity, path length, deny-over-allow,
    earlier rule); flag inspection if a possible-but-unknown match could beat it
    with the other action."""
    best_key = None
    best: _CRule | None = None
    maybes = []
    for spec, r in candidates:
        state, plen = r.test(port, scheme, method, path)
        if state == _NO:
            continue
        key = (spec, plen, r.deny, -r.order)
        if state == _YES:
            if best_key is None or key > best_key:
                best_key, best = key, r
        else:
            maybes.append((key, r))
    deny = best.deny if best is not None else default_deny
    inspect = any(r.deny != deny and (best_key is None or key > best_key) for key, r in maybes)
    return _Outcome(deny, best, inspect)


class CompiledPolicy:
    """One policy, indexed. Immutable after construction."""

    def __init__(self, policy: Policy):
        self.policy = policy   # the source, kept so a set can be rebuilt with other policies
        self.name = policy.name
        self.mode = policy.mode
        self.default = policy.default
        self.tenant = policy.tenant
        self.applies_to = policy.applies_to
        self.rules = policy.rules
        self.file = policy.file
        self.line = policy.line
        self._root = _Node()
        anyhost: list[_CRule] = []
        cidr_entries: list[tuple[IPNetwork, _CRule]] = []
        for order, rule in enumerate(policy.rules):
            cr = _CRule(rule, order)
            for pattern in rule.match.hosts:
                _trie_insert(self._root, pattern, cr)
            for net in rule.match.cidrs:
                cidr_entries.append((net, cr))
            if not rule.match.hosts and not rule.match.cidrs:
                anyhost.append(cr)
        self._anyhost = tuple((ANY_HOST, cr) for cr in anyhost)
        self._cidrs = _CidrIndex(cidr_entries)

    @property
    def is_default(self) -> bool:
        return self.applies_to is None

    def evaluate(self, host: str, addr: IPAddress | None, port, scheme, method, path) -> tuple[str, _Outcome]:
        """(reason-if-no-rule, outcome) for a canonical host. Unknown fields are None."""
        if addr is not None:
            out = _pick(self._cidrs.lookup(addr), True, port, scheme, method, path)
            for view in deny_views(addr)[1:]:   # the IPv4 address an IPv6 form carries: its deny rules hold
                inner = _pick(self._cidrs.lookup(view), False, port, scheme, method, path)   # rules only
                if inner.deny:
                    return "ip_literal_not_allowed", inner
                if inner.inspect and not out.deny:   # a deny of the IPv4 may match once the request is known
                    out = _Outcome(out.deny, out.rule, True)
            return "ip_literal_not_allowed", out
        cands = _trie_lookup(self._root, host)
        if self._anyhost:
            cands.extend(self._anyhost)
        out = _pick(cands, self.default == DENY, port, scheme, method, path)
        return ("default_deny" if self.default == DENY else "default_allow"), out

    def __repr__(self) -> str:
        return f"CompiledPolicy({self.name!r}, rules={len(self.rules)}, mode={self.mode})"


def _deny(reason: str, policy: CompiledPolicy | None = None, rule: str | None = None) -> Decision:
    return Decision(
        action=DENY,
        reason=reason,
        rule=rule,
        policy=policy.name if policy else None,
        mode=policy.mode if policy else "enforce",
        would_deny=False,
        needs_inspection=False,
        tenant=policy.tenant if policy else None,
    )


class CompiledPolicySet:
    """All policies plus global denies; the gateway's single decision object."""

    def __init__(
        self,
        policies: Iterable[Policy],
        global_denies: GlobalDenies = GlobalDenies(),
        *,
        digest: str = "",
        sources: tuple[str, ...] = (),
    ):
        policies = tuple(policies)
        _check_policy_set(policies)
        self.digest = digest
        self.sources = tuple(sources)
        self.policies: tuple[CompiledPolicy, ...] = tuple(CompiledPolicy(p) for p in policies)

        builtin = tuple(parse_host_pattern(d) for d in BUILTIN_DENIED_DOMAINS)
        self.global_denied_domains: tuple[HostPattern, ...] = tuple(dict.fromkeys(builtin + global_denies.domains))
        builtin_nets = tuple(ipaddress.ip_network(c) for c in BUILTIN_DENIED_CIDRS)
        self.global_denied_cidrs: tuple[IPNetwork, ...] = tuple(dict.fromkeys(builtin_nets + global_denies.cidrs))
        self._global_root = _Node()
        for pattern in self.global_denied_domains:
            _trie_insert(self._global_root, pattern, pattern)
        self._global_cidrs = _CidrIndex((n, n) for n in self.global_denied_cidrs)

        self._by_sandbox: dict[str, CompiledPolicy] = {}
        labelled: list[CompiledPolicy] = []
        self._default: CompiledPolicy | None = None
        for cp in self.policies:
            if cp.applies_to is None:
                self._default = cp
                continue
            for sb in cp.applies_to.sandboxes:
                self._by_sandbox[sb] = cp
            if cp.applies_to.labels:
                labelled.append(cp)
        # Most labels first; equal counts by policy name (documented tie-break).
        self._by_labels = tuple(sorted(labelled, key=lambda p: (-len(p.applies_to.labels), p.name)))

    # -- selection ---------------------------------------------------------
    def policy_for(self, sandbox_id: str, labels: Mapping[str, str]) -> CompiledPolicy | None:
        """Sandbox id match, else the matching label selector with most labels,
        else the default policy, else None."""
        cp = self._by_sandbox.get(sandbox_id)
        if cp is not None:
            return cp
        if labels:
            for cp in self._by_labels:
                if cp.applies_to.matches_labels(labels):
                    return cp
        return self._default

    def policy(self, name: str) -> CompiledPolicy | None:
        for cp in self.policies:
            if cp.name == name:
                return cp
        return None

    # -- decisions ---------------------------------------------------------
    def _globally_denied(self, host: str, addr: IPAddress | None) -> bool:
        if addr is not None:
            return any(self._global_cidrs.lookup(a) for a in deny_views(addr))
        return bool(_trie_lookup(self._global_root, host))

    def decide(self, req: RequestInfo) -> Decision:
        """Pure decision for one request (or one CONNECT/SNI, with method/path None)."""
        policy = self.policy_for(req.sandbox_id, req.labels)
        try:
            host, addr = normalize_host_addr(req.host)
        except InvalidHost:
            return _deny("invalid_host", policy)
        if req.is_ip_literal and addr is None:
            return _deny("invalid_host", policy)
        if type(req.port) is not int or not 0 < req.port < 65536:
            return _deny("invalid_port", policy)
        path = None
        if req.path is not None:
            try:
                path = normalize_path(req.path)
            except InvalidPath:
                return _deny("invalid_path", policy)
        if self._globally_denied(host, addr):
            return _deny("global_deny", policy)
        if policy is None:
            return _deny("no_policy")
        scheme = req.scheme.lower() if req.scheme is not None else None
        method = req.method.upper() if req.method is not None else None

        fallback_reason, out = policy.evaluate(host, addr, req.port, scheme, method, path)
        report = policy.mode == REPORT
        if out.inspect:
            return Decision(ALLOW, "inspect_required", None, policy.name, policy.mode, False, True, policy.tenant)
        if out.rule is not None:
            reason = "rule_deny" if out.deny else "rule_allow"
        else:
            reason = fallback_reason
        would_deny = out.deny and report
        action = DENY if out.deny and not report else ALLOW
        return Decision(
            action=action,
            reason=reason,
            rule=out.rule.name if out.rule is not None else None,
            policy=policy.name,
            mode=policy.mode,
            would_deny=would_deny,
            needs_inspection=False,
            tenant=policy.tenant,
        )

    def address_denial(self, sandbox_id: str, ip: str, port: int | None) -> tuple[str, str | None] | None:
        """For an address a NAME resolved to (the one about to be connected to): (reason, entry) when
        a global denied CIDR covers it, else None. IP literals are decided by decide(); this closes
        the same ranges to names resolving into them (egress.destination filters every answer)."""
        reason = "resolved_global_deny"
        addr = parse_ip(ip)
        if addr is None:
            return reason, None   # not an address we can read: fail closed
        for view in deny_views(addr):
            hits = self._global_cidrs.lookup(view)
            if hits:
                return reason, str(hits[0][1])
        return None

    def name_may_resolve(self, sandbox_id: str, labels: Mapping[str, str], name: str) -> bool:
        """For the DNS resolver: could any request to ``name`` (any port, method,
        path) be allowed for this sandbox? Names only; IP-looking names say no."""
        try:
            host, addr = normalize_host_addr(name)
        except InvalidHost:
            return False
        if addr is not None or self._globally_denied(host, None):
            return False
        policy = self.policy_for(sandbox_id, labels)
        if policy is None:
            return False
        if policy.mode == REPORT:
            return True
        _, out = policy.evaluate(host, None, None, None, None, None)
        return out.inspect or not out.deny

    def resolve_scope(self, sandbox_id: str, labels: Mapping[str, str], name: str) -> str | None:
        """For the DNS resolver's new-name limit, on a name that may resolve: None when an
        exact host rule allows it (not limited); else the most specific allowing wildcard
        ("*.x.test"), or "*" when only a host-less rule, the default or report mode lets it through."""
        try:
            host, addr = normalize_host_addr(name)
        except InvalidHost:
            return "*"
        policy = self.policy_for(sandbox_id, labels)
        if addr is not None or policy is None:
            return "*"
        depth = 0
        for spec, rule in _trie_lookup(policy._root, host):
            if rule.deny:
                continue
            if spec == EXACT_HOST:
                return None
            depth = max(depth, spec)
        return "*." + ".".join(host.split(".")[-depth:]) if depth else "*"

    def hosts_allowed(self, sandbox_id: str, labels: Mapping[str, str]) -> Callable[[str], bool]:
        """``name -> bool`` bound to one sandbox (see name_may_resolve)."""
        labels = dict(labels)
        return lambda name: self.name_may_resolve(sandbox_id, labels, name)

    def __repr__(self) -> str:
        return f"CompiledPolicySet(policies={[p.name for p in self.policies]}, digest={self.digest[:12]!r})"


def _check_policy_set(policies: tuple[Policy, ...]) -> None:
    """Cross-policy rules that no single file can check."""
    errors: list[ErrorItem] = []
    by_name: dict[str, Policy] = {}
    default: Policy | None = None
    by_sandbox: dict[str, Policy] = {}
    by_selector: dict[tuple, Policy] = {}
    for p in policies:
        first = by_name.get(p.name)
        if first is not None:
            errors.append(ErrorItem(p.file, p.line, "name",
                                    f"policy name {p.name!r} is already used at {first.file}:{first.line}"))
        else:
            by_name[p.name] = p
        if p.applies_to is None:
            if default is not None:
                errors.append(ErrorItem(p.file, p.line, "applies_to",
                                        f"policy {p.name!r} has no applies_to, so it is a default policy, but "
                                        f"{default.name!r} at {default.file}:{default.line} already is; "
                                        "give one of them an applies_to"))
            else:
                default = p
            continue
        for sb in sorted(p.applies_to.sandboxes):
            other = by_sandbox.get(sb)
            if other is not None and other is not p:
                errors.append(ErrorItem(p.file, p.line, "applies_to.sandboxes",
                                        f"sandbox {sb!r} is already selected by policy {other.name!r} at "
                                        f"{other.file}:{other.line}"))
            else:
                by_sandbox[sb] = p
        if p.applies_to.labels:
            other = by_selector.get(p.applies_to.labels)
            if other is not None:
                errors.append(ErrorItem(p.file, p.line, "applies_to.labels",
                                        f"policy {other.name!r} at {other.file}:{other.line} selects exactly the "
                                        "same labels; a sandbox could not tell them apart"))
            else:
                by_selector[p.applies_to.labels] = p
    if errors:
        raise PolicyError(errors)
