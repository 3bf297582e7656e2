"""Bindings: which secret is injected into which request, and how (pure, no I/O).

A binding document:
    {"id": "openai", "tenant": "acme", "secret_id": "openai-key",
     "match": {"hosts": ["api.openai.com"], "ports": [443], "methods": ["POST"],
               "path_prefixes": ["/v1/"], "allow_plaintext": false},
     "inject": {"type": "header", "name": "Authorization", "format": "Bearer {secret}"},
     "placeholder": false}

Host patterns: exact names, or "*.example.com" which matches any name with at
least one more label (a.example.com, a.b.example.com) and never example.com
itself. Specificity when several bindings match a request, compared in order:
exact host > wildcard host (longer suffix wins); longer matching path prefix;
method list given > any method. Equal best specificity = ambiguous.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .errors import AmbiguousBinding, InvalidBinding
from .names import _NAME, host_pattern_problem, normalize_host

HostPolicyCheck = Callable[[str, str], "str | None"]

# Headers that frame or route the message; a credential must never go there.
FORBIDDEN_HEADERS = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "upgrade",
    "keep-alive", "te", "trailer", "trailers", "expect", "content-encoding",
    "forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "via",
})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token
_METHOD = re.compile(r"[A-Z]{1,20}")
_VISIBLE = re.compile(r"[\x20-\x7e\t]*")  # header value chars we accept in a format
_TOP_KEYS = {"id", "tenant", "secret_id", "match", "inject", "placeholder"}
_MATCH_KEYS = {"hosts", "ports", "methods", "path_prefixes", "allow_plaintext"}
_INJECT_KEYS = {"header": {"type", "name", "format"}, "query": {"type", "name"},
                "basic": {"type", "username"}}


@dataclass(frozen=True)
class Match:
    hosts: tuple[str, ...]
    ports: tuple[int, ...] = (443,)
    methods: tuple[str, ...] | None = None
    path_prefixes: tuple[str, ...] | None = None
    allow_plaintext: bool = False


@dataclass(frozen=True)
class Binding:
    id: str
    tenant: str
    secret_id: str
    match: Match
    inject: dict        # validated: {"type": "header", "name", "format"} | {"type": "query", "name"} | {"type": "basic", "username"}
    placeholder: bool = False

    def to_dict(self) -> dict:
        m = self.match
        return {"id": self.id, "tenant": self.tenant, "secret_id": self.secret_id,
                "match": {"hosts": list(m.hosts), "ports": list(m.ports),
                          "methods": list(m.methods) if m.methods is not None else None,
                          "path_prefixes": list(m.path_prefixes) if m.path_prefixes is not None else None,
                          "allow_plaintext": m.allow_plaintext},
                "inject": dict(self.inject), "placeholder": self.placeholder}


# ---------------------------------------------------------------------------
# parsing and validation

def doc_from_options(*, binding_id: str | None, tenant: str | None, secret_id: str | None,
                     hosts: Iterable[str] = (), ports: Iterable[int] = (), methods: Iterable[str] = (),
                     path_prefixes: Iterable[str] = (), allow_plaintext: bool = False, header: str | None = None,
                     fmt: str = "Bearer {secret}", query: str | None = None, basic_user: str | None = None,
                     placeholder: bool = False) -> dict:
    """A binding document from the CLI's options (and the console's form fields, which are the same),
    for Vault.add_binding to validate. ValueError unless exactly one of header/query/basic_user."""
    kinds = [k for k in (header, query, basic_user) if k]
    if len(kinds) != 1:
        raise ValueError("give exactly one of header, query, basic user")
    if header:
        inject = {"type": "header", "name": header, "format": fmt}
    elif query:
        inject = {"type": "query", "name": query}
    else:
        inject = {"type": "basic", "username": basic_user}
    match: dict[str, Any] = {"hosts": list(hosts), "ports": list(ports) or [443], "allow_plaintext": allow_plaintext}
    if methods:
        match["methods"] = list(methods)
    if path_prefixes:
        match["path_prefixes"] = list(path_prefixes)
    return {"id": binding_id, "tenant": tenant, "secret_id": secret_id, "match": match,
            "inject": inject, "placeholder": placeholder}


def parse_binding(doc: Any) -> Binding:
    """Validate a binding document; raise InvalidBinding listing every problem."""
    errs: list[str] = []
    if not isinstance(doc, dict):
        raise InvalidBinding("binding must be a JSON object")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        errs.append(f"unknown keys: {sorted(unknown)}")
    for key in ("id", "tenant", "secret_id"):
        v = doc.get(key)
        if not isinstance(v, str) or not _NAME.fullmatch(v):
            errs.append(f"{key} must match [a-z0-9][a-z0-9_.-]{{0,63}}")
    match = _parse_match(doc.get("match"), errs)
    inject = _parse_inject(doc.get("inject"), errs)
    placeholder = doc.get("placeholder", False)
    if not isinstance(placeholder, bool):
        errs.append("placeholder must be true or false")
    if errs:
        raise InvalidBinding(errs)
    return Binding(id=doc["id"], tenant=doc["tenant"], secret_id=doc["secret_id"],
                   match=match, inject=inject, placeholder=placeholder)


def _parse_match(m: Any, errs: list[str]) -> Match | None:
    if not isinstance(m, dict):
        errs.append("match must be an object with at least 'hosts'")
        return None
    unknown = set(m) - _MATCH_KEYS
    if unknown:
        errs.append(f"unknown match keys: {sorted(unknown)}")
    hosts = m.get("hosts")
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        errs.append("match.hosts must be a non-empty list of host names")
        hosts = []
    norm_hosts = []
    for h in hosts:
        n = normalize_host(h)
        problem = host_pattern_problem(n)
        if problem:
            errs.append(problem)
        elif n not in norm_hosts:
            norm_hosts.append(n)
    ports = m.get("ports", [443])
    if (not isinstance(ports, list) or not ports
            or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)):
        errs.append("match.ports must be a non-empty list of ports 1-65535")
        ports = []
    methods = m.get("methods")
    if methods is not None:
        if (not isinstance(methods, list) or not methods
                or not all(isinstance(x, str) and _METHOD.fullmatch(x.upper()) for x in methods)):
            errs.append("match.methods must be a non-empty list of HTTP methods or absent")
            methods = None
        else:
            methods = tuple(sorted({x.upper() for x in methods}))
    prefixes = m.get("path_prefixes")
    if prefixes is not None:
        if (not isinstance(prefixes, list) or not prefixes
                or not all(isinstance(p, str) and _path_prefix_ok(p) for p in prefixes)):
            errs.append("match.path_prefixes must be a non-empty list of paths starting with '/' "
                        "(no '..', '.', '%', '?', '#', '\\' or control characters) or absent")
            prefixes = None
        else:
            prefixes = tuple(sorted(set(prefixes)))
    plaintext = m.get("allow_plaintext", False)
    if not isinstance(plaintext, bool):
        errs.append("match.allow_plaintext must be true or false")
        plaintext = False
    return Match(hosts=tuple(norm_hosts), ports=tuple(sorted(set(ports))), methods=methods,
                 path_prefixes=prefixes, allow_plaintext=plaintext)


def _path_prefix_ok(p: str) -> bool:
    if not p.startswith("/") or not p.isascii() or any(c in p for c in "%?#\\") or not p.isprintable():
        return False
    return not any(seg in (".", "..") for seg in p.split("/"))


def _parse_inject(inj: Any, errs: list[str]) -> dict | None:
    if not isinstance(inj, dict) or inj.get("type") not in _INJECT_KEYS:
        errs.append("inject must be an object with type header, query or basic")
        return None
    kind = inj["type"]
    unknown = set(inj) - _INJECT_KEYS[kind]
    if unknown:
        errs.append(f"unknown inject keys for type {kind}: {sorted(unknown)}")
    if kind == "header":
        name = inj.get("name", "Authorization")
        fmt = inj.get("format", "{secret}")
        if not isinstance(name, str) or not name:
            errs.append("inject.name must be a header name")
        elif name.startswith(":"):
            errs.append(f"inject.name {name!r}: pseudo-headers cannot be injected")
        elif not _TOKEN.fullmatch(name):
            errs.append(f"inject.name {name!r} is not a valid header name")
        elif name.lower() in FORBIDDEN_HEADERS or name.lower().startswith("proxy-"):
            errs.append(f"inject.name {name!r} is a framing/hop-by-hop/routing header; refused")
        if not isinstance(fmt, str) or fmt.count("{secret}") != 1:
            errs.append("inject.format must contain exactly one '{secret}'")
        elif not _VISIBLE.fullmatch(fmt):
            errs.append("inject.format may only contain printable ASCII, space and tab")
        return {"type": "header", "name": name, "format": fmt}
    if kind == "query":
        name = inj.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-~]{1,64}", name):
            errs.append("inject.name must be a query parameter name ([A-Za-z0-9_.-~], 1-64 chars)")
        return {"type": "query", "name": name}
    user = inj.get("username")
    if not isinstance(user, str) or not user or ":" in user or not _VISIBLE.fullmatch(user) or "\t" in user:
        errs.append("inject.username must be a non-empty printable string without ':'")
    return {"type": "basic", "username": user}


# ---------------------------------------------------------------------------
# admission: overlap and host policy

def admission_problems(new: Binding, existing: Iterable[Binding],
                       host_policy_check: HostPolicyCheck | None) -> list[str]:
    """Why `new` may not be added next to `existing` (empty list = fine)."""
    errs = []
    for b in existing:
        if b.id == new.id:
            errs.append(f"binding id {new.id!r} exists already")
        elif b.tenant == new.tenant and overlaps_equally(b.match, new.match):
            errs.append(f"ambiguous: overlaps binding {b.id!r} at equal specificity "
                        "(same host pattern, port, method set and path prefix)")
    if host_policy_check is not None:
        for host in new.match.hosts:
            reason = host_policy_check(new.tenant, host)
            if reason:
                errs.append(f"host {host!r} is not allowed by any policy of tenant "
                            f"{new.tenant!r}: {reason}")
    return errs


def overlaps_equally(a: Match, b: Match) -> bool:
    """True if some request is matched by both with the same specificity.

    Equal host specificity needs the same pattern; equal path specificity needs
    a shared prefix (the longest match is then that prefix for both); equal
    method specificity needs both 'any' or intersecting lists.
    """
    if not set(a.hosts) & set(b.hosts) or not set(a.ports) & set(b.ports):
        return False
    if (a.methods is None) != (b.methods is None):
        return False
    if a.methods is not None and not set(a.methods) & set(b.methods):
        return False
    if (a.path_prefixes is None) != (b.path_prefixes is None):
        # "any path" (length 0) vs a prefix: a request outside the prefixes is matched only by one
        return False
    if a.path_prefixes is not None and not set(a.path_prefixes) & set(b.path_prefixes):
        return False
    return True


# ---------------------------------------------------------------------------
# request matching

def host_specificity(pattern: str, host: str) -> int | None:
    """None if no match; exact match ranks above every wildcard, longer suffix above shorter."""
    if pattern.startswith("*."):
        suffix = pattern[1:]  # ".example.com"
        if host.endswith(suffix) and len(host) > len(suffix):
            return len(suffix)
        return None
    return 10_000 if host == pattern else None


def clean_path(path: str) -> str | None:
    """Path without query, or None if it hides its real target: dot segments (also with ;params,
    which Tomcat/Spring drop: "/v1/..;/admin" is /admin), encoded '/' or '.', or a '#' (never in a
    request target; the whole target goes upstream, and a server may resolve "/v1/#/../x" to /x)."""
    path = path.split("?", 1)[0]     # (what follows is not read: Vault.resolve caches on the rest)
    if not path.startswith("/") or "#" in path:
        return None
    low = path.lower()
    if "\\" in path or "%2e" in low or "%2f" in low or "%5c" in low or "%00" in low:
        return None
    if any(seg.split(";", 1)[0] in (".", "..") for seg in path.split("/")):
        return None
    return path


def path_specificity(prefixes: tuple[str, ...] | None, path: str | None) -> int | None:
    if prefixes is None:
        return 0
    if path is None:
        return None
    best = None
    for p in prefixes:
        # segment-aware: "/v1" matches "/v1" and "/v1/x", never "/v10"
        if path == p or (path.startswith(p) and (p.endswith("/") or path[len(p)] == "/")):
            best = max(best or 0, len(p) + 1)
    return best


def match_host_port(bindings: Iterable[Binding], host: str, port: int) -> list[Binding]:
    host = normalize_host(host)
    return [b for b in bindings if port in b.match.ports
            and any(host_specificity(p, host) is not None for p in b.match.hosts)]


def select(bindings: Iterable[Binding], *, host: str, port: int, method: str, path: str) -> Binding | None:
    """Most specific binding matching the request (scheme is checked by the caller).

    Raises AmbiguousBinding when two bindings tie at the best specificity.
    """
    host = normalize_host(host)
    method = method.upper()
    cpath = clean_path(path)
    scored: list[tuple[tuple[int, int, int], Binding]] = []
    for b in bindings:
        m = b.match
        if port not in m.ports:
            continue
        hs = max((s for s in (host_specificity(p, host) for p in m.hosts) if s is not None), default=None)
        if hs is None:
            continue
        if m.methods is not None and method not in m.methods:
            continue
        ps = path_specificity(m.path_prefixes, cpath)
        if ps is None:
            continue
        scored.append(((hs, ps, 0 if m.methods is None else 1), b))
    if not scored:
        return None
    scored.sort(key=lambda t: t[0], reverse=True)
    if len(scored) > 1 and scored[0][0] == scored[1][0]:
        ids = sorted(b.id for s, b in scored if s == scored[0][0])
        raise AmbiguousBinding(f"bindings {ids} match this request equally; nothing injected")
    return scored[0][1]
