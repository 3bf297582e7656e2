"""Table tests of the sandbox resolver's pure accounting (cubegate.dns_accounting), the
resolver's fail-closed audit path driven through SandboxDns.handle, and the settings."""
from __future__ import annotations

import asyncio

import pytest
from dnslib import QTYPE, RCODE, DNSRecord

from cubegate.dns_accounting import FULL, KNOWN, LIMITED, NEW, AnswerAggregator, NewNameLimiter
from cubegate.sandbox_dns import SandboxDns
from cubegate.settings import SettingsError, load_settings
from egress.audit.log import AuditLog
from egress.identity import Identity
from egress.policy.compiled import CompiledPolicySet
from egress.policy.loader import parse_policy_text

# ---------------------------------------------------------------- NewNameLimiter
# (sandbox, scope, name, now) -> expected verdict, applied in order to one limiter (limit 2, window 60)
LIMITER_STEPS = [
    ("a", "*.x.test", "1.x.test", 0.0, NEW),
    ("a", "*.x.test", "1.x.test", 1.0, KNOWN),      # repeats are free
    ("a", "*.x.test", "2.x.test", 2.0, NEW),
    ("a", "*.x.test", "3.x.test", 3.0, LIMITED),    # third distinct name in the window
    ("a", "*.x.test", "1.x.test", 4.0, KNOWN),      # admitted names keep working
    ("a", "*.y.test", "3.y.test", 5.0, NEW),        # another wildcard: its own budget
    ("b", "*.x.test", "3.x.test", 6.0, NEW),        # another sandbox: its own budget
    ("a", "*.x.test", "3.x.test", 59.9, LIMITED),   # 1.x admitted at 0.0: still in its window
    ("a", "*.x.test", "3.x.test", 60.0, NEW),       # 1.x expired: room for one
    ("a", "*.x.test", "1.x.test", 61.0, LIMITED),   # 1.x is new again, and 2.x + 3.x fill the window
    ("a", "*.x.test", "4.x.test", 62.0, NEW),       # 2.x (admitted at 2.0) expired
]


def test_limiter_table():
    lim = NewNameLimiter(2, window=60.0)
    for i, (sb, scope, name, now, want) in enumerate(LIMITER_STEPS):
        assert lim.admit(sb, scope, name, now) == want, (i, sb, scope, name, now)


def test_limiter_state_is_bounded():
    lim = NewNameLimiter(3, window=60.0, max_keys=2)
    for i in range(1000):    # one key never holds more than `limit` names
        lim.admit("a", "*.x.test", f"{i}.x.test", float(i) / 1000)
    assert lim.keys == 1 and len(lim._admitted[("a", "*.x.test")]) == 3
    assert lim.admit("b", "*.x.test", "n.x.test", 1.0) == NEW
    assert lim.admit("c", "*.x.test", "n.x.test", 1.5) == FULL     # key cap: refused, not grown
    assert lim.keys == 2
    assert lim.admit("c", "*.x.test", "n.x.test", 62.0) == NEW     # expired keys swept at the cap
    assert lim.keys == 1
    lim.sweep(200.0)
    assert lim.keys == 0


@pytest.mark.parametrize("args", [(0,), (1, 0.0), (1, 60.0, 0)])
def test_limiter_rejects_nonsense(args):
    with pytest.raises(ValueError):
        NewNameLimiter(*args[:1], **dict(zip(("window", "max_keys"), args[1:])))


# ---------------------------------------------------------------- AnswerAggregator
def test_aggregator_counts_per_sandbox_and_name_then_starts_over():
    agg = AnswerAggregator()
    for sb, name, qtype, answers in [("a", "n.x.test", "A", 1), ("a", "n.x.test", "AAAA", 0),
                                     ("a", "n.x.test", "A", 1), ("a", "m.x.test", "TXT", 0),
                                     ("b", "n.x.test", "A", 2)]:
        assert agg.answered(sb, name, qtype, answers, "*.x.test")
    assert agg.limited("a", "*.x.test", "q1.x.test") is True     # first refusal: written at once
    assert agg.limited("a", "*.x.test", "q2.x.test") is False
    it = agg.drain()
    n = it.names[("a", "n.x.test")]
    assert (n.queries, n.answers, n.qtypes_text(), n.scope) == (3, 2, "A=2,AAAA=1", "*.x.test")
    assert it.names[("a", "m.x.test")].qtypes == {"TXT": 1}
    assert it.names[("b", "n.x.test")].answers == 2
    lim = it.limited[("a", "*.x.test")]
    assert (lim.refused, lim.first_name) == (2, "q1.x.test")
    assert not it.overflow
    assert not agg.drain()                                        # the next interval starts empty
    assert agg.limited("a", "*.x.test", "q3.x.test") is True      # first of the new interval


