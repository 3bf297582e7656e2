"""resolve_scope: under which wildcard a name may resolve (the DNS new-name limit's key)."""
import pytest

POLICY = """
name: scopes
default: deny
rules:
  - name: gh
    action: allow
    match: {hosts: ["*.github.test", api.github.test], ports: [443]}
  - name: deep
    action: allow
    match: {hosts: ["*.raw.github.test"], paths: [/x]}
  - name: no-evil-posts
    action: deny
    match: {hosts: ["*.evil.github.test"], methods: [POST]}
  - name: exact-only
    action: allow
    match: {hosts: [pkg.test]}
"""

CASES = [
    ("api.github.test", None),                         # exact host rule: not limited
    ("API.GitHub.test.", None),
    ("data1.github.test", "*.github.test"),
    ("a.b.c.github.test", "*.github.test"),
    ("x.raw.github.test", "*.raw.github.test"),        # most specific allowing wildcard
    ("x.evil.github.test", "*.github.test"),           # a (partial) deny wildcard never is the scope
]


@pytest.mark.parametrize("name, scope", CASES)
def test_resolve_scope(load, name, scope):
    ps = load(POLICY)
    assert ps.name_may_resolve("s", {}, name)
    assert ps.resolve_scope("s", {}, name) == scope


def test_default_allow_and_hostless_rules_share_one_scope(load):
    ps = load("name: open\ndefault: allow\n")
    assert ps.resolve_scope("s", {}, "anything.test") == "*"
    ps = load("name: r\nmode: report\ndefault: deny\n")
    assert ps.resolve_scope("s", {}, "anything.test") == "*"
    ps = load("name: h\ndefault: deny\nrules:\n  - {name: all443, action: allow, match: {ports: [443]}}\n")
    assert ps.name_may_resolve("s", {}, "x.test") and ps.resolve_scope("s", {}, "x.test") == "*"
