"""The per-sandbox connection budget shared by worker processes (egress/shared_claims.py), no network."""
from __future__ import annotations

import pytest

from egress import shared_claims
from egress.conn_state import ConnState
from egress.identity import Identity
from egress.shared_claims import ClaimsColumns, SharedClaims


def _st(n: int) -> ConnState:
    return ConnState(conn_id=f"c{n}", client="10.0.0.1:1", started=0.0)


@pytest.fixture
def table(tmp_path):
    daemon = ClaimsColumns(tmp_path / "claims")
    a = SharedClaims(tmp_path / "claims", 3, daemon.take())
    b = SharedClaims(tmp_path / "claims", 3, daemon.take())
    yield daemon, a, b
    for t in (a, b, daemon):
        t.close()


def test_two_workers_share_one_sandbox_budget(table):
    _, a, b = table
    sb = Identity("sb-1", {})
    held = [_st(1), _st(2), _st(3)]
    assert a.claim(held[0], sb) and b.claim(held[1], sb) and a.claim(held[2], sb)
    assert not b.claim(_st(4), sb) and not a.claim(_st(5), sb)       # 3 of 3, whoever asks
    assert a.claim(_st(6), Identity("sb-2", {}))                      # another sandbox has its own
    b.release(held[1])
    assert b.claim(_st(7), sb) and a.open_count("sb-1") == 3
    assert a.claim(held[0], sb)                                       # the same connection again: no change


def test_a_dead_workers_connections_leave_the_budget(table):
    daemon, a, b = table
    sb = Identity("sb-1", {})
    for n in range(3):
        assert b.claim(_st(n), sb)
    assert not a.claim(_st(9), sb)
    daemon.give_back(1)                                               # b's column: b died
    assert a.open_count("sb-1") == 0 and a.claim(_st(9), sb)


def test_slots_of_sandboxes_with_nothing_open_are_reused_and_a_full_table_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_claims, "SIZE", 4 * shared_claims.ENTRY)
    monkeypatch.setattr(shared_claims, "SLOTS", 4)
    daemon = ClaimsColumns(tmp_path / "claims")
    w = SharedClaims(tmp_path / "claims", None, daemon.take())
    sts = {f"sb-{i}": _st(i) for i in range(4)}
    for sb, st in sts.items():
        assert w.claim(st, Identity(sb, {}))
    assert not w.claim(_st(9), Identity("sb-new", {}))                # 4 sandboxes hold all 4 slots
    w.release(sts["sb-2"])
    assert w.claim(_st(9), Identity("sb-new", {}))                    # sb-2's slot, now empty, is reused
    assert w.open_count("sb-new") == 1 and w.open_count("sb-2") == 0
    w.close()
    daemon.close()
