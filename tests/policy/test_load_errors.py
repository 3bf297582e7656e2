"""Every malformed input is refused with FILE:LINE: field.path: message."""

import re

import pytest

from egress.policy import PolicyError, load_policy_dir, load_policy_files
from policy_testlib import write

RULE = "rules:\n  - name: r\n    action: allow\n"

# (yaml text, line, field, message fragment)
CASES = [
    # broken YAML
    ("name: a\nrules: [\n  {name: x\n", 4, None, "invalid YAML"),
    ("name: a\nrules:\n  - name: r\n    action: allow\n    match: {hosts: [*.github.com]}\n", 5, None,
     'wildcard hosts must be quoted'),
    ("name: a\n\tdefault: deny\n", 2, None, "invalid YAML"),
    ("name: a\n---\nname: b\n", 2, None, "invalid YAML"),
    ("", 1, None, "file is empty"),
    ("# only a comment\n", 1, None, "file is empty"),
    ("- a\n- b\n", 1, "(top level)", "expected a mapping"),
    ("just text\n", 1, "(top level)", "expected a mapping"),
    # unknown / duplicate keys
    ("name: a\ndefualt: deny\n", 2, "defualt", "unknown key 'defualt'"),
    ("name: a\nrules:\n  - name: r\n    action: allow\n    match: {host: [a.test]}\n", 5, "rules[0].match.host",
     "unknown key 'host'; expected one of: hosts"),
    ("name: a\nrules:\n  - name: r\n    actoin: allow\n    match: {hosts: [a.test]}\n", 4, "rules[0].actoin", "unknown key"),
    ("name: a\nname: b\n", 2, "name", "duplicate key (first given at line 1)"),
    ("name: a\nrules:\n  - name: r\n    action: allow\n    action: deny\n    match: {hosts: [a.test]}\n", 5,
     "rules[0].action", "duplicate key"),
    ("name: a\nglobal: {denied_domains: [a.test], oops: 1}\n", 2, "global.oops", "unknown key"),
    ("name: a\napplies_to: {sandbox: [x]}\n", 2, "applies_to.sandbox", "unknown key"),
    ("egress: {allowed_domains: [a.test], blocked: [b.test]}\n", 1, "egress.blocked", "unknown key"),
    # aliases / merge keys
    ("name: a\nx: &h [a.test]\n", 2, "x", "unknown key"),
    ("name: a\nrules:\n  - name: r\n    action: allow\n    match: {hosts: [*github.com]}\n", 5, None,
     "wildcard hosts must be quoted"),
    ("name: a\nrules:\n  - name: r\n    action: allow\n    match: {hosts: &h [a.test]}\n  - name: s\n    action: allow\n"
     "    match: {hosts: *h}\n", 8, None, "aliases (*h) are not supported"),
    # wrong types
    ("name: 5\n", 1, "name", "expected a string, got a number"),
    ("name: a\nrules: {name: r}\n", 2, "rules", "expected a list, got a mapping"),
    ("name: a\nrules:\n  - just-a-string\n", 3, "rules[0]", "expected a mapping"),
    ("name: a\nmode: strict\n", 2, "mode", "'strict' is not one of: enforce, report"),
    ("name: a\ndefault: block\n", 2, "default", "not one of: allow, deny"),
    ("name: a\ndefault: no\n", 2, "default", "got true/false"),
    ("name: a\ntenant: [x]\n", 2, "tenant", "expected a string, got a list"),
    ("name: a\napplies_to: {labels: {team: yes}}\n", 2, "applies_to.labels.team", "got true/false (quote it)"),
    ("name: a\napplies_to: {labels: {team: 1}}\n", 2, "applies_to.labels.team", "got a number (quote it)"),
    ("name: a\napplies_to: {}\n", 2, "applies_to", "applies_to is empty"),
    ("name: a\napplies_to: {labels: {}}\n", 2, "applies_to.labels", "empty labels"),
    ("name: a\napplies_to: {sandboxes: []}\n", 2, "applies_to.sandboxes", "empty list"),
    ("name: 'has space'\n", 1, "name", "use letters"),
    # rules: missing fields, bad match
    ("name: a\nrules:\n  - name: r\n    match: {hosts: [a.test]}\n", 3, "rules[0]", "missing 'action'"),
    ("name: a\nrules:\n  - action: allow\n    match: {hosts: [a.test]}\n", 3, "rules[0]", "missing 'name'"),
    (f"name: a\n{RULE}", 3, "rules[0]", "missing 'match'"),
    (f"name: a\n{RULE}    match: {{}}\n", 5, "rules[0].match", "match is empty"),
    (f"name: a\n{RULE}    match: {{hosts: []}}\n", 5, "rules[0].match.hosts", "empty list"),
    (f"name: a\n{RULE}    match: {{hosts: a.test}}\n", 5, "rules[0].match.hosts", "expected a list, got a string"),
    ("name: a\nrules:\n  - name: r\n    action: permit\n    match: {hosts: [a.test]}\n", 4, "rules[0].action",
     "'permit' is not one of: allow, deny"),
    # malformed host patterns
    (f"name: a\n{RULE}    match: {{hosts: [ok.test, 'api.*.x.com']}}\n", 5, "rules[0].match.hosts[1]", "leftmost label"),
    (f"name: a\n{RULE}    match: {{hosts: ['*x.com']}}\n", 5, "rules[0].match.hosts[0]", "whole label"),
    (f"name: a\n{RULE}    match: {{hosts: ['example.*']}}\n", 5, "rules[0].match.hosts[0]", "leftmost label"),
    (f"name: a\n{RULE}    match: {{hosts: ['**.x.com']}}\n", 5, "rules[0].match.hosts[0]", '"**" is not supported'),
    (f"name: a\n{RULE}    match: {{hosts: ['']}}\n", 5, "rules[0].match.hosts[0]", "empty host pattern"),
    (f"name: a\n{RULE}    match: {{hosts: ['*']}}\n", 5, "rules[0].match.hosts[0]", 'bare "*"'),
    (f"name: a\n{RULE}    match: {{hosts: [a..b.com]}}\n", 5, "rules[0].match.hosts[0]", "empty label"),
    (f"name: a\n{RULE}    match: {{hosts: ['a.com:443']}}\n", 5, "rules[0].match.hosts[0]", "match.ports"),
    (f"name: a\n{RULE}    match: {{hosts: [10.0.0.1]}}\n", 5, "rules[0].match.hosts[0]", "match.cidrs"),
    (f"name: a\n{RULE}    match: {{hosts: [https://a.com]}}\n", 5, "rules[0].match.hosts[0]", "not a URL"),
    (f"name: a\n{RULE}    match: {{hosts: [1]}}\n", 5, "rules[0].match.hosts[0]", "got a number"),
    ("egress: {allowed_domains: ['*']}\n", 1, "egress.allowed_domains[0]", 'bare "*"'),
    ("egress: {allowed_domains: ['*.a.test', '*.A.test.']}\n", 1, "egress.allowed_domains[1]", "listed twice"),
    ("global: {denied_domains: ['*']}\n", 1, "global.denied_domains[0]", 'bare "*"'),
    ("global: {denied_domains: ['bad.*']}\n", 1, "global.denied_domains[0]", "leftmost label"),
    # ports
    (f"name: a\n{RULE}    match: {{hosts: [a.test], ports: [0]}}\n", 5, "rules[0].match.ports[0]", "out of range"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], ports: [65536]}}\n", 5, "rules[0].match.ports[0]", "out of range"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], ports: ['443']}}\n", 5, "rules[0].match.ports[0]", "whole number"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], ports: [44.3]}}\n", 5, "rules[0].match.ports[0]", "whole number"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], ports: [true]}}\n", 5, "rules[0].match.ports[0]", "whole number"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], ports: 443}}\n", 5, "rules[0].match.ports", "expected a list"),
    # CIDRs
    (f"name: a\n{RULE}    match: {{cidrs: [10.0.0.1/8]}}\n", 5, "rules[0].match.cidrs[0]", "did you mean 10.0.0.0/8"),
    (f"name: a\n{RULE}    match: {{cidrs: [10.0.0.0/33]}}\n", 5, "rules[0].match.cidrs[0]", "not a valid CIDR"),
    (f"name: a\n{RULE}    match: {{cidrs: [not-a-net]}}\n", 5, "rules[0].match.cidrs[0]", "not a valid CIDR"),
    ("global: {denied_cidrs: ['fd00::1/8']}\n", 1, "global.denied_cidrs[0]", "did you mean"),
    # methods, schemes, paths
    (f"name: a\n{RULE}    match: {{hosts: [a.test], methods: [FETCH]}}\n", 5, "rules[0].match.methods[0]",
     "'FETCH' is not one of: GET"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], schemes: [ftp]}}\n", 5, "rules[0].match.schemes[0]",
     "'ftp' is not one of: http, https"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], paths: [v1/]}}\n", 5, "rules[0].match.paths[0]", "must start with '/'"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], paths: ['/a?x=1']}}\n", 5, "rules[0].match.paths[0]", "query strings"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], paths: ['/a/%2Fb']}}\n", 5, "rules[0].match.paths[0]", "encoded"),
    (f"name: a\n{RULE}    match: {{hosts: [a.test], paths: ['/..']}}\n", 5, "rules[0].match.paths[0]", "above the root"),
    # duplicates and conflicts inside one policy
    ("name: a\nrules:\n  - {name: r, action: allow, match: {hosts: [a.test]}}\n"
     "  - {name: r, action: allow, match: {hosts: [b.test]}}\n", 4, "rules[1].name",
     "duplicate rule name 'r' (first used at line 3)"),
    ("name: a\nrules:\n  - {name: r, action: allow, match: {hosts: [a.test, b.test], ports: [443]}}\n"
     "  - {name: s, action: deny, match: {ports: [443], hosts: [B.test, a.test.]}}\n", 4, "rules[1]",
     "rule 's' (deny, line 4) has exactly the same match as rule 'r' (allow, line 3)"),
    ("egress: {allowed_domains: [a.test], denied_domains: [A.test]}\n", 1, "egress", "same match"),
    # seed + rich mixed; structure
    ("egress: {allowed_domains: [a.test]}\nrules: []\n", 2, "rules", "either the seed form"),
    ("policies:\n  - {name: a}\nname: b\n", 3, "name", "inside its list entry"),
    ("policies:\n  - {default: deny}\n", 2, "policies[0]", "missing 'name'"),
    ("policies:\n  - {name: a, rulez: []}\n", 2, "policies[0].rulez", "unknown key"),
]


