import json
import sqlite3
from datetime import datetime, timedelta, timezone

import pytest

from egress.audit.index import AuditIndex
from egress.audit.log import AuditLog
from egress.audit.record import format_ts
from egress.audit.segments import CURRENT_NAME

from ._util import rec

@pytest.fixture
def now():
    """Taken when the test starts, not at import: relative filters ("2h") are read against the
    clock, and a long session reaches a test minutes after this module was imported."""
    return datetime.now(timezone.utc)


@pytest.fixture
def populated(audit_dir, now):
    def ago(**kw):
        return format_ts(now - timedelta(**kw))

    records = [
        rec(ts=ago(days=3), sandbox="a", host="api.openai.com", decision="allow", reason="rule_match"),
        rec(ts=ago(hours=5), sandbox="a", host="evil.com", decision="deny", reason="no_rule", rule=None),
        rec(ts=ago(hours=1), sandbox="b", host="uploads.github.com", decision="allow"),
        rec(ts=ago(minutes=10), sandbox="b", host="GitHub.com", decision="deny", reason="private_ip"),
        rec("dns", ts=ago(minutes=1), sandbox="b", host="x.github.com", decision=None, reason=None),
        rec("connection_closed", ts=ago(seconds=5), sandbox="a", host="api.openai.com",
            bytes_in=10, bytes_out=20, duration_ms=12.5, decision=None, reason=None),
    ]
    with AuditLog(audit_dir, fsync="never") as log:
        for r in records:
            log.append(r)
    idx = AuditIndex(audit_dir / "idx.db", audit_dir)
    assert idx.sync() == len(records)
    yield idx, records
    idx.close()


def ids(rs):
    return [r["id"] for r in rs]


def test_filters(populated):
    idx, R = populated
    assert ids(idx.query(sandbox="a", order="asc")) == ids([R[0], R[1], R[5]])
    assert ids(idx.query(decision="deny", order="asc")) == ids([R[1], R[3]])
    assert ids(idx.query(reason="private_ip")) == ids([R[3]])
    assert ids(idx.query(event="dns")) == ids([R[4]])
    assert ids(idx.query(sandbox="b", decision="allow")) == ids([R[2]])
    assert idx.query(sandbox="nobody") == []


def test_host_exact_and_suffix(populated):
    idx, R = populated
    assert ids(idx.query(host="github.com")) == ids([R[3]])           # case-insensitive exact
    assert ids(idx.query(host="*.github.com", order="asc")) == ids([R[2], R[4]])  # not the apex
    assert ids(idx.query(host="*.openai.com", order="asc")) == ids([R[0], R[5]])
    assert idx.query(host="*.hub.com") == []                           # suffix is label-aligned
    with pytest.raises(ValueError):
        idx.query(host="git*.com")


def test_time_filters_relative_and_rfc3339(populated, now):
    idx, R = populated
    assert ids(idx.query(since="2h", order="asc")) == ids(R[2:])
    assert ids(idx.query(since="15m", order="asc")) == ids(R[3:])
    assert ids(idx.query(since="1d", until="30m", order="asc")) == ids([R[1], R[2]])
    since = (now - timedelta(hours=6)).isoformat()
    until = format_ts(now - timedelta(hours=4))
    assert ids(idx.query(since=since, until=until)) == ids([R[1]])
    assert ids(idx.query(until=R[0]["ts"])) == ids([R[0]])   # bounds are inclusive
    for bad in ("yesterday", "2024-01-01T00:00:00", "5y"):
        with pytest.raises(ValueError):
            idx.query(since=bad)


def test_order_and_limit(populated):
    idx, R = populated
    assert ids(idx.query()) == ids(reversed(R))
    assert ids(idx.query(limit=2)) == ids([R[5], R[4]])
    assert ids(idx.query(limit=2, order="asc")) == ids([R[0], R[1]])
    assert len(idx.query(limit=None)) == len(R)
    with pytest.raises(ValueError):
        idx.query(order="sideways")
    with pytest.raises(ValueError):
        idx.query(limit=0)


