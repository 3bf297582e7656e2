"""Plain data: what a policy says (loaded from YAML or built in code) and the
request/decision types the gateway exchanges with the compiled policy set."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from .hosts import HostPattern

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ALLOW = "allow"
DENY = "deny"
ACTIONS = (ALLOW, DENY)
ENFORCE = "enforce"
REPORT = "report"
MODES = (ENFORCE, REPORT)
SCHEMES = ("http", "https")
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT")


@dataclass(frozen=True)
class RequestInfo:
    sandbox_id: str
    labels: Mapping[str, str]
    host: str  # raw host from CONNECT/SNI/Host; normalised inside; may be an IP literal
    port: int
    scheme: str | None = None  # "https" | "http" | None (unknown at CONNECT)
    method: str | None = None  # None = not yet known (CONNECT/SNI stage)
    path: str | None = None
    is_ip_literal: bool = False


@dataclass(frozen=True)
class Decision:
    action: str  # "allow" | "deny" (effective: report mode turns a policy deny into allow)
    reason: str  # stable snake_case, see PRECEDENCE.md
    rule: str | None
    policy: str | None
    mode: str  # enforce | report
    would_deny: bool  # report mode: enforce would have denied
    needs_inspection: bool  # CONNECT stage: outcome depends on method/path/scheme
    tenant: str | None

    @property
    def allowed(self) -> bool:
        return self.action == ALLOW


@dataclass(frozen=True)
class Match:
    """Empty ``hosts`` and ``cidrs`` = any host name (never an IP literal).
    ``None`` for ports/schemes/methods/paths = no constraint."""

    hosts: tuple[HostPattern, ...] = ()
    cidrs: tuple[IPNetwork, ...] = ()
    ports: frozenset[int] | None = None
    schemes: frozenset[str] | None = None
    methods: frozenset[str] | None = None
    paths: tuple[str, ...] | None = None

    def key(self) -> tuple:
        """Order-insensitive identity, used to find conflicting rules."""
        return (
            frozenset(self.hosts),
            frozenset(self.cidrs),
            self.ports,
            self.schemes,
            self.methods,
            frozenset(self.paths) if self.paths is not None else None,
        )


@dataclass(frozen=True)
class Rule:
    name: str
    action: str
    match: Match
    file: str = "<code>"
    line: int = 0


@dataclass(frozen=True)
class AppliesTo:
    sandboxes: frozenset[str] = frozenset()
    labels: tuple[tuple[str, str], ...] = ()  # sorted (key, value) pairs

    def matches_labels(self, labels: Mapping[str, str]) -> bool:
        return bool(self.labels) and all(labels.get(k) == v for k, v in self.labels)


@dataclass(frozen=True)
class Policy:
    name: str
    rules: tuple[Rule, ...] = ()
    default: str = DENY
    mode: str = ENFORCE
    tenant: str | None = None
    applies_to: AppliesTo | None = None  # None = the default policy
    file: str = "<code>"
    line: int = 0


@dataclass(frozen=True)
class GlobalDenies:
    domains: tuple[HostPattern, ...] = ()
    cidrs: tuple[IPNetwork, ...] = ()
    sources: tuple[str, ...] = field(default=())  # "file:line" of each entry, for messages
