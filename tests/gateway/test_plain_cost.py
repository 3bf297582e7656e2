"""What the plain-HTTP path's per-request savings must not change (issue #11, plain keep-alive cost).

- RequestDecisionCache (egress/fastpath/request_decisions.py): a cached request-stage decision is
  the decision the policy object in force makes for that request, on generated policies, grants
  (with expiries), network options, sandboxes, labels and requests, with the clock moving and
  the policy object swapped in between (hypothesis).
- ResponseReader (egress/fastpath/http1.py), one per upstream connection: llhttp's parser is kept
  only when llhttp itself ended the last response, so a HEAD response's Content-Length never
  makes the next response a body, and bytes after a response are still an error.
- RequestHead.by_name / names: the same values, in order, as a scan of the headers.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from egress.fastpath import http1
from egress.fastpath.request_decisions import MAX_PATH, RequestDecisionCache
from egress.policy import RequestInfo, load_policy_files
from egress.policy.effective import EffectivePolicy
from egress.policy.errors import PolicyError
from egress.policy.grants import GrantIndex, parse_grant
from egress.policy.network import parse_network

HOSTS = ["api.x.test", "a.gh.test", "b.gh.test", "other.test", "10.1.2.3"]
PATTERNS = ["api.x.test", "*.gh.test", "other.test", "b.gh.test"]
PATHS = ["/", "/admin", "/admin/users", "/api/v1?q=1", "/a" * 200]
METHODS = ["GET", "POST", "DELETE"]

_rule = st.fixed_dictionaries(
    {"action": st.sampled_from(["allow", "deny"]),
     "match": st.fixed_dictionaries(
         {"hosts": st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=2, unique=True)},
         optional={"ports": st.lists(st.sampled_from([80, 443, 8080]), min_size=1, max_size=2, unique=True),
                   "methods": st.lists(st.sampled_from(METHODS), min_size=1, max_size=2, unique=True),
                   "paths": st.lists(st.sampled_from(["/admin", "/api", "/"]), min_size=1, max_size=2,
                                     unique=True)})})
_policy = st.fixed_dictionaries({"mode": st.sampled_from(["enforce", "report"]),
                                 "default": st.sampled_from(["allow", "deny"]),
                                 "rules": st.lists(_rule, max_size=5)})
_grant = st.fixed_dictionaries({"applies_to": st.just({"sandboxes": ["sb-1"]}),
                                "hosts": st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=2, unique=True),
                                "expires": st.sampled_from([105.0, 120.0, 150.0])})
_request = st.tuples(st.sampled_from(["sb-1", "sb-2"]), st.sampled_from([(), (("team", "a"),)]),
                     st.sampled_from(HOSTS), st.sampled_from([80, 443]), st.sampled_from(METHODS),
                     st.sampled_from(PATHS))
# a step: how far the clock moves, whether the policy object is swapped for a new one, which request
# (of a few, so that requests repeat and differ in one field: the cache is hit and must tell them apart)
_step = st.tuples(st.sampled_from([0.0, 0.0, 0.0, 1.0, 7.5, 20.0, -3.0]), st.sampled_from([False] * 5 + [True]),
                  st.integers(0, 3))


def _compile(doc: dict, team_doc: dict | None):
    with tempfile.TemporaryDirectory() as d:
        files = [Path(d) / "base.yaml"]
        files[0].write_text(json.dumps({"name": "base", **_named(doc)}))
        if team_doc is not None:
            files.append(Path(d) / "team.yaml")
            files[1].write_text(json.dumps({"name": "team", "applies_to": {"labels": {"team": "a"}},
                                            **_named(team_doc)}))
        return load_policy_files(files)


def _named(doc: dict) -> dict:
    return dict(doc, rules=[dict(r, name=f"r{i}") for i, r in enumerate(doc["rules"])])


def _req(sb, labels, host, port, method, path) -> RequestInfo:
    return RequestInfo(sandbox_id=sb, labels=dict(labels), host=host, port=port, scheme="http",
                       method=method, path=path, is_ip_literal=host[0].isdigit())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_policy, team_doc=st.none() | _policy, grants=st.lists(_grant, max_size=3),
       network=st.none() | st.fixed_dictionaries({"deny": st.lists(st.sampled_from(PATTERNS), max_size=2)}),
       first=_request, changes=st.lists(st.tuples(st.integers(0, 5), _request), min_size=3, max_size=3),
       steps=st.lists(_step, min_size=1, max_size=30))
def test_a_cached_request_decision_is_the_policy_decision(doc, team_doc, grants, network, first, changes, steps):
    try:
        base = _compile(doc, team_doc)
    except PolicyError:
        assume(False)          # rules the loader refuses (two with the same match): no policy to decide with
    index = GrantIndex([parse_grant(f"g{i}", g) for i, g in enumerate(grants)])
    networks = {"sb-1": parse_network(network)} if network is not None else {}
    now = [100.0]

    def new_policy():
        return EffectivePolicy(base, index, networks, clock=lambda: now[0])

    # requests that share all fields but one with the first
    requests = [first] + [first[:i] + (r[i],) + first[i + 1:] for i, r in changes]
    policy, cache = new_policy(), RequestDecisionCache()
    for advance, swap, i in steps:
        now[0] += advance
        if swap:
            policy = new_policy()
        req = _req(*requests[i])
        assert cache.decide(policy, req) == policy.decide(req), (req, now[0])


def test_the_key_is_the_whole_request():
    base = _compile({"mode": "enforce", "default": "allow",
                     "rules": [{"action": "deny", "match": {"hosts": ["api.x.test"], "methods": ["DELETE"],
                                                             "paths": ["/admin"]}}]}, None)
    policy, cache = EffectivePolicy(base), RequestDecisionCache()
    get = _req("sb-1", (), "api.x.test", 80, "GET", "/admin")
    first = cache.decide(policy, get)
    assert first.allowed and cache.decide(policy, get) is first       # a hit: not decided again
    assert not cache.decide(policy, _req("sb-1", (), "api.x.test", 80, "DELETE", "/admin")).allowed
    assert cache.decide(policy, _req("sb-1", (), "api.x.test", 80, "DELETE", "/other")).allowed
    assert len(cache._entries) == 3
    long = _req("sb-1", (), "api.x.test", 80, "DELETE", "/admin/" + "x" * MAX_PATH)
    assert not cache.decide(policy, long).allowed and len(cache._entries) == 3   # decided, never held


def test_a_grant_expiry_ends_its_cached_allows_at_the_instant():
    base = _compile({"mode": "enforce", "default": "deny", "rules": []}, None)
    now = [100.0]
    grants = GrantIndex([parse_grant("soon", {"applies_to": {"sandboxes": ["sb-1"]}, "hosts": ["api.x.test"],
                                              "expires": 105.0})])
    policy, cache = EffectivePolicy(base, grants, clock=lambda: now[0]), RequestDecisionCache()
    req = _req("sb-1", (), "api.x.test", 80, "GET", "/")
    assert cache.decide(policy, req).reason == "grant_allow"
    now[0] = 104.999
    assert cache.decide(policy, req).reason == "grant_allow"
    now[0] = 105.0
    assert cache.decide(policy, req).reason == "default_deny"


class _Sink:
    def __init__(self):
        self.heads, self.bodies, self.ends, self.errors = [], [], [], []

    def head(self, status, reason, headers, framing):
        self.heads.append((status, framing))

    def body(self, data):
        self.bodies.append(data)

    def trailers(self, fields):
        pass

    def end(self, keep_alive):
        self.ends.append(keep_alive)

    def error(self, why):
        self.errors.append(why)


def test_keep_alive_responses_share_one_parser_only_at_a_message_boundary():
    sink = _Sink()
    reader = http1.ResponseReader(sink, max_head_bytes=8192)
    reader.begin(head_request=False).feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")
    parser = reader._parser
    reader.begin(head_request=False).feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n")
    assert reader._parser is parser                     # llhttp ended both: its keep-alive state reused
    # a HEAD response announces a body llhttp would wait for: the next response gets a new parser,
    # so these bytes are a response head, not the 10 body bytes of the HEAD response
    reader.begin(head_request=True).feed(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
    reader.begin(head_request=False).feed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nno!")
    assert reader._parser is not parser
    assert sink.heads == [(200, "length"), (200, "chunked"), (200, "none"), (404, "length")]
    assert sink.bodies == [b"hi", b"ok", b"no!"] and sink.ends == [True, True, True, True] and not sink.errors
    reader.feed(b"HTTP/1.1 200 OK\r\n")                 # nothing asked: bytes after the response
    assert sink.errors == ["bytes after the response"]
    with pytest.raises(RuntimeError):
        reader.begin(head_request=False)                 # a failed upstream connection is never reused


def test_a_response_head_bound_is_the_sum_of_its_fields():
    """Each field counts len(name) + len(value) + 4 once: 200 of 200 passes, 201 is too large."""
    for second, errors in ((95, []), (96, ["upstream response head too large"])):
        sink = _Sink()
        reader = http1.ResponseReader(sink, max_head_bytes=200)
        reader.begin(head_request=False).feed(b"HTTP/1.1 204 No Content\r\nA: " + b"v" * 95 + b"\r\nB: "
                                              + b"v" * second + b"\r\n\r\n")
        assert sink.errors == errors and sink.ends == ([] if errors else [True])


@given(st.lists(st.tuples(st.sampled_from([b"Host", b"host", b"X-A", b"x-a", b"Content-Length", b"Expect"]),
                          st.binary(max_size=5)), max_size=8))
def test_headers_by_name_are_the_scan_of_the_headers(fields):
    head = http1.RequestHead("GET", b"/", "1.1", list(fields), True, False, None)
    for name in {k.lower() for k, _ in fields} | {b"absent"}:
        assert list(head.get_all(name)) == [v for k, v in fields if k.lower() == name]
    reader = http1.RequestReader(8192)
    reader.feed(b"GET / HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nx-a: 2\r\nHOST: b\r\n\r\n")
    parsed = reader.events[0][1]
    assert parsed.names == [b"host", b"x-a", b"x-a", b"host"]
    assert parsed.get_all(b"host") == [b"a", b"b"] and parsed.get_all(b"x-a") == [b"1", b"2"]