def test_returns_full_records(populated):
    idx, R = populated
    assert idx.query(event="connection_closed") == [R[5]]


def test_incremental_sync_across_rotation_never_double_inserts(audit_dir):
    idx = AuditIndex(audit_dir / "idx.db", audit_dir)
    written = []
    with AuditLog(audit_dir, max_bytes=2500, keep_files=100, fsync="never") as log:
        for batch in range(6):
            for i in range(7):
                r = rec(extra={"i": len(written)})
                log.append(r)
                written.append(r["id"])
            idx.sync()
            assert idx.count() == len(written)
    assert idx.sync() == 0
    assert ids(idx.query(order="asc", limit=None)) == written
    # The index can also be killed and resynced: offsets live in the same db.
    idx.close()
    idx2 = AuditIndex(audit_dir / "idx.db", audit_dir)
    assert idx2.sync() == 0 and idx2.count() == len(written)
    # Even with the file positions lost, ids keep it free of duplicates.
    with sqlite3.connect(audit_dir / "idx.db") as c:
        c.execute("DELETE FROM files")
    assert idx2.sync() == 0 and idx2.count() == len(written)


def test_rebuild_from_scratch_and_garbage_lines_skipped(audit_dir):
    with AuditLog(audit_dir, fsync="never") as log:
        a = rec()
        log.append(a)
    with open(audit_dir / CURRENT_NAME, "ab") as f:
        f.write(b"this is not json\n")
    with AuditLog(audit_dir, fsync="never") as log:
        b = rec()
        log.append(b)
    db = audit_dir / "idx.db"
    idx = AuditIndex(db, audit_dir)
    assert idx.sync() == 2 and idx.bad_lines == 1
    assert idx.rebuild() == 2 and idx.bad_lines == 2
    assert ids(idx.query(order="asc")) == ids([a, b])


def test_a_foreign_utf8_line_is_indexed_as_before_and_invalid_utf8_skipped(audit_dir):
    """to_line writes ASCII (the index parses it as str); a valid record written by something
    else in raw UTF-8 is still indexed, and bytes that are no UTF-8 at all are garbage."""
    foreign = rec(host="xn--caf-dma.example", path="/caf\u00e9")
    with open(audit_dir / CURRENT_NAME, "ab") as f:
        f.write(json.dumps(foreign, ensure_ascii=False).encode() + b"\n")
        f.write(b'{"id": "\xff\xfe"}\n')
    with AuditIndex(audit_dir / "idx.db", audit_dir) as idx:
        assert idx.sync() == 1 and idx.bad_lines == 1
        (got,) = idx.query()
        assert got["id"] == foreign["id"] and got["host"] == foreign["host"]


@pytest.mark.parametrize("damage", ["garbage", "other_version"])
def test_corrupt_or_foreign_index_is_recreated(audit_dir, damage):
    with AuditLog(audit_dir, fsync="never") as log:
        for _ in range(3):
            log.append(rec())
    db = audit_dir / "idx.db"
    if damage == "garbage":
        db.write_bytes(b"corrupted beyond repair" * 200)
    else:
        with sqlite3.connect(db) as c:
            c.execute("PRAGMA user_version=99")
            c.execute("CREATE TABLE records (x)")
    idx = AuditIndex(db, audit_dir)
    assert idx.sync() == 3
    assert len(idx.query()) == 3
    idx.close()


def test_rebuild_replaces_corrupt_index(audit_dir):
    with AuditLog(audit_dir, fsync="never") as log:
        for _ in range(3):
            log.append(rec())
    db = audit_dir / "idx.db"
    idx = AuditIndex(db, audit_dir)
    idx.sync()
    with sqlite3.connect(db) as c:
        c.execute("DELETE FROM records WHERE rowid = 1")
    assert idx.count() == 2
    assert idx.rebuild() == 3
    assert idx.count() == 3
    assert json.loads(db.parent.joinpath(CURRENT_NAME).read_text().splitlines()[0])["id"] in ids(
        idx.query(limit=None))
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
