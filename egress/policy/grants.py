"""Grants: narrow allow exceptions an admin approved (an access request), pure.

A grant names who (sandboxes and/or one label selector: `{tenant: acme}` is a
tenant-wide grant, since the runtime labels every sandbox with its tenant),
what (hosts or CIDRs, optional ports) and until when. It can turn the selected
policy's deny (a rule, the default, no policy, or report mode's would-deny)
into an allow; it never passes a global deny, the SSRF guard or the sandbox's
own network options. Expiry is enforced where the grant is read: a grant past
its `expires` selects nobody (the caller passes the time in; the daemon's sweep
then removes it and closes what it allowed).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .errors import ErrorItem, PolicyError
from .hosts import HostPattern, InvalidHost, IPAddress, parse_cidr, parse_host_pattern
from .model import IPNetwork


@dataclass(frozen=True)
class Grant:
    name: str
    sandboxes: frozenset[str] = frozenset()
    labels: tuple[tuple[str, str], ...] = ()
    hosts: tuple[HostPattern, ...] = ()
    cidrs: tuple[IPNetwork, ...] = ()
    ports: frozenset[int] | None = None
    expires: float | None = None
    request: str | None = None      # the access request it came from

    def in_force(self, now: float) -> bool:
        return self.expires is None or now < self.expires

    def selects(self, sandbox_id: str, labels: Mapping[str, str]) -> bool:
        if sandbox_id in self.sandboxes:
            return True
        return bool(self.labels) and all(labels.get(k) == v for k, v in self.labels)

    def covers(self, host: str, addr: IPAddress | None, port: int | None) -> bool:
        if self.ports is not None and port not in self.ports:
            return False
        if addr is not None:
            return any(addr.version == n.version and addr in n for n in self.cidrs)
        return any(p.matches(host) for p in self.hosts)

    def names(self, host: str) -> bool:
        return any(p.matches(host) for p in self.hosts)

    def to_doc(self) -> dict:
        doc: dict = {"applies_to": {}, "hosts": [str(h) for h in self.hosts], "cidrs": [str(c) for c in self.cidrs]}
        if self.sandboxes:
            doc["applies_to"]["sandboxes"] = sorted(self.sandboxes)
        if self.labels:
            doc["applies_to"]["labels"] = dict(self.labels)
        if self.ports is not None:
            doc["ports"] = sorted(self.ports)
        if self.expires is not None:
            doc["expires"] = self.expires
        if self.request is not None:
            doc["request"] = self.request
        return doc


def parse_grant(name: str, doc: object) -> Grant:
    """From its stored document; PolicyError naming fields."""
    errs: list[ErrorItem] = []

    def err(field: str, msg: str) -> None:
        errs.append(ErrorItem("grant", 0, field, msg))

    if not isinstance(doc, dict):
        raise PolicyError(ErrorItem("grant", 0, "", "expected an object"))
    for k in doc:
        if k not in ("applies_to", "hosts", "cidrs", "ports", "expires", "request"):
            err(k, f"unknown key {k!r}")
    applies = doc.get("applies_to") or {}
    sandboxes = applies.get("sandboxes", []) if isinstance(applies, dict) else []
    labels = applies.get("labels", {}) if isinstance(applies, dict) else {}
    if not isinstance(sandboxes, list) or not all(isinstance(s, str) and s for s in sandboxes):
        err("applies_to.sandboxes", "expected a list of sandbox ids")
        sandboxes = []
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        err("applies_to.labels", "expected a mapping of label values")
        labels = {}
    if not sandboxes and not labels:
        err("applies_to", "a grant names sandboxes or a label selector")
    hosts: list[HostPattern] = []
    for i, h in enumerate(doc.get("hosts") or []):
        try:
            hosts.append(parse_host_pattern(h))
        except InvalidHost as e:
            err(f"hosts[{i}]", str(e))
    cidrs: list = []
    for i, c in enumerate(doc.get("cidrs") or []):
        try:
            cidrs.append(parse_cidr(c))
        except (TypeError, ValueError) as e:
            err(f"cidrs[{i}]", f"not a valid CIDR: {e}")
    if not hosts and not cidrs:
        err("hosts", "a grant names at least one host or CIDR")
    ports = doc.get("ports")
    if ports is not None and (not isinstance(ports, list) or not ports
                              or not all(type(p) is int and 0 < p < 65536 for p in ports)):
        err("ports", "expected a non-empty list of ports 1-65535")
        ports = None
    expires = doc.get("expires")
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, (int, float))):
        err("expires", "expected a unix time (seconds)")
        expires = None
    if errs:
        raise PolicyError(errs)
    return Grant(name=name, sandboxes=frozenset(sandboxes), labels=tuple(sorted(labels.items())),
                 hosts=tuple(hosts), cidrs=tuple(cidrs), ports=frozenset(ports) if ports else None,
                 expires=float(expires) if expires is not None else None, request=doc.get("request"))


class GrantIndex:
    """Grants by sandbox id, plus the label-selected ones (few: tenant and team grants)."""

    def __init__(self, grants: Iterable[Grant]):
        self.grants = tuple(grants)
        self._by_sandbox: dict[str, list[Grant]] = {}
        self._by_labels: list[Grant] = []
        for g in self.grants:
            for sb in g.sandboxes:
                self._by_sandbox.setdefault(sb, []).append(g)
            if g.labels:
                self._by_labels.append(g)

    def for_sandbox(self, sandbox_id: str, labels: Mapping[str, str], now: float) -> list[Grant]:
        """The grants in force at `now` that select the sandbox."""
        out = [g for g in self._by_sandbox.get(sandbox_id, ()) if g.in_force(now)]
        out += [g for g in self._by_labels if g.selects(sandbox_id, labels) and g.in_force(now) and g not in out]
        return out

    def expired(self, now: float) -> tuple[str, ...]:
        return tuple(sorted(g.name for g in self.grants if not g.in_force(now)))

    def __bool__(self) -> bool:
        return bool(self.grants)
