import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from egress.audit.index import AuditIndex
from egress.audit.log import AuditLog, AuditWriteError
from egress.audit.segments import CURRENT_NAME, rotated_files
from egress.audit.tail import iter_records

from ._util import rec

REPO = Path(__file__).resolve().parents[2]


def lines_of(path):
    return [json.loads(x) for x in Path(path).read_bytes().splitlines()]


@pytest.mark.parametrize("mode", ["always", "interval", "never"])
def test_append_query_roundtrip(audit_dir, mode):
    written = [rec(sandbox=f"sb{i % 2}", extra={"i": i}) for i in range(20)]
    with AuditLog(audit_dir, fsync=mode, fsync_interval=0.05) as log:
        for r in written:
            log.append(r)
        assert log.writable()
        on_disk = lines_of(audit_dir / CURRENT_NAME)
        assert on_disk == written   # visible to readers before close
    idx = AuditIndex(audit_dir / "idx.db", audit_dir)
    assert idx.sync() == 20
    got = idx.query(sandbox="sb1", order="asc", limit=None)
    assert got == [r for r in written if r["sandbox"] == "sb1"]
    assert oct((audit_dir / CURRENT_NAME).stat().st_mode & 0o777) == "0o600"


def test_rotation_keeps_order_and_every_record(audit_dir):
    with AuditLog(audit_dir, max_bytes=3000, keep_files=100, fsync="never") as log:
        written = [rec(extra={"i": i}) for i in range(100)]
        for r in written:
            log.append(r)
    rotated = rotated_files(audit_dir)
    assert len(rotated) >= 10
    for p in rotated:
        assert p.stat().st_size <= 3000
        assert p.name.startswith("audit-") and p.name.count("-") == 2
    assert [r["extra"]["i"] for r in iter_records(audit_dir)] == list(range(100))


def test_retention_keep_files_never_deletes_current(audit_dir):
    with AuditLog(audit_dir, max_bytes=1500, keep_files=2, fsync="never") as log:
        for i in range(60):
            log.append(rec(extra={"i": i}))
        rotated = rotated_files(audit_dir)
        assert len(rotated) == 2
        assert (audit_dir / CURRENT_NAME).exists()
        seen = [r["extra"]["i"] for r in iter_records(audit_dir)]
        assert seen == list(range(seen[0], 60)) and seen[0] > 0  # oldest gone, rest intact


def test_retention_days_deletes_old_rotated_files(audit_dir):
    with AuditLog(audit_dir, max_bytes=1500, keep_files=100, retention_days=1, fsync="never") as log:
        for i in range(20):
            log.append(rec())
        rotated = rotated_files(audit_dir)
        assert len(rotated) >= 3
        old = time.time() - 3 * 86400
        for p in rotated[:2]:
            os.utime(p, (old, old))
        os.utime(audit_dir / CURRENT_NAME, (old, old))  # current is never deleted
        log.apply_retention()
        assert rotated_files(audit_dir) == rotated[2:]
        assert (audit_dir / CURRENT_NAME).exists()


def test_torn_trailing_line_tolerated_then_indexed_once_complete(audit_dir):
    with AuditLog(audit_dir, fsync="never") as log:
        first = rec(extra={"i": 0})
        log.append(first)
    torn = rec(extra={"i": 1})
    line = json.dumps(torn, separators=(",", ":")).encode() + b"\n"
    cur = audit_dir / CURRENT_NAME
    with open(cur, "ab") as f:
        f.write(line[:40])     # a writer caught mid-write
    idx = AuditIndex(audit_dir / "idx.db", audit_dir)
    assert idx.sync() == 1
    assert [r["id"] for r in iter_records(audit_dir)] == [first["id"]]
    with open(cur, "ab") as f:
        f.write(line[40:])     # the write completes
    assert idx.sync() == 1
    assert idx.sync() == 0
    assert [r["id"] for r in idx.query(order="asc")] == [first["id"], torn["id"]]
    assert idx.bad_lines == 0


def test_reopen_cuts_torn_tail_so_next_record_is_clean(audit_dir):
    with AuditLog(audit_dir, fsync="never") as log:
        log.append(rec(extra={"i": 0}))
    cur = audit_dir / CURRENT_NAME
    with open(cur, "ab") as f:
        f.write(b'{"id":"deadbeef","ts":')   # crash mid-write
    with AuditLog(audit_dir, fsync="never") as log:
        log.append(rec(extra={"i": 1}))
    assert [r["extra"]["i"] for r in lines_of(cur)] == [0, 1]


