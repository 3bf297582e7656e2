"""One sandbox-id definition (sandbox_runtime.ids) used by the manager and both backends."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sandbox_runtime import ids

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value,ok", [
    ("a", True), ("sb-1", True), ("0", True), ("a" * 40, True),
    ("", False), ("a" * 41, False), ("-a", False), ("A", False), ("a_b", False), ("a.b", False),
    ("a/b", False), ("a b", False), ("a\n", False), (None, False), (1, False),
])
def test_sandbox_id_table(value, ok):
    assert ids.is_sandbox_id(value) is ok
    if isinstance(value, str):
        assert (re.fullmatch(f"^{ids.PATTERN}$", value) is not None) is ok   # the embeddable form agrees


def test_no_other_sandbox_id_pattern_in_the_runtime():
    """The old copies ([a-z0-9-]{1,40}, [a-z0-9][a-z0-9-]{0,39}) are gone from sandbox_runtime/."""
    found = []
    for path in (REPO / "sandbox_runtime").rglob("*.py"):
        if path.name == "ids.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.search(r"\[a-z0-9-?\]\[?a-z0-9-\]?\{(0,39|1,40)\}|\[a-z0-9-\]\{1,40\}", node.value):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value}")
    assert not found, found


def test_manager_refuses_what_the_definition_refuses():
    from sandbox_runtime.manager import CreateRequest, InvalidRequest, validate_owner
    validate_owner(CreateRequest(sandbox_id="sb-1", tenant="acme"))
    with pytest.raises(InvalidRequest, match=re.escape(ids.PATTERN)):
        validate_owner(CreateRequest(sandbox_id="-bad", tenant="acme"))
