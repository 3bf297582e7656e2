"""Read policy YAML into model objects, keeping file:line for every error.

We walk ``yaml.compose`` node trees (SafeLoader) instead of loaded dicts so
every complaint can point at a line, and so duplicate keys and aliases (which
``safe_load`` silently accepts) can be refused.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Iterable
from pathlib import Path

import yaml

from .compiled import CompiledPolicySet
from .errors import ErrorItem, PolicyError
from .hosts import HostPattern, InvalidHost, InvalidPath, normalize_path, parse_cidr, parse_host_pattern
from .model import (
    ACTIONS,
    ALLOW,
    DENY,
    ENFORCE,
    METHODS,
    MODES,
    SCHEMES,
    AppliesTo,
    GlobalDenies,
    Match,
    Policy,
    Rule,
)

_STR = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_TYPE_NAMES = {
    _STR: "a string",
    _INT: "a number",
    "tag:yaml.org,2002:bool": "true/false",
    "tag:yaml.org,2002:null": "empty (null)",
    "tag:yaml.org,2002:float": "a decimal number",
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")

POLICY_KEYS = ("name", "applies_to", "mode", "default", "tenant", "rules", "egress", "description")
FILE_KEYS = ("global", "policies")
RULE_KEYS = ("name", "action", "match", "description")
MATCH_KEYS = ("hosts", "cidrs", "ports", "schemes", "methods", "paths")
SEED_KEYS = ("allowed_domains", "denied_domains")
GLOBAL_KEYS = ("denied_domains", "denied_cidrs")
APPLIES_KEYS = ("sandboxes", "labels")


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return _TYPE_NAMES.get(node.tag, node.tag)


def _join(base: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{base}[{key}]"
    return f"{base}.{key}" if base else key


class _Reader:
    """Typed accessors over YAML nodes that record errors instead of raising."""

    def __init__(self, file: str):
        self.file = file
        self.errors: list[ErrorItem] = []
        self._seen: set[int] = set()

    def err(self, node: yaml.Node | None, field: str, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 0
        self.errors.append(ErrorItem(self.file, line, field, message))

    def line(self, node: yaml.Node) -> int:
        return node.start_mark.line + 1

    def _visit(self, node: yaml.Node, field: str) -> bool:
        # An alias is the same node object reached twice: refuse (also stops
        # "billion laughs" expansion).
        if id(node) in self._seen:
            self.err(node, field, "YAML anchors/aliases are not supported in policy files; write the value out")
            return False
        self._seen.add(id(node))
        return True

    def mapping(self, node: yaml.Node, field: str, allowed: Iterable[str]) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
        if not self._visit(node, field):
            return None
        if not isinstance(node, yaml.MappingNode):
            self.err(node, field or "(top level)", f"expected a mapping (key: value), got {_describe(node)}")
            return None
        if not isinstance(allowed, _AnyKey):
            allowed = tuple(allowed)
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for knode, vnode in node.value:
            if not isinstance(knode, yaml.ScalarNode) or knode.tag != _STR:
                self.err(knode, field or "(top level)", f"keys must be plain names, got {_describe(knode)}")
                continue
            key = knode.value
            kfield = _join(field, key)
            if key in out:
                self.err(knode, kfield, f"duplicate key (first given at line {self.line(out[key][0])})")
                continue
            if key not in allowed:
                self.err(knode, kfield, f"unknown key {key!r}; expected one of: {', '.join(allowed)}")
                continue
            out[key] = (knode, vnode)
        return out

    def seq(self, node: yaml.Node, field: str, *, allow_empty: bool = False) -> list[yaml.Node] | None:
        if not self._visit(node, field):
            return None
        if not isinstance(node, yaml.SequenceNode):
            self.err(node, field, f"expected a list, got {_describe(node)}")
            return None
        if not node.value and not allow_empty:
            self.err(node, field, "empty list matches nothing; leave the key out to match anything")
            return None
        return list(node.value)

    def string(self, node: yaml.Node, field: str, *, what: str = "a string") -> str | None:
        if not self._visit(node, field):
            return None
        if not isinstance(node, yaml.ScalarNode) or node.tag != _STR:
            hint = " (quote it)" if isinstance(node, yaml.ScalarNode) else ""
            self.err(node, field, f"expected {what}, got {_describe(node)}{hint}")
            return None
        return node.value

    def integer(self, node: yaml.Node, field: str) -> int | None:
        if not self._visit(node, field):
            return None
        if not isinstance(node, yaml.ScalarNode) or node.tag != _INT:
            self.err(node, field, f"expected a whole number, got {_describe(node)}")
            return None
        try:
            return int(node.value.replace("_", ""), 0)
        except ValueError:
            self.err(node, field, f"not a number: {node.value!r}")
            return None

    def choice(self, node: yaml.Node, field: str, choices: Iterable[str], *, fold=str.lower) -> str | None:
        choices = tuple(choices)
        value = self.string(node, field, what=f"one of {', '.join(choices)}")
        if value is None:
            return None
        folded = fold(value)
        if folded not in choices:
            self.err(node, field, f"{value!r} is not one of: {', '.join(choices)}")
            return None
        return folded


def _host_patterns(r: _Reader, node: yaml.Node, field: str) -> list[tuple[HostPattern, yaml.Node]]:
    items = r.seq(node, field)
    out: list[tuple[HostPattern, yaml.Node]] = []
    for i, item in enumerate(items or ()):
        text = r.string(item, _join(field, i), what="a host name string")
        if text is None:
            continue
        try:
            out.append((parse_host_pattern(text), item))
        except InvalidHost as exc:
            r.err(item, _join(field, i), f"{text!r}: {exc}")
    return out


def _cidrs(r: _Reader, node: yaml.Node, field: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    out = []
    for i, item in enumerate(r.seq(node, field) or ()):
        text = r.string(item, _join(field, i), what="a CIDR string like 198.18.0.0/24")
        if text is None:
            continue
        try:
            out.append(parse_cidr(text.strip()))   # mapped IPv6 → IPv4, as requests are
        except ValueError as exc:
            hint = ""
            try:
                hint = f" (did you mean {ipaddress.ip_network(text.strip(), strict=False)}?)"
            except ValueError:
                pass
            r.err(item, _join(field, i), f"{text!r} is not a valid CIDR: {exc}{hint}")
    return out


def _match(r: _Reader, node: yaml.Node, field: str) -> Match | None:
    m = r.mapping(node, field, MATCH_KEYS)
    if m is None:
        return None
    if not m:
        r.err(node, field, "match is empty; use the policy's `default:` for a catch-all")
        return None
    hosts = tuple(p for p, _ in _host_patterns(r, m["hosts"][1], _join(field, "hosts"))) if "hosts" in m else ()
    cidrs = tuple(_cidrs(r, m["cidrs"][1], _join(field, "cidrs"))) if "cidrs" in m else ()
    ports = schemes = methods = None
    paths = None
    if "ports" in m:
        f = _join(field, "ports")
        vals = []
        for i, item in enumerate(r.seq(m["ports"][1], f) or ()):
            port = r.integer(item, _join(f, i))
            if port is None:
                continue
            if not 0 < port < 65536:
                r.err(item, _join(f, i), f"port {port} is out of range 1-65535")
                continue
            vals.append(port)
        ports = frozenset(vals)
    if "schemes" in m:
        f = _join(field, "schemes")
        schemes = frozenset(
            s for i, item in enumerate(r.seq(m["schemes"][1], f) or ())
            if (s := r.choice(item, _join(f, i), SCHEMES)) is not None
        )
    if "methods" in m:
        f = _join(field, "methods")
        methods = frozenset(
            s for i, item in enumerate(r.seq(m["methods"][1], f) or ())
            if (s := r.choice(item, _join(f, i), METHODS, fold=str.upper)) is not None
        )
    if "paths" in m:
        f = _join(field, "paths")
        vals = []
        for i, item in enumerate(r.seq(m["paths"][1], f) or ()):
            text = r.string(item, _join(f, i), what="a path string starting with '/'")
            if text is None:
                continue
            if not text.startswith("/"):
                r.err(item, _join(f, i), f"{text!r}: paths must start with '/'")
                continue
            if "?" in text or "#" in text:
                r.err(item, _join(f, i), f"{text!r}: query strings and fragments cannot be matched; give a path prefix")
                continue
            try:
                vals.append(normalize_path(text))
            except InvalidPath as exc:
                r.err(item, _join(f, i), f"{text!r}: {exc}")
        paths = tuple(dict.fromkeys(vals))
    return Match(hosts=tuple(dict.fromkeys(hosts)), cidrs=tuple(dict.fromkeys(cidrs)),
                 ports=ports, schemes=schemes, methods=methods, paths=paths)


def _rules(r: _Reader, node: yaml.Node, field: str) -> list[Rule]:
    out: list[Rule] = []
    for i, item in enumerate(r.seq(node, field, allow_empty=True) or ()):
        f = _join(field, i)
        m = r.mapping(item, f, RULE_KEYS)
        if m is None:
            continue
        ok = True
        for req in ("name", "action", "match"):
            if req not in m:
                r.err(item, f, f"rule is missing {req!r}")
                ok = False
        name = action = match = None
        if "name" in m:
            name = r.string(m["name"][1], _join(f, "name"))
            if name is not None and not _NAME_RE.match(name):
                r.err(m["name"][1], _join(f, "name"), f"{name!r}: use letters, digits, '-', '_', '.', ':' (max 128)")
                name = None
        if "action" in m:
            action = r.choice(m["action"][1], _join(f, "action"), ACTIONS)
        if "match" in m:
            match = _match(r, m["match"][1], _join(f, "match"))
        if "description" in m:
            r.string(m["description"][1], _join(f, "description"))
        if ok and name and action and match:
            out.append(Rule(name=name, action=action, match=match, file=r.file, line=r.line(item)))
    return out


def _seed_rules(r: _Reader, node: yaml.Node, field: str) -> list[Rule]:
    """The seed shape: allowed_domains -> allow rules, denied_domains -> deny
    rules; "*" in denied_domains is the (already implied) default deny."""
    m = r.mapping(node, field, SEED_KEYS)
    if m is None:
        return []
    out: list[Rule] = []
    seen: dict[str, int] = {}
    for key, action in (("allowed_domains", ALLOW), ("denied_domains", DENY)):
        if key not in m:
            continue
        f = _join(field, key)
        for i, item in enumerate(r.seq(m[key][1], f, allow_empty=True) or ()):
            text = r.string(item, _join(f, i), what="a domain string")
            if text is None:
                continue
            if text.strip() == "*" and action == DENY:
                continue  # "deny everything else" == default deny
            try:
                pattern = parse_host_pattern(text)
            except InvalidHost as exc:
                r.err(item, _join(f, i), f"{text!r}: {exc}")
                continue
            rule_name = f"{key.split('_')[0]}:{pattern}"
            if rule_name in seen:
                r.err(item, _join(f, i), f"{pattern} is listed twice (first at line {seen[rule_name]})")
                continue
            seen[rule_name] = r.line(item)
            out.append(Rule(name=rule_name, action=action, match=Match(hosts=(pattern,)),
                            file=r.file, line=r.line(item)))
    return out


def _applies_to(r: _Reader, node: yaml.Node, field: str) -> AppliesTo | None:
    m = r.mapping(node, field, APPLIES_KEYS)
    if m is None:
        return None
    sandboxes: list[str] = []
    labels: dict[str, str] = {}
    if "sandboxes" in m:
        f = _join(field, "sandboxes")
        for i, item in enumerate(r.seq(m["sandboxes"][1], f) or ()):
            s = r.string(item, _join(f, i), what="a sandbox id string")
            if s:
                sandboxes.append(s)
    if "labels" in m:
        f = _join(field, "labels")
        lm = r.mapping(m["labels"][1], f, allowed=_AnyKey())
        for key, (_, vnode) in (lm or {}).items():
            v = r.string(vnode, _join(f, key), what="a string label value")
            if v is not None:
                labels[key] = v
        if lm is not None and not lm:
            r.err(m["labels"][1], f, "empty labels would select every sandbox; omit applies_to for a default policy")
    if not m:
        r.err(node, field, "applies_to is empty; give sandboxes and/or labels, or omit it for the default policy")
        return None
    return AppliesTo(sandboxes=frozenset(sandboxes), labels=tuple(sorted(labels.items())))


class _AnyKey(tuple):
    """`allowed` for free-form mappings (labels)."""

    def __new__(cls):
        return super().__new__(cls, ())

    def __contains__(self, item) -> bool:
        return True


def _policy(r: _Reader, m: dict, node: yaml.Node, field: str, default_name: str | None) -> Policy | None:
    nerr = len(r.errors)
    name = default_name
    line = r.line(node)
    if "name" in m:
        line = r.line(m["name"][0])
        name = r.string(m["name"][1], _join(field, "name"))
        if name is not None and not _NAME_RE.match(name):
            r.err(m["name"][1], _join(field, "name"), f"{name!r}: use letters, digits, '-', '_', '.', ':' (max 128)")
    elif default_name is None:
        r.err(node, field, "policy is missing 'name'")
    applies = _applies_to(r, m["applies_to"][1], _join(field, "applies_to")) if "applies_to" in m else None
    mode = r.choice(m["mode"][1], _join(field, "mode"), MODES) if "mode" in m else ENFORCE
    default = r.choice(m["default"][1], _join(field, "default"), ACTIONS) if "default" in m else DENY
    tenant = r.string(m["tenant"][1], _join(field, "tenant")) if "tenant" in m else None
    if "description" in m:
        r.string(m["description"][1], _join(field, "description"))
    if "egress" in m and ("rules" in m or "default" in m):
        other = "rules" if "rules" in m else "default"
        r.err(m[other][0], _join(field, other),
              "a policy uses either the seed form (egress: allowed_domains/denied_domains) or rules/default, not both")
    rules: list[Rule] = []
    if "egress" in m:
        rules = _seed_rules(r, m["egress"][1], _join(field, "egress"))
    if "rules" in m:
        rules = _rules(r, m["rules"][1], _join(field, "rules"))
    _check_rules(r, rules, field)
    if len(r.errors) != nerr or name is None:
        return None
    return Policy(name=name, rules=tuple(rules), default=default, mode=mode, tenant=tenant,
                  applies_to=applies, file=r.file, line=line)


def _check_rules(r: _Reader, rules: list[Rule], field: str) -> None:
    by_name: dict[str, Rule] = {}
    by_match: dict[tuple, Rule] = {}
    for idx, rule in enumerate(rules):
        f = _join(_join(field, "rules"), idx) if not rule.name.startswith(("allowed:", "denied:")) else _join(field, "egress")
        first = by_name.get(rule.name)
        if first is not None:
            r.errors.append(ErrorItem(r.file, rule.line, _join(f, "name"),
                                      f"duplicate rule name {rule.name!r} (first used at line {first.line})"))
        else:
            by_name[rule.name] = rule
        key = rule.match.key()
        other = by_match.get(key)
        if other is not None and other.action != rule.action:
            r.errors.append(ErrorItem(
                r.file, rule.line, f,
                f"rule {rule.name!r} ({rule.action}, line {rule.line}) has exactly the same match as rule "
                f"{other.name!r} ({other.action}, line {other.line}); they conflict - remove one or narrow its match"))
        elif other is None:
            by_match[key] = rule


def _global(r: _Reader, node: yaml.Node, field: str) -> GlobalDenies:
    m = r.mapping(node, field, GLOBAL_KEYS)
    if m is None:
        return GlobalDenies()
    domains = _host_patterns(r, m["denied_domains"][1], _join(field, "denied_domains")) if "denied_domains" in m else []
    cidrs = _cidrs(r, m["denied_cidrs"][1], _join(field, "denied_cidrs")) if "denied_cidrs" in m else []
    return GlobalDenies(domains=tuple(p for p, _ in domains), cidrs=tuple(cidrs))


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases where they appear (no shared nodes, no
    "billion laughs"); policies are small enough to write out."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not supported in policy files", event.start_mark)
        return super().compose_node(parent, index)


def _yaml_error(file: str, exc: yaml.YAMLError) -> ErrorItem:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line = mark.line + 1 if mark is not None else 1
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    msg = f"invalid YAML: {problem}" + (f" ({context})" if context else "")
    if "alias" in problem or "alias" in (context or ""):
        msg += ' - wildcard hosts must be quoted: "*.example.com"'
    elif "tab" in problem.lower() or "\\t" in problem:
        msg += " - indent with spaces, not tabs"
    return ErrorItem(file, line, "", msg)


def _compose(text: str, file: str) -> yaml.Node | None:
    """The node tree, or PolicyError: bad YAML, an alias, or nesting deeper than PyYAML's
    recursive composer can go (a few thousand "[" would otherwise be a RecursionError)."""
    try:
        return yaml.compose(text, Loader=_NoAliasLoader)
    except yaml.YAMLError as exc:
        raise PolicyError(_yaml_error(file, exc)) from None
    except RecursionError:
        raise PolicyError(ErrorItem(file, 1, "", "nested too deeply (a policy is a few levels deep)")) from None


def parse_policy_text(text: str, file: str) -> tuple[list[Policy], GlobalDenies]:
    """Parse one file's text. Raises PolicyError listing every problem found."""
    r = _Reader(file)
    root = _compose(text, file)
    if root is None:
        raise PolicyError(ErrorItem(file, 1, "", "file is empty; expected a policy (name, rules, ...) or a global: section"))
    top = r.mapping(root, "", POLICY_KEYS + FILE_KEYS)
    if top is None:
        raise PolicyError(r.errors)
    policies: list[Policy] = []
    policy_keys = {k: v for k, v in top.items() if k in POLICY_KEYS}
    if "policies" in top:
        if policy_keys:
            first = next(iter(policy_keys.values()))[0]
            r.err(first, next(iter(policy_keys)),
                  "with a policies: list, put every policy's keys inside its list entry")
        for i, item in enumerate(r.seq(top["policies"][1], "policies") or ()):
            f = _join("policies", i)
            m = r.mapping(item, f, POLICY_KEYS)
            if m is not None:
                p = _policy(r, m, item, f, None)
                if p:
                    policies.append(p)
    elif policy_keys:
        p = _policy(r, policy_keys, root, "", Path(file).stem)
        if p:
            policies.append(p)
    elif "global" not in top:
        r.err(root, "(top level)", "no policy here: expected name/rules/egress, a policies: list, or global:")
    globals_ = _global(r, top["global"][1], "global") if "global" in top else GlobalDenies()
    if r.errors:
        raise PolicyError(r.errors)
    return policies, globals_


