"""Per-sandbox network options: `{allow: [...], deny: [...]}` that only narrow (pure).

Entries: a host (`api.x.com`), a wildcard (`*.x.com`), an IP or CIDR
(`198.18.0.10`, `10.0.0.0/8`, `[2001:db8::/32]`), each optionally with one
port (`api.x.com:443`, `10.0.0.0/8:5432`, `[2001:db8::1]:443`); and, in `deny`
only, a bare `*`: every destination (no egress at all). The sandbox
may reach a destination only if the admin policies allow it AND (the allow
list is empty or names it) AND the deny list does not name it. Nothing here
can allow what the admin policies deny (see EffectivePolicy.decide).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ErrorItem, PolicyError
from .hosts import HostPattern, InvalidHost, IPAddress, deny_views, parse_cidr, parse_host_pattern
from .model import IPNetwork

MAX_ENTRIES = 256


@dataclass(frozen=True)
class NetEntry:
    text: str
    host: HostPattern | None       # a name entry
    net: IPNetwork | None          # an address entry
    port: int | None               # None = every port
    everything: bool = False       # `*` (deny only): every name and address, every port

    def matches(self, host: str, addr: IPAddress | None, port: int | None) -> bool:
        """port None = "some port" (DNS): only an entry for every port is certain to match."""
        if self.everything:
            return True
        if self.port is not None and self.port != port:
            return False
        if addr is not None:
            return self.net is not None and addr.version == self.net.version and addr in self.net
        return self.host is not None and self.host.matches(host)

    def names(self, host: str) -> bool:
        """Could a request to name `host` on some port match this entry?"""
        return self.everything or (self.host is not None and self.host.matches(host))

    def covers(self, other: "NetEntry") -> bool:
        """Does every destination `other` matches also match this entry?"""
        if self.everything:
            return True
        if other.everything or (self.port is not None and self.port != other.port):
            return False
        if self.net is not None:
            return other.net is not None and other.net.version == self.net.version and other.net.subnet_of(self.net)
        if self.host is None or other.host is None:
            return False
        if not self.host.wildcard:
            return not other.host.wildcard and other.host.name == self.host.name
        # *.S covers a name under S, and *.T where T is S or a name under S
        return (other.host.wildcard and other.host.name == self.host.name) or self.host.matches(other.host.name)


@dataclass(frozen=True)
class SandboxNetwork:
    allow: tuple[NetEntry, ...] = ()
    deny: tuple[NetEntry, ...] = ()

    def verdict(self, host: str, addr: IPAddress | None, port: int) -> tuple[str, str] | None:
        """None when this destination may pass; else (reason, entry text) of the narrowing denial."""
        views = deny_views(addr) if addr is not None else (None,)
        for e in self.deny:
            if any(e.matches(host, view, port) for view in views):
                return "sandbox_network_deny", e.text
        if self.allow and not any(e.matches(host, addr, port) for e in self.allow):
            return "sandbox_network_not_allowed", None
        return None

    def may_resolve(self, host: str) -> bool:
        """For DNS: False when no request to this name could pass the narrowing."""
        if any(e.port is None and e.names(host) for e in self.deny):
            return False
        return not self.allow or any(e.names(host) for e in self.allow)

    def to_doc(self) -> dict:
        return {"allow": [e.text for e in self.allow], "deny": [e.text for e in self.deny]}


def narrow_further(inherited: SandboxNetwork, requested: SandboxNetwork, *,
                   source: str = "network") -> SandboxNetwork:
    """The options of a sandbox that starts under `inherited` (a clone under its snapshotted
    sandbox's) and asks for `requested`: never wider than `inherited`. Deny lists add up;
    an allow list may only name what the inherited allow list covers (PolicyError with
    `allow[i]` otherwise: a widening is refused, never silently dropped)."""
    errors = []
    if inherited.allow and requested.allow:
        for i, e in enumerate(requested.allow):
            if not any(outer.covers(e) for outer in inherited.allow):
                errors.append(ErrorItem(source, 0, f"allow[{i}]", f"{e.text!r} is not within the inherited allow "
                                        "list: a clone can only narrow its snapshotted sandbox's network options"))
    known = {e.text for e in inherited.deny}
    deny = inherited.deny + tuple(e for e in requested.deny if e.text not in known)
    if len(deny) > MAX_ENTRIES:
        errors.append(ErrorItem(source, 0, "deny", f"at most {MAX_ENTRIES} entries with the inherited ones"))
    if errors:
        raise PolicyError(errors)
    return SandboxNetwork(requested.allow or inherited.allow, deny)


def _split_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):
        inner, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError("unclosed '['")
        if not rest:
            return inner, None
        if not rest.startswith(":"):
            raise ValueError("expected ':PORT' after ']'")
        return inner, _port(rest[1:])
    if text.count(":") == 1:
        head, _, port = text.partition(":")
        return head, _port(port)
    if text.count(":") > 1:
        raise ValueError("write an IPv6 address or CIDR in brackets: [2001:db8::/32]:443")
    return text, None


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"port {text!r} is not 1-65535")
    return int(text)


def parse_entry(text: object) -> NetEntry:
    if not isinstance(text, str) or not text.strip():
        raise ValueError("expected a non-empty string: host, *.wildcard or CIDR, optionally :PORT")
    raw = text.strip()
    head, port = _split_port(raw)
    try:
        net = parse_cidr(head)     # the spelling requests are compared in (mapped IPv6 → IPv4)
    except ValueError as e:
        if "/" in head or "%" in head or ":" in head or head.replace(".", "").isdigit():
            raise ValueError(f"not a valid address or CIDR: {e}") from None
        net = None
    if net is not None:
        return NetEntry(raw, None, net, port)
    try:
        return NetEntry(raw, parse_host_pattern(head), None, port)
    except InvalidHost as e:
        raise ValueError(str(e)) from None


def parse_network(doc: object, *, source: str = "network") -> SandboxNetwork:
    """From `{allow: [...], deny: [...]}`; PolicyError with fields like `allow[2]` (pointers for the API)."""
    errors: list[ErrorItem] = []
    if not isinstance(doc, dict):
        raise PolicyError(ErrorItem(source, 0, "", "expected an object with allow and/or deny lists"))
    for key in doc:
        if key not in ("allow", "deny"):
            errors.append(ErrorItem(source, 0, str(key), f"unknown key {key!r}; expected one of: allow, deny"))
    out: dict[str, list[NetEntry]] = {"allow": [], "deny": []}
    for key in ("allow", "deny"):
        items = doc.get(key, [])
        if not isinstance(items, list):
            errors.append(ErrorItem(source, 0, key, "expected a list"))
            continue
        if len(items) > MAX_ENTRIES:
            errors.append(ErrorItem(source, 0, key, f"at most {MAX_ENTRIES} entries"))
            continue
        for i, item in enumerate(items):
            if item == "*":
                if key == "deny":
                    out[key].append(NetEntry("*", None, None, None, everything=True))
                else:
                    errors.append(ErrorItem(source, 0, f"{key}[{i}]", 'a bare "*" is for deny only (no egress '
                                            'at all); an allow list names what may pass'))
                continue
            try:
                out[key].append(parse_entry(item))
            except ValueError as e:
                errors.append(ErrorItem(source, 0, f"{key}[{i}]", str(e)))
    if errors:
        raise PolicyError(errors)
    return SandboxNetwork(tuple(out["allow"]), tuple(out["deny"]))