_CHILD = r"""
import sys
from egress.audit.log import AuditLog
from egress.audit.record import make_record
log = AuditLog(sys.argv[1], max_bytes=20000, keep_files=1000, fsync="never")
i = 0
while i < 200000:
    log.append(make_record("decision", sandbox="sbk", decision="allow", extra={"seq": i}))
    i += 1
    print(i, flush=True)   # acknowledged: append() returned
"""


def test_kill_9_keeps_every_acknowledged_record(audit_dir):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(audit_dir)],
                             stdout=subprocess.PIPE, env=env, text=True)
    acked = 0
    deadline = time.monotonic() + 20
    try:
        while acked < 2000 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            acked = int(line)
        os.kill(child.pid, signal.SIGKILL)
        rest = child.stdout.read().split()
        if rest:
            acked = int(rest[-1])
    finally:
        child.kill()
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL
    assert acked >= 100, "child made too little progress to be a meaningful test"
    seqs = [r["extra"]["seq"] for r in iter_records(audit_dir)]
    assert seqs[:acked] == list(range(acked))      # all acknowledged, in order
    assert len(seqs) in (acked, acked + 1)         # at most one written but not yet acked
    assert len(rotated_files(audit_dir)) >= 2
    idx = AuditIndex(audit_dir / "idx.db", audit_dir)
    assert idx.rebuild() == len(seqs)
    assert idx.rebuild() == len(seqs)              # rebuild is from scratch, not additive
    assert idx.count() == len(seqs)


@pytest.fixture(params=["tmpfs", "devfull"])
def full_dir(request, tmp_path):
    """A directory whose audit file hits ENOSPC: a 64k tmpfs (root only), or /dev/full."""
    mnt = Path(tempfile.mkdtemp(prefix="cgaudit", dir=tmp_path))
    mounted = False
    if request.param == "tmpfs":
        if os.geteuid() != 0:
            pytest.skip("tmpfs mount needs root")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)],
                           capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount tmpfs: {r.stderr.decode().strip()}")
        mounted = True
    else:
        os.symlink("/dev/full", mnt / CURRENT_NAME)
    try:
        yield mnt, mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=True)


def test_disk_full_raises_audit_write_error(full_dir):
    d, is_tmpfs = full_dir
    log = AuditLog(d, fsync="always", max_bytes=10 * 1024 * 1024)
    try:
        acked = []
        with pytest.raises(AuditWriteError) as ei:
            for i in range(10000):
                r = rec(extra={"i": i})
                log.append(r)
                acked.append(r["id"])
        err = ei.value
        assert str(d / CURRENT_NAME) in str(err)
        assert "No space left on device" in str(err)
        assert err.path == str(d / CURRENT_NAME)
        assert not log.writable()
        if is_tmpfs:
            assert len(acked) > 10
            data = (d / CURRENT_NAME).read_bytes()
            assert data.endswith(b"\n")        # no fragment left behind
            assert [r["id"] for r in iter_records(d)] == acked
            with pytest.raises(AuditWriteError):  # still full: still refused
                log.append(rec())
    finally:
        log.close()


def test_closed_log_refuses(audit_dir):
    log = AuditLog(audit_dir, fsync="never")
    log.close()
    assert not log.writable()
    with pytest.raises(AuditWriteError, match="closed"):
        log.append(rec())


def test_writable_false_when_current_file_removed(audit_dir):
    with AuditLog(audit_dir, fsync="never") as log:
        assert log.writable()
        (audit_dir / CURRENT_NAME).unlink()
        assert not log.writable()


def test_bad_directory_gives_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(AuditWriteError, match=str(blocker)):
        AuditLog(blocker / "audit")


def test_threads_do_not_interleave(audit_dir):
    import threading
    with AuditLog(audit_dir, max_bytes=50_000, keep_files=1000, fsync="never") as log:
        def worker(n):
            for i in range(200):
                log.append(rec(sandbox=f"t{n}", extra={"i": i}))
        ts = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30)
    recs = list(iter_records(audit_dir))
    assert len(recs) == 800
    for n in range(4):
        assert [r["extra"]["i"] for r in recs if r["sandbox"] == f"t{n}"] == list(range(200))
