"""Refusals are written one by one up to a budget per source and interval, the rest counted
into refusals_counted records (egress/refusal_budget.py): one sandbox flooding refused
connections cannot rotate the other sandboxes' records out of the audit log."""
from __future__ import annotations

import json
import time

import pytest

from egress.refusal_budget import OTHER, OTHER_SOURCE, RefusalBudget
from tests.gateway import rawclient

POLICY = """\
name: budget
default: deny
rules:
  - name: api
    action: allow
    match: {hosts: [api.allowed.test], ports: [443]}
"""


# ------------------------------------------------------------------ the pure rule
def test_the_first_refusals_are_written_the_rest_counted_per_reason_and_host():
    b = RefusalBudget(3)
    sb1 = ("sandbox", "sb-1")
    assert [b.admit(sb1, "default_deny", "a.test") for _ in range(5)] == [True, True, True, False, False]
    assert b.admit(sb1, "rule_deny", "b.test") is False
    assert b.admit(("sandbox", "sb-2"), "default_deny", "a.test") is True    # its own budget
    out = b.drain()
    assert list(out) == [sb1]
    assert out[sb1].written == 3 and out[sb1].counted == 3
    assert out[sb1].counts_text() == "default_deny@a.test=2,rule_deny@b.test=1"
    assert b.admit(sb1, "default_deny", "a.test") is True                  # a new interval
    assert b.drain() == {}


def test_distinct_hosts_and_sources_are_capped():
    b = RefusalBudget(0, max_sources=2, max_keys=4)
    for i in range(100):
        assert b.admit(("sandbox", "sb-1"), "default_deny", f"h{i}.test") is False
    for i in range(10):                                  # sources past the cap: counted under "*", never written
        assert b.admit(("client", f"10.0.0.{i}"), "proxy_auth_missing", None) is False
    assert b.sources == 4                                # sb-1, two client addresses (a cap per kind), "*"
    out = b.drain()
    c = out[("sandbox", "sb-1")]
    assert c.counted == 100 and len(c.by_key) == 5
    assert c.by_key[("default_deny", OTHER)] == 96           # the reason's total stays exact
    assert sum(x.counted for x in out.values()) == 110 and out[OTHER_SOURCE].counted == 8
    assert c.counts_text().startswith("default_deny@*=96,") and sum(_counts(c.counts_text()).values()) == 100


def test_client_addresses_never_crowd_sandboxes_out_of_their_own_budget():
    # A sandbox that can vary its source address (unidentified 407s are keyed by it) fills the
    # client-address cap: an identified sandbox's refusals are still written under its own name.
    b = RefusalBudget(2, max_sources=3)
    for i in range(50):
        b.admit(("client", f"10.0.0.{i}"), "proxy_auth_missing", None)
    assert [b.admit(("sandbox", "sb-2"), "default_deny", "a.test") for _ in range(3)] == [True, True, False]
    out = b.drain()
    assert out[("sandbox", "sb-2")].counted == 1
    assert out[OTHER_SOURCE].counted == 47 and b.sources == 0


def test_the_counts_text_fits_a_record_string():
    b = RefusalBudget(0, max_keys=32)
    for i in range(32):
        b.admit(("sandbox", "sb-1"), "default_deny", f"{'x' * 200}{i}.test")
    text = b.drain()[("sandbox", "sb-1")].counts_text()
    assert len(text) <= 2000 and sum(_counts(text).values()) == 32 and text.endswith(",*@*=" + text.rpartition("=")[2])
    assert _counts(text)["*@*"] > 0                                   # what did not fit, folded


def _counts(text: str) -> dict[str, int]:
    return {k: int(n) for k, _, n in (p.rpartition("=") for p in text.split(","))}


# ------------------------------------------------------------------ a real gateway
def _flood(port: int, target_of, n: int, auth: str | None) -> list[int]:
    statuses = []
    for i in range(n):
        s, head = rawclient.connect_tunnel(port, target_of(i), auth or "X-No-Auth: 1")
        s.close()
        statuses.append(rawclient.connect_status(head))
    return statuses


def _auth(gw, sb: str) -> str:
    return rawclient.auth_header(sb, gw.tokens[sb])


def _metric(gw, name: str, **labels) -> float:
    import re
    _, body = gw.ops_status("/metrics")
    total = 0.0
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", body, re.M):
        if all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _denials(recs, sb: str) -> list[dict]:
    return [r for r in recs if r.get("sandbox") == sb and r["event"] == "decision"
            and r.get("decision") == "deny" and r.get("reason") != "refusals_counted"]


def _summaries(recs, **match) -> list[dict]:
    return [r for r in recs if r.get("reason") == "refusals_counted"
            and all(r.get(k) == v for k, v in match.items())]


CAP, FLOOD, OTHER_SB = 20, 150, 10


@pytest.fixture(params=[False, True], ids=["mitmproxy", "fast_path"])
def budget_gw(request, lab, tmp_path):
    from tests.gateway.harness import Gateway
    gw = Gateway(lab, tmp_path / "gw", {"main.yaml": POLICY}, sandboxes={"sb-flood": {}, "sb-calm": {}},
                 settings_extra={"proxy": {"fast_path": request.param, "workers": 1},
                                 "audit": {"refusals_written_per_interval": CAP,
                                           "refusal_interval_seconds": 3600}})
    gw.start()
    yield gw
    gw.stop()