def parse_policy_document(text: str, source: str, *, name: str) -> Policy:
    """One policy given on its own (the policy API): the keys of a single-policy file, no
    ``global:`` or ``policies:``; ``name`` is the document's name (a ``name:`` key must agree).
    JSON is YAML, so a JSON body gets the same checks and messages as a file.
    Raises PolicyError (fields turn into JSON pointers with PolicyError.pointers())."""
    r = _Reader(source)
    root = _compose(text, source)
    if root is None:
        raise PolicyError(ErrorItem(source, 1, "", "body is empty; expected a policy (rules, default, ...)"))
    top = r.mapping(root, "", POLICY_KEYS)
    if top is None:
        raise PolicyError(r.errors)
    if "name" in top and isinstance(top["name"][1], yaml.ScalarNode) and top["name"][1].value != name:
        r.err(top["name"][1], "name", f"{top['name'][1].value!r} differs from the policy's name {name!r}")
    if not _NAME_RE.match(name):
        r.err(root, "name", f"{name!r}: use letters, digits, '-', '_', '.', ':' (max 128)")
    policy = _policy(r, top, root, "", name)
    if r.errors or policy is None:
        raise PolicyError(r.errors)
    return policy


def load_policy_files(paths: Iterable[str | os.PathLike]) -> CompiledPolicySet:
    """Load, validate and compile the given files (in the given order).
    Raises PolicyError with every problem in every file."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise PolicyError(ErrorItem("<none>", 0, "", "no policy files given"))
    errors: list[ErrorItem] = []
    policies: list[Policy] = []
    domains: list[HostPattern] = []
    cidrs: list = []
    digest = hashlib.sha256()
    for path in paths:
        file = str(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            errors.append(ErrorItem(file, 0, "", f"cannot read: {exc.strerror or exc}"))
            continue
        digest.update(path.name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            errors.append(ErrorItem(file, line, "", "file is not valid UTF-8"))
            continue
        try:
            ps, g = parse_policy_text(text, file)
        except PolicyError as exc:
            errors.extend(exc.items)
            continue
        policies.extend(ps)
        domains.extend(g.domains)
        cidrs.extend(g.cidrs)
    if errors:
        raise PolicyError(errors)
    return CompiledPolicySet(
        policies,
        GlobalDenies(domains=tuple(domains), cidrs=tuple(cidrs)),
        digest=digest.hexdigest(),
        sources=tuple(str(p) for p in paths),
    )


def policy_files_in(path: str | os.PathLike) -> list[Path]:
    """The files a policy directory contributes: *.yaml and *.yml, sorted, no dotfiles."""
    d = Path(path)
    return sorted(p for p in d.iterdir()
                  if p.suffix in (".yaml", ".yml") and not p.name.startswith(".") and p.is_file())


def load_policy_dir(path: str | os.PathLike) -> CompiledPolicySet:
    """Load every *.yaml / *.yml file in ``path`` (sorted by name)."""
    try:
        files = policy_files_in(path)
    except OSError as exc:
        raise PolicyError(ErrorItem(str(path), 0, "", f"cannot list policy directory: {exc.strerror or exc}")) from None
    if not files:
        raise PolicyError(ErrorItem(str(path), 0, "", "no policy files (*.yaml, *.yml) in this directory"))
    return load_policy_files(files)
