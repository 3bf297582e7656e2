"""Import shape: every CLI module imports on its own, cubegate's modules have no import cycle,
and the packages keep the import rules (design.md: who may use whom)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLI_MODULES = ["cubegate.cli", "cubegate.sandbox_cli", "cubegate.cli_context", "vault.cli", "egress.audit.cli"]
# package -> packages of ours it may import (vault: egress only through `import vault` / `from vault import`)
# (httpkit: the shared HTTP kit, importable by every package that serves HTTP; checked by its own tests)
# (walmark: the SQLite change mark, a leaf every package with a shared SQLite file may use)
ALLOWED = {"httpkit": set(), "walmark": set(), "vault": {"httpkit", "walmark"}, "cubevs": set(),
           "egress": {"vault", "httpkit", "walmark"}, "sandbox_runtime": {"cubevs"},
           "cubegate": {"vault", "cubevs", "egress", "sandbox_runtime", "cubegate", "testbed", "httpkit", "walmark"}}
OURS = set(ALLOWED) | {"testbed", "httpkit", "walmark"}


@pytest.mark.parametrize("module", CLI_MODULES)
def test_cli_module_imports_alone_in_a_fresh_interpreter(module):
    r = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr


def _imports(path: Path, module_level_only: bool, from_names: bool = True) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file (or only those run at import time);
    `from a import b` gives a and (from_names) a.b, which may be a module."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.module, node.lineno)]
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names] if from_names else []
    return out


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_cubegate_has_no_module_level_import_cycle():
    mods = {_module_name(p): p for p in (REPO / "cubegate").glob("*.py")}
    graph = {m: {i for i, _ in _imports(p, module_level_only=True) if i in mods and i != m} for m, p in mods.items()}
    seen, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in seen:
            return
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()
        seen.add(m)
    for m in sorted(graph):
        visit(m)


def test_sandbox_cli_does_not_import_the_command_tree():
    assert "cubegate.cli" not in {i for i, _ in _imports(REPO / "cubegate" / "sandbox_cli.py", False)}


def test_packages_keep_the_import_rules():
    bad = []
    for pkg, allowed in ALLOWED.items():
        for path in (REPO / pkg).rglob("*.py"):
            for name, line in _imports(path, module_level_only=False, from_names=False):
                top = name.split(".")[0]
                if top not in OURS or top == pkg:
                    continue
                if top not in allowed:
                    bad.append(f"{path.relative_to(REPO)}:{line}: {pkg} imports {name}")
                elif pkg == "egress" and top == "vault" and name != "vault":
                    bad.append(f"{path.relative_to(REPO)}:{line}: egress reaches into {name} (public API only)")
    assert not bad, "\n".join(bad)