def test_aggregator_caps_keys_and_counts_overflow():
    agg = AnswerAggregator(max_keys=3)
    for i in range(10):
        agg.answered("a", f"{i}.x.test", "A", 1, "*.x.test")
    agg.answered("b", "0.x.test", "A", 1, None)
    assert agg.limited("b", "*.x.test", "z.x.test") is False       # no room: counted as overflow only
    agg.answered("a", "0.x.test", "A", 1, "*.x.test")             # a tracked key still counts
    assert agg.keys == 3
    it = agg.drain()
    assert len(it.names) == 3 and it.names[("a", "0.x.test")].queries == 2
    assert it.overflow == {"a": 7, "b": 2}


def test_aggregator_bounds_qtypes_per_name():
    agg = AnswerAggregator()
    for qt in range(100):
        agg.answered("a", "n.x.test", f"TYPE{qt}", 0, None)
    q = agg.drain().names[("a", "n.x.test")].qtypes
    assert len(q) == 9 and q["OTHER"] == 92 and sum(q.values()) == 100


# ---------------------------------------------------------------- resolver edge: fail closed
POLICY = """\
name: p
default: deny
rules:
  - name: wild
    action: allow
    match: {hosts: ["*.x.test"], ports: [443]}
  - name: exact
    action: allow
    match: {hosts: [api.x.test], ports: [443]}
"""


class _Store:
    def __init__(self, text: str):
        self.current = CompiledPolicySet(parse_policy_text(text, "p.yaml")[0])


class _OneSandbox:
    def lookup_by_ip(self, ip):
        return Identity("sb-a", {}) if ip == "10.0.0.2" else None


def _query(name: str, qtype: str = "TXT") -> bytes:
    return DNSRecord.question(name, qtype).pack()


def _dns(tmp_path, **kw) -> tuple[SandboxDns, AuditLog]:
    audit = AuditLog(tmp_path / "audit", fsync="never")
    return SandboxDns(lookup=_OneSandbox(), policies=_Store(POLICY), resolver=None, audit=audit, **kw), audit


def _rcode(reply: bytes) -> int:
    return DNSRecord.parse(reply).header.rcode


def test_limit_applies_to_wildcard_names_only_and_is_audited(tmp_path):
    async def go():
        srv, audit = _dns(tmp_path, max_new_names=2)
        rc = [_rcode(await srv.handle(_query(f"d{i}.x.test"), "10.0.0.2", 5353)) for i in range(4)]
        assert rc == [RCODE.NOERROR, RCODE.NOERROR, RCODE.NXDOMAIN, RCODE.NXDOMAIN]
        for _ in range(5):    # the exact host rule: never limited
            assert _rcode(await srv.handle(_query("api.x.test"), "10.0.0.2", 5353)) == RCODE.NOERROR
        assert await srv.flush()
        audit.close()
        return [r for r in _records(tmp_path)]
    recs = asyncio.run(go())
    first = [r for r in recs if r["reason"] == "dns_name_rate_limited" and r["host"] == "d2.x.test"]
    assert len(first) == 1 and first[0]["extra"]["scope"] == "*.x.test" and first[0]["decision"] == "deny"
    summary = [r for r in recs if r["reason"] == "dns_name_rate_limited" and r["host"] == "*.x.test"]
    assert len(summary) == 1 and summary[0]["extra"]["refused"] == 2
    allowed = {r["host"]: r["extra"] for r in recs if r["reason"] == "dns_allowed"}
    assert set(allowed) == {"d0.x.test", "d1.x.test", "api.x.test"}
    assert allowed["api.x.test"]["queries"] == 5 and allowed["api.x.test"]["scope"] is None
    assert allowed["d0.x.test"]["scope"] == "*.x.test"


