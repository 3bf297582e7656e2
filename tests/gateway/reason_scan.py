"""Find every refusal/decision reason the code can write, by reading its AST (no import, no run).

A reason reaches an audit record, X-Cubegate-Reason or a metric label through a few
shapes only; each is a rule here:

- a call's `reason=` keyword (audit records, make_record, dict(...));
- a positional argument in the slot of a parameter named `reason` of a function or
  class defined in the scanned tree (the deny helpers, _count, Refusal, BodyRefused,
  Decision, DestinationBlocked...): same-file definitions first, then a unique one;
- an assignment to a name `reason` / `*_reason` or to an attribute `denied_reason`
  (tuple assignments pair up element by element);
- a dict literal's "reason" or "X-Cubegate-Reason" key;
- what a few named functions return as a reason (REASON_RETURNS), and the first
  column of a few named tables (REASON_TABLES).

From each such expression: string constants, both arms of `a if c else b`, every
operand of `x or "fallback"`, `str(...)`'s argument; an f-string becomes a glob
(f"ssrf_{r}" -> "ssrf_*"). Names and attributes carry no literal: their literals were
found where they were assigned.

The SSRF guard's reasons (egress/netguard.py) are a namespace of their own: the
gateway writes them as ``ssrf_<guard reason>``, so they are reported with that prefix.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

SCANNED = ("egress", "cubegate", "vault")
PREFIX = {"egress/netguard.py": "ssrf_"}
# file -> {qualified function name: index in a returned tuple (None: the whole value)}
REASON_RETURNS = {
    "egress/policy/compiled.py": {"CompiledPolicy.evaluate": 0},
    "egress/policy/network.py": {"SandboxNetwork.verdict": 0},
    "egress/netguard.py": {"AddressGuard.check": None, "_embedded_ipv4": 0},
}
# file -> module-level tables of (reason, ...) rows
REASON_TABLES = {"egress/netguard.py": ("_IPV4_DENY", "_IPV6_DENY")}
# dict keys whose value is a reason (audit fields, response headers)
REASON_KEYS = frozenset({"reason", "x-cubegate-reason"})
# literals in a reason slot that are not reasons: (file, value) -> why
NOT_REASONS = {
    ("cubegate/console/audit_pages.py", "session ended"): "the console's live tail end-of-stream event, not a record",
}


@dataclass
class Found:
    literals: dict[str, set[str]] = field(default_factory=dict)   # reason -> {"file:line", ...}
    patterns: dict[str, set[str]] = field(default_factory=dict)   # glob -> {"file:line", ...}

    def add(self, value: str, where: str, *, pattern: bool = False) -> None:
        (self.patterns if pattern else self.literals).setdefault(value, set()).add(where)


def _reason_slot(args: ast.arguments, *, method: bool) -> int | None:
    positional = [a.arg for a in args.posonlyargs + args.args]
    if method and positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    return positional.index("reason") if "reason" in positional else None


def _slots(tree: ast.Module) -> dict[str, int]:
    """name -> positional index of its `reason` parameter, for functions, methods and classes."""
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    i = _reason_slot(item.args, method=True)
                    if i is not None:
                        out[node.name if item.name == "__init__" else item.name] = i
            fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            is_dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
            if is_dataclass and "reason" in fields:
                out[node.name] = fields.index("reason")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            i = _reason_slot(node.args, method=False)
            if i is not None:
                out.setdefault(node.name, i)
    return out


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _is_reason_target(t: ast.expr) -> bool:
    if isinstance(t, ast.Name):
        return t.id == "reason" or t.id.endswith("_reason")
    return isinstance(t, ast.Attribute) and t.attr == "denied_reason"


class _Scanner:
    def __init__(self, rel: str, tree: ast.Module, slots: dict[str, int], found: Found):
        self.rel, self.tree, self.slots, self.found = rel, tree, slots, found
        self.prefix = PREFIX.get(rel, "")

    def value(self, node: ast.AST | None) -> None:
        """Record the reason literals an expression can evaluate to."""
        if node is None:
            return
        where = f"{self.rel}:{node.lineno}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if (self.rel, node.value) in NOT_REASONS:
                return
            self.found.add(self.prefix + node.value, where)
        elif isinstance(node, ast.IfExp):
            self.value(node.body)
            self.value(node.orelse)
        elif isinstance(node, ast.BoolOp):
            for v in node.values:
                self.value(v)
        elif isinstance(node, ast.JoinedStr):
            glob = "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
            self.found.add(self.prefix + glob, where, pattern=True)
        elif isinstance(node, ast.Call) and _callee(node) == "str" and node.args:
            self.value(node.args[0])

    def run(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                self.call(node)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    self.assign(target, node.value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                self.assign(node.target, node.value)
            elif isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value.lower() in REASON_KEYS:
                        self.value(v)
        self.returns()
        self.tables()

    def call(self, node: ast.Call) -> None:
        for kw in node.keywords:
            if kw.arg == "reason":
                self.value(kw.value)
        slot = self.slots.get(_callee(node) or "")
        if slot is not None and slot < len(node.args) and not any(isinstance(a, ast.Starred) for a in node.args):
            self.value(node.args[slot])

    def assign(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self.assign(t, v)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.IfExp):
            self.assign(target, value.body)
            self.assign(target, value.orelse)
        elif _is_reason_target(target):
            self.value(value)

    def returns(self) -> None:
        wanted = REASON_RETURNS.get(self.rel, {})
        for qualname, func in _functions(self.tree):
            if qualname not in wanted:
                continue
            index = wanted[qualname]
            for node in ast.walk(func):
                if isinstance(node, ast.Return) and node.value is not None:
                    v = node.value
                    if index is not None:
                        if not isinstance(v, ast.Tuple):
                            continue
                        v = v.elts[index]
                    self.value(v)

    def tables(self) -> None:
        names = REASON_TABLES.get(self.rel, ())
        for node in self.tree.body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if isinstance(target, ast.Name) and target.id in names and isinstance(node.value, ast.Tuple):
                for row in node.value.elts:
                    if isinstance(row, ast.Tuple) and row.elts:
                        self.value(row.elts[0])


def _functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def scan(root: Path) -> Found:
    trees = {}
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            trees[path.relative_to(root).as_posix()] = ast.parse(path.read_text(), filename=str(path))
    per_file = {rel: _slots(tree) for rel, tree in trees.items()}
    everywhere: dict[str, set[int]] = {}
    for slots in per_file.values():
        for name, i in slots.items():
            everywhere.setdefault(name, set()).add(i)
    unique = {name: next(iter(ix)) for name, ix in everywhere.items() if len(ix) == 1}
    found = Found()
    for rel, tree in trees.items():
        _Scanner(rel, tree, {**unique, **per_file[rel]}, found).run()
    return found
