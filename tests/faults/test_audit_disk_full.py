"""Fault 3: the disk holding the audit log fills up.

What must hold: new flows are refused with 503 and X-Cubegate-Reason:
audit_unavailable (never passed unaudited, upstream never contacted), /readyz
says not ready and names the audit check, and both recover once space is freed.
The audit directory is a small tmpfs mounted for this test only.
"""
from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest

from tests.faults.helpers import eventually, report
from tests.gateway import rawclient
from tests.gateway.harness import Gateway

POLICY = """\
name: diskfull
default: deny
rules:
  - name: api
    action: allow
    match: {hosts: [api.allowed.test], ports: [80, 443]}
"""


def _fill(directory) -> int:
    """Write a filler file until the filesystem says ENOSPC; returns bytes written."""
    n = 0
    with open(directory / "filler", "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        for _ in range(100_000):            # bounded: 6.5 GB at most, the tmpfs is 2 MB
            try:
                n += f.write(chunk)
            except OSError:
                break
        for _ in range(64):                  # fill the last partial page too
            try:
                n += f.write(b"\0" * 512)
            except OSError:
                break
    return n


@pytest.fixture
def full_gw(lab, tmp_path):
    mnt = tmp_path / "audit"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", f"cgaudit{uuid.uuid4().hex[:6]}", str(mnt)],
                   check=True, capture_output=True)
    gw = None
    try:
        gw = Gateway(lab, tmp_path / "gw", {"p.yaml": POLICY}, sandboxes={"sb-df": {}},
                     settings_extra={"audit": {"dir": str(mnt), "fsync": "interval"}})
        gw.start()
        yield gw, mnt
    finally:
        if gw is not None:
            gw.stop()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _paths(directory) -> set[str]:
    out = set()
    for f in directory.glob("*.jsonl"):
        *lines, tail = f.read_bytes().split(b"\n")
        # `tail` is a write in progress (a short write is cut off right after): readers skip it.
        out.update(json.loads(line).get("path") for line in lines if line.strip())
    return out


def _raw_plain_get(gw, path: str) -> bytes:
    req = (f"GET http://api.allowed.test{path} HTTP/1.1\r\nHost: api.allowed.test\r\n"
           f"{rawclient.auth_header('sb-df', gw.tokens['sb-df'])}\r\nConnection: close\r\n\r\n").encode()
    return gw.lab.call_gw(rawclient.send_raw, gw.proxy_port, req)


def test_audit_disk_full_refuses_flows_with_a_reason_and_recovers(full_gw, lab):
    gw, mnt = full_gw
    tag = uuid.uuid4().hex[:8]
    assert gw.curl(f"http://api.allowed.test/before-{tag}", sandbox="sb-df").status == 200
    filled = _fill(mnt)
    t_full = time.monotonic()
    # The audit file's last page may still have room: requests pass (and are audited)
    # until an append needs a new page. From the first refusal on, everything is refused.
    passed = []
    for i in range(400):
        resp = _raw_plain_get(gw, f"/fill-{tag}-{i}")
        head = resp.split(b"\r\n\r\n", 1)[0].decode(errors="replace")
        if head.startswith("HTTP/1.1 200"):
            passed.append(f"/fill-{tag}-{i}")
            continue
        break
    assert head.startswith("HTTP/1.1 503"), resp[:300]
    assert "x-cubegate-reason: audit_unavailable" in head.lower(), head
    recorded = _paths(mnt)
    assert set(passed) <= recorded, "a request was answered 200 without its audit record"
    r = gw.curl(f"https://api.allowed.test/full-tls-{tag}", sandbox="sb-df")
    assert r.connect_status == 503, r
    refused = 2
    for i in range(20):
        r = gw.curl(f"http://api.allowed.test/full-{tag}-{i}", sandbox="sb-df")
        assert r.status == 503 and "audit_unavailable" in r.body, r
        refused += 1
    assert f"/fill-{tag}-{len(passed)} " not in lab.logs("upstream")
    if passed:                                              # (the check above can see paths)
        lab.wait_logs("upstream", lambda out: f"{passed[-1]} " in out)
    assert f"full-{tag}" not in lab.logs("upstream") and f"full-tls-{tag}" not in lab.logs("upstream")
    code, body = gw.ops_status("/readyz")
    assert code == 503, body
    checks = json.loads(body)["checks"]
    assert checks["audit"]["ok"] is False, checks
    m = gw.ops_status("/metrics")[1]
    errors = [l for l in m.splitlines() if l.startswith("cubegate_audit_write_errors_total")]
    assert errors and float(errors[0].split()[-1]) >= refused, errors
    # Free the space: ready again, traffic flows, and is audited.
    (mnt / "filler").unlink()
    t_free = time.monotonic()
    assert eventually(lambda: gw.ops_status("/readyz")[0] == 200, 10), gw.ops_status("/readyz")
    ready_after = time.monotonic() - t_free
    r = gw.curl(f"http://api.allowed.test/after-{tag}", sandbox="sb-df")
    assert r.status == 200, (r, gw.log())
    recorded = _paths(mnt)
    assert f"/before-{tag}" in recorded and f"/after-{tag}" in recorded
    report("audit-disk-full", tmpfs="2MiB", filler_bytes=filled, refused_503=refused,
           passed_in_page_slack=len(passed), upstream_contacted_while_full=0, ready_again_after_s=round(ready_after, 2),
           full_for_s=round(t_free - t_full, 2))