def _assert_error(err: PolicyError, fname: str, line: int, field: str | None, fragment: str):
    text = str(err)
    field_re = re.escape(field) + ": " if field else ""
    pattern = rf"(^|\n)[^\n]*/{re.escape(fname)}:{line}: {field_re}[^\n]*{re.escape(fragment)}"
    assert re.search(pattern, text), f"expected {fname}:{line}: {field}: ...{fragment}... in:\n{text}"


@pytest.mark.parametrize("text, line, field, fragment", CASES, ids=[f"{i}-{c[3][:30]}" for i, c in enumerate(CASES)])
def test_malformed(tmp_path, text, line, field, fragment):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as ei:
        load_policy_files([path])
    _assert_error(ei.value, "p.yaml", line, field, fragment)
    for item in ei.value.items:  # every item is positioned
        assert item.file.endswith("p.yaml") and item.line >= 1


def test_all_errors_in_a_file_are_reported(tmp_path):
    path = write(tmp_path, "p.yaml", """
    name: a
    mode: loud
    rules:
      - name: r
        action: allow
        match: {hosts: ['api.*.x.com'], ports: [0]}
    """)
    with pytest.raises(PolicyError) as ei:
        load_policy_files([path])
    lines = str(ei.value).splitlines()
    assert len(lines) == 3
    _assert_error(ei.value, "p.yaml", 2, "mode", "'loud'")
    _assert_error(ei.value, "p.yaml", 6, "rules[0].match.hosts[0]", "leftmost label")
    _assert_error(ei.value, "p.yaml", 6, "rules[0].match.ports[0]", "out of range")


