"""The policy in force from files + the versioned API store: versions, rollback, restart,
broken bodies refused with a JSON pointer and nothing changed, files vs API precedence."""
import json

import pytest

from egress.policy import PolicyError, PolicyStore
from egress.policy.live import LivePolicies, NotFound, Refused
from egress.policy.repo import PolicyRepo
from policy_testlib import req, write

FILE = """
name: base
default: deny
rules:
  - {name: api, action: allow, match: {hosts: [api.x.test], ports: [443]}}
"""
TEAM = {"name": "team", "applies_to": {"labels": {"team": "a"}}, "default": "deny",
        "rules": [{"name": "gh", "action": "allow", "match": {"hosts": ["*.gh.test"]}}]}


@pytest.fixture
def live(tmp_path):
    (tmp_path / "p").mkdir()
    write(tmp_path / "p", "base.yaml", FILE)

    def open_():
        return LivePolicies(PolicyStore(tmp_path / "p"), PolicyRepo(tmp_path / "policies.db"))
    lp = open_()
    lp.reopen = open_
    return lp


def test_put_takes_effect_at_once_and_is_versioned(live):
    seen = []
    live.on_change(lambda old, new: seen.append((old.digest, new.digest)))
    assert not live.current.decide(req("a.gh.test", labels={"team": "a"})).allowed
    v1 = live.put_policy("team", json.dumps(TEAM), actor="alice")
    assert (v1.version, v1.action, v1.actor) == (1, "create", "alice")
    d = live.current.decide(req("a.gh.test", labels={"team": "a"}))
    assert (d.allowed, d.policy) == (True, "team")
    v2 = live.put_policy("team", "name: team\napplies_to: {labels: {team: a}}\ndefault: deny\nrules: []\n",
                         actor="bob")
    assert (v2.version, v2.action) == (2, "replace")
    assert not live.current.decide(req("a.gh.test", labels={"team": "a"})).allowed
    assert len(seen) == 2 and seen[0][1] != seen[1][1]
    assert [v.version for v in live.history("policy", "team")] == [2, 1]


def test_rollback_and_restart_keep_every_version(live):
    live.put_policy("team", json.dumps(TEAM), actor="a")
    live.put_policy("team", json.dumps({**TEAM, "rules": []}), actor="b")
    v3 = live.rollback("team", 1, actor="c")
    assert (v3.version, v3.action, v3.note) == (3, "rollback", "to version 1")
    assert live.current.decide(req("a.gh.test", labels={"team": "a"})).allowed
    live.delete_policy("team", actor="d")
    assert not live.current.decide(req("a.gh.test", labels={"team": "a"})).allowed
    again = live.reopen()
    assert [(v.version, v.action, v.actor) for v in again.history("policy", "team")] == \
        [(4, "delete", "d"), (3, "rollback", "c"), (2, "replace", "b"), (1, "create", "a")]
    assert not again.current.decide(req("a.gh.test", labels={"team": "a"})).allowed
    again.rollback("team", 3, actor="e")
    assert live.reopen().current.decide(req("a.gh.test", labels={"team": "a"})).allowed


@pytest.mark.parametrize("body,pointer,words", [
    ('{"default": "deny", "rules": [{"name": "r", "action": "allow", "match": {"hosts": ["api.*.x.test"]}}]}',
     "/rules/0/match/hosts/0", "leftmost label"),
    ('{"default": "maybe"}', "/default", "not one of"),
    ('{"rules": [{"name": "r", "action": "allow", "match": {"ports": ["443"]}}]}', "/rules/0/match/ports/0",
     "whole number"),
    ('{"colour": "red"}', "/colour", "unknown key"),
    ('{"name": "other"}', "/name", "differs"),
    ('{"applies_to": {"sandboxes": ["sb-1"]}, "rules": [], "default": "deny", "default": "allow"}', "/default",
     "duplicate"),
    ('{"rules": [', "", "invalid YAML"),
])
def test_broken_body_refused_with_pointer_and_nothing_changes(live, body, pointer, words):
    before = live.digest
    with pytest.raises(PolicyError) as e:
        live.put_policy("team", body, actor="x")
    errs = e.value.pointers()
    assert errs[0]["pointer"] == pointer and words in errs[0]["message"], errs
    assert live.digest == before and live.repo.head() == 0


def test_a_set_conflict_is_refused_like_a_file_conflict(live):
    live.put_policy("one", json.dumps({"applies_to": {"sandboxes": ["sb-1"]}, "rules": []}), actor="a")
    with pytest.raises(PolicyError) as e:
        live.put_policy("two", json.dumps({"applies_to": {"sandboxes": ["sb-1"]}, "rules": []}), actor="a")
    assert e.value.pointers()[0]["pointer"] == "/applies_to/sandboxes"
    with pytest.raises(PolicyError):   # a second default policy
        live.put_policy("three", json.dumps({"rules": []}), actor="a")


def test_api_policy_replaces_the_file_policy_of_the_same_name(live):
    assert live.describe("base")["source"] == "file"
    live.put_policy("base", json.dumps({"default": "deny", "rules": [
        {"name": "other", "action": "allow", "match": {"hosts": ["other.test"]}}]}), actor="a")
    d = live.describe("base")
    assert d["source"] == "api" and d["overrides_file"].endswith("base.yaml")
    assert live.current.decide(req("other.test")).allowed and not live.current.decide(req("api.x.test")).allowed
    live.delete_policy("base", actor="a")
    assert live.current.decide(req("api.x.test")).allowed and live.describe("base")["source"] == "file"
    with pytest.raises(Refused):
        live.delete_policy("base", actor="a")
    with pytest.raises(NotFound):
        live.delete_policy("nope", actor="a")


def test_grants_and_networks_are_versioned_and_expire(live):
    live.put_grant("grant.r1", {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"], "ports": [443],
                                "expires": 100.0}, actor="admin")
    live.set_network("sb-1", {"deny": ["api.x.test"]}, actor="runtime")
    assert live.current.decide(req("new.test"), now=50.0).reason == "grant_allow"     # before its expiry
    assert live.current.decide(req("new.test")).reason == "default_deny"              # now: long expired
    assert live.current.decide(req("api.x.test")).reason == "sandbox_network_deny"
    again = live.reopen()
    assert again.current.decide(req("new.test"), now=50.0).reason == "grant_allow"
    assert again.expire_grants(99.0) == [] and again.expire_grants(100.0) == ["grant.r1"]
    assert not again.current.decide(req("new.test"), now=50.0).allowed              # swept: gone
    assert again.history("grant", "grant.r1")[0].action == "expire"
    again.remove_network("sb-1", actor="runtime")
    assert again.current.decide(req("api.x.test")).allowed


def test_file_reload_still_works_and_a_conflict_keeps_the_old_set(live, tmp_path):
    live.put_policy("one", json.dumps({"applies_to": {"sandboxes": ["sb-1"]}, "rules": []}), actor="a")
    write(tmp_path / "p", "more.yaml", "name: more\napplies_to: {sandboxes: [sb-2]}\nrules: []\n")
    assert live.reload().ok and live.current.policy("more") is not None
    before = live.digest
    write(tmp_path / "p", "clash.yaml", "name: clash\napplies_to: {sandboxes: [sb-1]}\nrules: []\n")
    res = live.reload()
    assert not res.ok and "sb-1" in res.error and live.digest == before