@pytest.mark.netns
def test_a_flood_of_refused_connects_is_counted_not_written_one_by_one(budget_gw):
    gw = budget_gw
    flood = gw.lab.call_gw(_flood, gw.proxy_port, lambda i: "denied.test:443", FLOOD, _auth(gw, "sb-flood"))
    calm = gw.lab.call_gw(_flood, gw.proxy_port, lambda i: f"calm{i}.test:443", OTHER_SB, _auth(gw, "sb-calm"))
    assert set(flood) == {403} and set(calm) == {403}
    # every refusal still counted in the metrics
    assert _metric(gw, "cubegate_decisions_total", sandbox="sb-flood", action="deny", reason="default_deny") == FLOOD
    assert _metric(gw, "cubegate_audit_refusals_counted_total") == FLOOD - CAP
    gw.wait_record(lambda r: r.get("sandbox") == "sb-calm" and r.get("host") == f"calm{OTHER_SB - 1}.test")
    gw.stop()                                            # drain writes the interval's summaries
    recs = gw.audit_records()
    assert len(_denials(recs, "sb-flood")) == CAP
    assert sorted(r["host"] for r in _denials(recs, "sb-calm")) == sorted(f"calm{i}.test" for i in range(OTHER_SB))
    closed = [r for r in recs if r.get("sandbox") == "sb-flood" and r["event"] == "connection_closed"]
    assert len(closed) <= CAP                            # a counted refusal has no closed record either
    summary, = _summaries(recs, sandbox="sb-flood")
    assert summary["decision"] == "deny" and summary["extra"]["written"] == CAP
    assert summary["extra"]["refused"] == FLOOD - CAP
    assert summary["extra"]["counts"] == f"default_deny@denied.test={FLOOD - CAP}"
    assert not _summaries(recs, sandbox="sb-calm")
    # the audit query finds the written refusals and the summary
    out = gw.cli("audit", "query", "--dir", str(gw.audit_dir), "--sandbox", "sb-flood", "--decision", "deny",
                 "--limit", "1000", "--json")
    rows = json.loads(out) if out.lstrip().startswith("[") else [json.loads(x) for x in out.splitlines() if x.strip()]
    assert sum(1 for r in rows if r.get("reason") == "default_deny" and r["event"] == "decision") == CAP
    assert [r["extra"]["refused"] for r in rows if r.get("reason") == "refusals_counted"] == [FLOOD - CAP]


@pytest.mark.netns
def test_summaries_are_written_each_interval_with_bounded_keys_per_source(lab, tmp_path):
    from tests.gateway.harness import Gateway
    cap, n, anon = 3, 80, 30
    gw = Gateway(lab, tmp_path / "gw", {"main.yaml": POLICY}, sandboxes={"sb-flood": {}},
                 settings_extra={"proxy": {"workers": 1},
                                 "audit": {"refusals_written_per_interval": cap, "refusal_interval_seconds": 1}})
    gw.start()
    try:
        started = time.monotonic()
        assert set(gw.lab.call_gw(_flood, gw.proxy_port, lambda i: f"h{i}.test:443", n,
                                  _auth(gw, "sb-flood"))) == {403}
        assert set(gw.lab.call_gw(_flood, gw.proxy_port, lambda i: "x.test:443", anon, None)) == {407}
        intervals = (time.monotonic() - started) + 2

        def accounted():
            recs = gw.audit_records()
            flood = len(_denials(recs, "sb-flood")) + sum(r["extra"]["refused"]
                                                          for r in _summaries(recs, sandbox="sb-flood"))
            unauth = [r for r in recs if r.get("reason") == "proxy_auth_missing"]
            return recs, flood, len(unauth) + sum(r["extra"]["refused"] for r in _summaries(recs, client="127.0.0.1"))
        deadline = time.monotonic() + 10
        while True:                                      # written by the interval timer, the gateway still running
            recs, flood, unauth = accounted()
            if (flood, unauth) == (n, anon) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (flood, unauth) == (n, anon)
        assert len(_denials(recs, "sb-flood")) <= cap * (intervals + 1)
        for s in _summaries(recs, sandbox="sb-flood"):
            counts = _counts(s["extra"]["counts"])
            assert len(counts) <= 33 and sum(counts.values()) == s["extra"]["refused"]   # 32 pairs, the rest "reason@*"
        assert _metric(gw, "cubegate_decisions_total", sandbox="sb-flood", action="deny") == n
    finally:
        gw.stop()


# ------------------------------------------------------------------ the soak's exact accounting
def test_soak_accounting_matches_counted_refusals_exactly():
    from tests.soak import accounting
    conns = [{"ip": f"127.0.0.{i}", "kind": "denied", "error": None, "sandbox": "sb-1", "paths": [], "acked": [],
              "connect_status": 403} for i in (1, 2, 3)]
    written = {"event": "decision", "client": "127.0.0.1:5000", "sandbox": "sb-1", "decision": "deny",
               "reason": "default_deny", "status": 403, "extra": {"kind": "denied", "closed": True}}

    def summary(n):
        return {"event": "decision", "sandbox": "sb-1", "decision": "deny", "reason": "refusals_counted",
                "extra": {"refused": n, "written": 1}}
    assert accounting.check(conns, [written, summary(2)])[0] == []
    assert accounting.check(conns, [written, summary(1)])[0]          # one refusal accounted nowhere
    assert accounting.check(conns, [written, summary(3)])[0]          # one counted too many
    assert accounting.check(conns, [written])[0]