def test_duplicate_policy_names_across_files(tmp_path):
    write(tmp_path, "a.yaml", "name: same\napplies_to: {sandboxes: [x]}\n")
    write(tmp_path, "b.yaml", "# comment\nname: same\napplies_to: {sandboxes: [y]}\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    _assert_error(ei.value, "b.yaml", 2, "name", "policy name 'same' is already used at ")
    assert "a.yaml:1" in str(ei.value)


def test_two_default_policies(tmp_path):
    write(tmp_path, "a.yaml", "name: one\n")
    write(tmp_path, "b.yaml", "name: two\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    _assert_error(ei.value, "b.yaml", 1, "applies_to", "default policy")


def test_file_stems_name_unnamed_policies(tmp_path):
    write(tmp_path, "a.yaml", "egress: {allowed_domains: [a.test]}\n")
    write(tmp_path, "b.yaml", "egress: {allowed_domains: [b.test]}\napplies_to: {sandboxes: [sb]}\n")
    ps = load_policy_dir(tmp_path)
    assert sorted(p.name for p in ps.policies) == ["a", "b"]


def test_same_sandbox_in_two_policies(tmp_path):
    write(tmp_path, "a.yaml", "name: one\napplies_to: {sandboxes: [sb-1]}\n")
    write(tmp_path, "b.yaml", "# c\n# c\nname: two\napplies_to: {sandboxes: [sb-2, sb-1]}\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    _assert_error(ei.value, "b.yaml", 3, "applies_to.sandboxes", "sandbox 'sb-1' is already selected by policy 'one'")


def test_identical_label_selectors(tmp_path):
    write(tmp_path, "a.yaml", "name: one\napplies_to: {labels: {team: r, env: p}}\n")
    write(tmp_path, "b.yaml", "name: two\napplies_to: {labels: {env: p, team: r}}\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    _assert_error(ei.value, "b.yaml", 1, "applies_to.labels", "selects exactly the same labels")


def test_errors_from_several_files(tmp_path):
    write(tmp_path, "a.yaml", "name: a\nmode: x\n")
    write(tmp_path, "b.yml", "name: b\nfoo: 1\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_dir(tmp_path)
    _assert_error(ei.value, "a.yaml", 2, "mode", "not one of")
    _assert_error(ei.value, "b.yml", 2, "foo", "unknown key")


def test_non_utf8_file(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_bytes(b"name: a\ntenant: \xff\xfe\n")
    with pytest.raises(PolicyError) as ei:
        load_policy_files([path])
    _assert_error(ei.value, "p.yaml", 2, None, "not valid UTF-8")


def test_empty_dir_and_missing_file(tmp_path):
    with pytest.raises(PolicyError, match="no policy files"):
        load_policy_dir(tmp_path)
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy_files([tmp_path / "missing.yaml"])
    with pytest.raises(PolicyError, match="cannot list"):
        load_policy_dir(tmp_path / "nope")


def test_alias_bomb_is_refused_quickly(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 12):
        lines.append(f"a{i}: &a{i} [*a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}, *a{i-1}]")
    path = tmp_path / "p.yaml"
    path.write_text("global:\n  denied_domains: [a.test]\n" + "\n".join(lines) + "\n")
    with pytest.raises(PolicyError):
        load_policy_files([path])