def test_unwritable_audit_fails_closed(tmp_path):
    async def go():
        srv, audit = _dns(tmp_path)
        assert _rcode(await srv.handle(_query("a.x.test"), "10.0.0.2", 5353)) == RCODE.NOERROR
        audit.close()                                       # every append now fails
        assert await srv.flush() is False                   # the interval record is kept...
        assert _rcode(await srv.handle(_query("b.x.test"), "10.0.0.2", 5353)) == RCODE.SERVFAIL  # ...and nothing
        assert _rcode(await srv.handle(_query("api.x.test"), "10.0.0.2", 5353)) == RCODE.SERVFAIL  # is answered
        srv.audit = AuditLog(tmp_path / "audit", fsync="never")   # the log works again
        assert await srv.flush() is True
        assert _rcode(await srv.handle(_query("b.x.test"), "10.0.0.2", 5353)) == RCODE.NOERROR
        srv.audit.close()
    asyncio.run(go())
    assert [r["host"] for r in _records(tmp_path) if r["reason"] == "dns_allowed"] == ["a.x.test"]


def test_stop_writes_the_last_interval(tmp_path):
    async def go():
        srv, audit = _dns(tmp_path, audit_interval=3600.0)
        await srv.start("127.0.0.1", 0)                      # the hourly timer never fires here
        for _ in range(3):
            await srv.handle(_query("api.x.test", "MX"), "10.0.0.2", 5353)
        assert _records(tmp_path) == []
        await srv.stop()
        audit.close()
    asyncio.run(go())
    [rec] = _records(tmp_path)
    assert (rec["host"], rec["reason"], rec["extra"]["queries"], rec["extra"]["qtypes"]) == \
        ("api.x.test", "dns_allowed", 3, "MX=3")


def test_a_dead_audit_flusher_fails_closed(tmp_path):
    """A bug while building the interval's records kills the flusher: serve() raises (the daemon's
    supervisor names the task on /readyz) and no query is answered any more, allowed or not."""
    def broken(interval, since):
        raise RuntimeError("injected: building records failed")

    async def go():
        srv, audit = _dns(tmp_path, audit_interval=0.05)
        await srv.start("127.0.0.1", 0)
        serving = asyncio.ensure_future(srv.serve())
        assert _rcode(await srv.handle(_query("api.x.test"), "10.0.0.2", 5353)) == RCODE.NOERROR
        srv._interval_records = broken
        with pytest.raises(RuntimeError, match="audit flusher died.*injected"):
            await asyncio.wait_for(serving, timeout=10)
        for name in ("api.x.test", "d1.x.test", "denied.test"):
            assert _rcode(await srv.handle(_query(name), "10.0.0.2", 5353)) == RCODE.SERVFAIL, name
        await srv.stop()     # still stops cleanly
        audit.close()
    asyncio.run(go())
    assert [r["host"] for r in _records(tmp_path) if r["reason"] == "dns_allowed"] == []


def _records(tmp_path) -> list[dict]:
    import json
    out = []
    for f in sorted((tmp_path / "audit").glob("*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


# ---------------------------------------------------------------- settings
@pytest.mark.parametrize("dns, message", [
    ({"audit_interval_seconds": 0}, "dns.audit_interval_seconds"),
    ({"audit_interval_seconds": "60"}, "dns.audit_interval_seconds"),
    ({"audit_interval_seconds": 7200}, "dns.audit_interval_seconds"),
    ({"max_new_names_per_minute": 0}, "dns.max_new_names_per_minute"),
    ({"max_new_names_per_minute": 1.5}, "dns.max_new_names_per_minute"),
    ({"max_new_names_per_minute": "120"}, "dns.max_new_names_per_minute"),
])
def test_dns_settings_are_validated(dns, message):
    with pytest.raises(SettingsError, match=message):
        load_settings(None, dns=dns)


def test_dns_settings_defaults_and_overrides():
    assert (load_settings(None).dns.audit_interval_seconds, load_settings(None).dns.max_new_names_per_minute) == \
        (60.0, 120)
    s = load_settings(None, dns={"audit_interval_seconds": 0.5, "max_new_names_per_minute": 7})
    assert (s.dns.audit_interval_seconds, s.dns.max_new_names_per_minute) == (0.5, 7)
