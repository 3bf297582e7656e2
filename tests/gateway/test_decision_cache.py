"""The fast path's decision cache never serves a stale allow.

Against a real LivePolicies (policy files + the versioned API store): every policy change, grant,
grant deletion (revocation), network option and identity label change is seen by the very next
decision; a grant's expiry is seen at the expiry instant, with no sweep and no swap in between.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from egress.destination import DecisionCache
from egress.policy import RequestInfo, load_policy_files
from egress.policy.effective import EffectivePolicy
from egress.policy.grants import GrantIndex, parse_grant
from egress.policy.live import LivePolicies
from egress.policy.reload import PolicyStore
from egress.policy.repo import PolicyRepo

ADMIN = """\
name: base
default: deny
rules:
  - {name: api, action: allow, match: {hosts: [api.x.test], ports: [443]}}
"""


def req(host, port=443, *, sb="sb-1", labels=None, **kw):
    return RequestInfo(sandbox_id=sb, labels=labels or {}, host=host, port=port, **kw)


@pytest.fixture
def live(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "base.yaml").write_text(ADMIN)
    repo = PolicyRepo(tmp_path / "policies.db")
    yield LivePolicies(PolicyStore(tmp_path / "p"), repo)
    repo.close()


def decide(cache, live, r):
    """The cached decision, checked against the uncached one of the same policy object."""
    got = cache.decide(live.current, r)
    assert got == live.current.decide(r)
    return got


def test_repeated_decisions_are_answered_from_the_cache(live):
    cache = DecisionCache()
    first = decide(cache, live, req("api.x.test"))
    assert first.allowed
    assert cache.decide(live.current, req("api.x.test")) is first   # the same object: not decided again
    assert not decide(cache, live, req("api.x.test", 8443)).allowed  # port is part of the key
    assert decide(cache, live, req("api.x.test", sb="sb-2")).allowed           # so is the sandbox
    assert len(cache._entries) == 3


def test_a_policy_change_takes_effect_at_once(live):
    cache = DecisionCache()
    assert decide(cache, live, req("new.x.test")).reason == "default_deny"
    live.put_policy("base2", json.dumps({"name": "base2", "applies_to": {"sandboxes": ["sb-1"]}, "default": "deny",
                                         "rules": [{"name": "n", "action": "allow",
                                                    "match": {"hosts": ["new.x.test"]}}]}), actor="t")
    assert decide(cache, live, req("new.x.test")).allowed
    live.delete_policy("base2", actor="t")
    assert not decide(cache, live, req("new.x.test")).allowed
    # the file policy changes under it too (a hot reload)
    live.put_policy("base", ADMIN.replace("action: allow", "action: deny"), actor="t")
    assert not decide(cache, live, req("api.x.test")).allowed


def test_a_grant_and_its_revocation_take_effect_at_once(live):
    cache = DecisionCache()
    assert not decide(cache, live, req("new.test")).allowed
    live.put_grant("g", {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"]}, actor="t")
    assert decide(cache, live, req("new.test")).reason == "grant_allow"
    live.delete_grant("g", actor="t", action="revoke")
    assert decide(cache, live, req("new.test")).reason == "default_deny"


def test_network_options_narrow_at_once(live):
    cache = DecisionCache()
    assert decide(cache, live, req("api.x.test")).allowed
    live.set_network("sb-1", {"deny": ["api.x.test"]}, actor="runtime")
    assert decide(cache, live, req("api.x.test")).reason == "sandbox_network_deny"
    live.remove_network("sb-1", actor="runtime")
    assert decide(cache, live, req("api.x.test")).allowed


def test_identity_labels_are_part_of_the_key(live):
    cache = DecisionCache()
    live.put_policy("team", json.dumps({"name": "team", "applies_to": {"labels": {"team": "a"}}, "default": "deny",
                                        "rules": [{"name": "gh", "action": "allow",
                                                   "match": {"hosts": ["*.gh.test"]}}]}), actor="t")
    assert decide(cache, live, req("a.gh.test", sb="sb-9", labels={"team": "a"})).allowed
    assert not decide(cache, live, req("a.gh.test", sb="sb-9", labels={"team": "b"})).allowed  # re-labelled
    assert not decide(cache, live, req("a.gh.test", sb="sb-9")).allowed


def test_a_grant_expiry_is_seen_at_the_instant_without_any_swap(tmp_path):
    (tmp_path / "a.yaml").write_text(ADMIN)
    admin = load_policy_files([tmp_path / "a.yaml"])
    now = [100.0]
    grants = GrantIndex([parse_grant("soon", {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["new.test"],
                                              "expires": 110.0}),
                         parse_grant("later", {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["other.test"],
                                               "expires": 200.0}),
                         parse_grant("gone", {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["old.test"],
                                              "expires": 50.0})])
    policy = EffectivePolicy(admin, grants, clock=lambda: now[0])
    cache = DecisionCache()
    assert cache.decide(policy, req("new.test")).reason == "grant_allow"
    assert cache.decide(policy, req("other.test")).reason == "grant_allow"
    assert cache.decide(policy, req("old.test")).reason == "default_deny"
    now[0] = 109.999
    assert cache.decide(policy, req("new.test")).reason == "grant_allow"
    now[0] = 110.0                                        # the expiry instant: not in force any more
    assert cache.decide(policy, req("new.test")).reason == "default_deny"
    assert cache.decide(policy, req("other.test")).reason == "grant_allow"
    now[0] = 200.0
    assert cache.decide(policy, req("other.test")).reason == "default_deny"
    now[0] = 150.0                                        # a clock that steps back: never a stale allow
    assert cache.decide(policy, req("new.test")).reason == "default_deny"


def test_request_stage_decisions_are_not_cached(live):
    cache = DecisionCache()
    r = req("api.x.test", scheme="https", method="GET", path="/")
    assert decide(cache, live, r).allowed
    assert cache._entries == {}


def test_the_cache_is_bounded(live, monkeypatch):
    monkeypatch.setattr(DecisionCache, "MAX_ENTRIES", 8)
    cache = DecisionCache()
    for i in range(20):
        decide(cache, live, req(f"h{i}.test"))
        assert len(cache._entries) <= 8
