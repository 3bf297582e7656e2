"""The shipped example policies load and behave as the demo expects."""

from pathlib import Path

import pytest

from egress.policy import load_policy_dir, load_policy_files
from policy_testlib import req

POLICIES = Path(__file__).resolve().parents[2] / "policies"


def test_policies_dir_loads_together():
    ps = load_policy_dir(POLICIES)
    assert {p.name for p in ps.policies} >= {"seed", "demo-default"}
    assert len(ps.digest) == 64


@pytest.mark.parametrize("host, port, action, reason, inspect", [
    ("api.allowed.test", 443, "allow", "rule_allow", False),
    ("api.allowed.test", 80, "allow", "rule_allow", False),
    ("passthrough.allowed.test", 443, "allow", "rule_allow", False),
    ("x.github.test", 443, "allow", "rule_allow", False),
    ("a.b.github.test", 443, "allow", "rule_allow", False),
    ("github.test", 443, "deny", "default_deny", False),
    ("blocked.test", 443, "deny", "rule_deny", False),
    ("denied.test", 443, "deny", "rule_deny", False),
    ("other.allowed.test", 443, "deny", "default_deny", False),
    ("metadata.google.internal", 80, "deny", "global_deny", False),
    ("198.18.0.10", 443, "allow", "rule_allow", False),
    ("10.0.0.1", 443, "deny", "ip_literal_not_allowed", False),
])
def test_example_policy_for_demo(host, port, action, reason, inspect):
    ps = load_policy_files([POLICIES / "example.yaml"])
    d = ps.decide(req(host, port))
    assert (d.action, d.reason, d.needs_inspection) == (action, reason, inspect)
    if d.reason != "global_deny":
        assert d.policy == "demo-default" and d.tenant == "demo"


def test_seed_file_is_the_seed_shape():
    ps = load_policy_dir(POLICIES)
    labels = {"policy": "seed"}
    assert ps.policy_for("sb", labels).name == "seed"
    assert ps.decide(req("api.openai.com", labels=labels)).action == "allow"
    assert ps.decide(req("api.github.com", labels=labels)).action == "allow"
    assert ps.decide(req("api.allowed.test", labels=labels)).reason == "default_deny"
