import threading
import time

import pytest

from egress.audit.log import AuditLog
from egress.audit.segments import CURRENT_NAME
from egress.audit.tail import LogReader, follow, iter_records

from ._util import rec


def test_iter_records_in_order_skips_torn_and_garbage(audit_dir):
    with AuditLog(audit_dir, max_bytes=2000, keep_files=100, fsync="never") as log:
        for i in range(12):
            log.append(rec(extra={"i": i}))
    with open(audit_dir / CURRENT_NAME, "ab") as f:
        f.write(b'{"id":"abc","ts"')
    assert [r["extra"]["i"] for r in iter_records(audit_dir)] == list(range(12))


def test_iter_records_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="audit directory not found"):
        list(iter_records(tmp_path / "nope"))


def test_follow_sees_records_from_another_thread_across_rotation(audit_dir):
    log = AuditLog(audit_dir, max_bytes=1500, keep_files=100, fsync="never")
    log.append(rec(extra={"i": -1}))       # existing: follow starts after it
    stop = threading.Event()
    got = []
    started = threading.Event()

    def consume():
        started.set()
        for r in follow(audit_dir, poll=0.02, stop_event=stop):
            got.append(r["extra"]["i"])
            if len(got) == 30:
                stop.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    started.wait(5)
    time.sleep(0.1)   # let follow() take its starting point
    for i in range(30):
        log.append(rec(extra={"i": i}))
        if i % 7 == 0:
            time.sleep(0.03)
    t.join(timeout=10)
    stop.set()
    log.close()
    assert not t.is_alive()
    assert got == list(range(30))
    assert len(list(audit_dir.glob("audit-2*.jsonl"))) >= 3   # it really rotated


def test_follow_stops_on_event_without_records(audit_dir):
    AuditLog(audit_dir, fsync="never").close()
    stop = threading.Event()
    stop.set()
    assert list(follow(audit_dir, poll=0.01, stop_event=stop)) == []


def test_reader_continues_where_it_left_off(audit_dir):
    with AuditLog(audit_dir, max_bytes=1500, keep_files=100, fsync="never") as log:
        reader = LogReader(audit_dir)
        log.append(rec(extra={"i": 0}))
        assert [r["extra"]["i"] for r in reader.read_new()] == [0]
        for i in range(1, 10):
            log.append(rec(extra={"i": i}))
        assert [r["extra"]["i"] for r in reader.read_new()] == list(range(1, 10))
        assert list(reader.read_new()) == []


def test_follow_exact_order_under_rapid_rotation(audit_dir):
    """Writer rotates every few records while a reader follows: no loss, no dup, in order."""
    n = 400
    log = AuditLog(audit_dir, max_bytes=1200, keep_files=1000, fsync="never")
    stop = threading.Event()
    got = []

    def consume():
        for r in follow(audit_dir, poll=0.001, stop_event=stop, from_start=True):
            got.append(r["extra"]["i"])
            if len(got) >= n:
                stop.set()

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    try:
        for i in range(n):
            log.append(rec(extra={"i": i}))
        t.join(timeout=20)
    finally:
        stop.set()
        log.close()
    assert not t.is_alive()
    assert got == list(range(n))
