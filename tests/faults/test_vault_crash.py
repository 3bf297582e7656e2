"""Fault 2: kill -9 a process while it writes to the vault.

A child process (forked, library calls: rotate with keep/disable, and a second
secret rotated with destroy, which checkpoints the WAL) reports each version
once rotate() has returned, on a pipe. It is killed at a random point, ~20
times in a row, each run continuing on the same file. What must hold after
every kill: the store opens (integrity check inside Store.open), verify()
finds no problem, every version reported committed is there with its value,
and no version holds anything but a value the child wrote.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sqlite3
import time
import uuid


import vault as vaultlib
from tests.faults.helpers import report

KILLS = 20
TENANT, SID, SID_D = "acme", "crashy", "crashy-destroy"


def _value(tag: str, sid: str, seq: int) -> str:
    return f"sk-crash-{tag}-{sid}-{seq:06d}"


def _writer(path: str, key_hex: str, tag: str, start_seq: int, out) -> None:
    v = vaultlib.Vault.open(path)
    v.unseal(bytes.fromhex(key_hex))
    seq = start_seq
    while True:                                    # runs until SIGKILL (the parent bounds it)
        seq += 1
        if seq % 5 == 0:
            info = v.rotate(TENANT, SID_D, _value(tag, SID_D, seq), previous="destroy")
            out.send_bytes(f"{SID_D} {seq} {info.current_version}".encode())
        else:
            info = v.rotate(TENANT, SID, _value(tag, SID, seq), previous=("keep" if seq % 2 else "disable"))
            out.send_bytes(f"{SID} {seq} {info.current_version}".encode())


def _read_all(conn) -> list[str]:
    out = []
    while True:
        try:
            out.append(conn.recv_bytes().decode())
        except EOFError:
            return out


def _check(path: str, key: bytes, tag: str, committed: dict[str, dict[int, int]]) -> int:
    v = vaultlib.Vault.open(path)                 # raises VaultCorrupt if the integrity check fails
    try:
        v.unseal(key)
        assert v.verify() == [], v.verify()
        keys = v._require_keys()
        checked = 0
        for sid, versions in committed.items():
            rows = {r[0]: r for r in v._versions_rows(TENANT, sid, ("active", "disabled"))}
            for seq, version in versions.items():
                if sid == SID_D and (version != max(versions.values()) or max(rows) > version):
                    # destroyed by a later rotate (reported, or committed just before the kill)
                    assert max(rows) >= version, (sid, version, sorted(rows))
                    continue
                assert version in rows, (sid, seq, version, sorted(rows))
                assert v._decrypt(keys, TENANT, sid, rows[version]).decode() == _value(tag, sid, seq)
                checked += 1
            for version, row in rows.items():   # nothing but values the child wrote
                assert v._decrypt(keys, TENANT, sid, row).decode().startswith(f"sk-crash-{tag}-{sid}-")
        return checked
    finally:
        v.close()


def test_kill9_while_writing_the_vault_loses_no_committed_version(tmp_path):
    path = str(tmp_path / "vault.db")
    key = os.urandom(32)
    v = vaultlib.Vault.init(path, vaultlib.MasterKey(key))
    tag = uuid.uuid4().hex[:6]
    v.put_secret(TENANT, SID, _value(tag, SID, 0))
    v.put_secret(TENANT, SID_D, _value(tag, SID_D, 0))
    v.close()
    # forkserver: children are forked from a single-threaded server (the test process
    # runs lab threads), with the vault already imported, so a kill lands on writes fast.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["vault", "tests.faults.test_vault_crash"])
    rng = random.Random(int(os.environ.get("CUBEGATE_FAULT_SEED", "0")) or None)
    committed: dict[str, dict[int, int]] = {SID: {}, SID_D: {}}
    seq, total_checked = 0, 0
    for _ in range(KILLS):
        rconn, wconn = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_writer, args=(path, key.hex(), tag, seq, wconn), daemon=True)
        p.start()
        wconn.close()
        time.sleep(rng.uniform(0.02, 0.25))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL, p.exitcode
        for line in _read_all(rconn):
            sid, s, version = line.split()
            committed[sid][int(s)] = int(version)
            seq = max(seq, int(s))
        rconn.close()
        seq += 1       # the seq in flight at the kill may be committed without a report: skip it
        total_checked += _check(path, key, tag, committed)
    assert len(committed[SID]) > KILLS, "the child hardly wrote anything: the kills did not hit writes"
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    report("vault-kill9", kills=KILLS, committed_versions=len(committed[SID]) + len(committed[SID_D]),
           checked_reads=total_checked, lost=0)
