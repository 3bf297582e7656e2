"""Learn mode (issue #13 item 5): the smallest allow policy for report mode's would-deny records."""
import json

import pytest
import yaml

from cubegate.suggest import parse_duration, suggest_policy
from egress.policy import parse_policy_document
from egress.policy.compiled import CompiledPolicySet
from egress.policy.model import RequestInfo


def rec(host, port=443, would_deny=True):
    return {"event": "decision", "host": host, "port": port, "would_deny": would_deny, "decision": "allow"}


RECORDS = [rec("api.openai.com"), rec("api.openai.com"), rec("pypi.org"), rec("files.pythonhosted.org"),
           rec("a.cdn.example.com"), rec("b.cdn.example.com"), rec("c.cdn.example.com"), rec("d.cdn.example.com"),
           rec("x.y.cdn.example.com", 8443), rec("github.com", 22), rec("github.com", 443),
           rec("198.18.0.10", 443), rec("allowed.example.org", would_deny=False)]


def test_exact_hosts_and_wildcards_only_for_many_siblings():
    doc = suggest_policy(RECORDS, sandbox="sb-1", min_siblings=4)
    hosts = {r["match"]["hosts"][0] if "hosts" in r["match"] else r["match"]["cidrs"][0]: r["match"]["ports"]
             for r in doc["rules"]}
    assert hosts == {"api.openai.com": [443], "pypi.org": [443], "files.pythonhosted.org": [443],
                     "*.cdn.example.com": [443, 8443], "github.com": [22, 443], "198.18.0.10/32": [443]}
    assert doc["applies_to"] == {"sandboxes": ["sb-1"]} and doc["default"] == "deny"
    assert "allowed.example.org" not in json.dumps(doc)          # it was allowed: nothing to learn


def test_few_siblings_stay_exact_and_tlds_never_fold():
    doc = suggest_policy([rec(f"h{i}.example.com") for i in range(3)] + [rec(f"n{i}.com") for i in range(9)],
                         label=("team", "a"), min_siblings=4)
    hosts = sorted(r["match"]["hosts"][0] for r in doc["rules"])
    assert hosts == sorted([f"h{i}.example.com" for i in range(3)] + [f"n{i}.com" for i in range(9)])
    assert doc["applies_to"] == {"labels": {"team": "a"}}


def test_the_suggestion_is_a_valid_policy_that_allows_exactly_what_was_seen():
    doc = suggest_policy(RECORDS, sandbox="sb-1")
    policy = parse_policy_document(yaml.safe_dump(doc), "suggest", name=doc["name"])
    ps = CompiledPolicySet([policy])
    for r in RECORDS:
        if r["would_deny"]:
            ip = r["host"][0].isdigit()
            assert ps.decide(RequestInfo("sb-1", {}, r["host"], r["port"], is_ip_literal=ip)).allowed, r
    assert not ps.decide(RequestInfo("sb-1", {}, "evil.com", 443)).allowed
    assert not ps.decide(RequestInfo("sb-1", {}, "api.openai.com", 80)).allowed


@pytest.mark.parametrize("text,seconds", [("30m", 1800), ("1h", 3600), ("2d", 172800), ("10s", 10)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds
    with pytest.raises(ValueError):
        parse_duration("soon")
