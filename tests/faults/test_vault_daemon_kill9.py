"""Fault 2b: kill -9 the real daemon while its vault admin API is writing.

Clients rotate a secret through the daemon's admin API as fast as it answers;
the daemon is SIGKILLed at random points, restarted, and killed again. What
must hold after every kill: the store opens (integrity check), verify() finds
no problem, every version whose rotate got a 200 is there with its value, and
the restarted daemon serves the API again.
"""
from __future__ import annotations

import random
import signal
import sqlite3
import threading
import time
import uuid

import httpx
import pytest

import vault as vaultlib
from testbed.netns import call_in_netns
from tests.faults.helpers import report
from tests.gateway.harness import Gateway

pytestmark = pytest.mark.netns

KILLS = 3
TENANT, SID = "acme", "rotated"
POLICY = "name: p\ndefault: deny\nrules: []\n"


def _rotate_until_dead(port: int, token: str, tag: str, start: int, acked: dict[int, int], stop) -> None:
    seq = start
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                      timeout=5) as c:
        while not stop.is_set():                    # bounded: the daemon dies within a second
            seq += 1
            try:
                r = c.post(f"/v1/secrets/{TENANT}/{SID}/rotate",
                           json={"value": f"sk-daemon-{tag}-{seq:06d}", "previous": "keep"})
            except httpx.HTTPError:
                return                              # the kill landed
            if r.status_code == 200:
                acked[seq] = r.json()["current_version"]


def _check(gw: Gateway, tag: str, acked: dict[int, int]) -> int:
    v = vaultlib.Vault.open(gw.state_dir / "vault.db")      # VaultCorrupt if the integrity check fails
    try:
        v.unseal_with_key_file(gw.state_dir / "vault.key")
        assert v.verify() == [], v.verify()
        keys = v._require_keys()
        rows = {r[0]: r for r in v._versions_rows(TENANT, SID, ("active", "disabled"))}
        for seq, version in acked.items():
            assert version in rows, (seq, version, sorted(rows)[-5:])
            assert v._decrypt(keys, TENANT, SID, rows[version]).decode() == f"sk-daemon-{tag}-{seq:06d}"
        return len(acked)
    finally:
        v.close()


def test_kill9_daemon_while_its_vault_api_writes(lab, tmp_path):
    gw = Gateway(lab, tmp_path / "gw", {"p.yaml": POLICY})
    gw.cli("vault", "init")
    gw.cli("vault", "secret", "put", TENANT, SID, input="sk-daemon-initial\n")
    token = gw.cli("vault", "token", "create", "--scope", "admin").strip().split()[-1]
    port = gw.proxy_port + 2                       # the harness's vault.api_port
    rng = random.Random()
    tag = uuid.uuid4().hex[:6]
    acked: dict[int, int] = {}
    seq = 0
    try:
        for _ in range(KILLS):
            gw.start()
            stop = threading.Event()
            t = threading.Thread(target=call_in_netns, args=(lab.gw_ns, _rotate_until_dead, port, token, tag,
                                                             seq, acked, stop), kwargs={"timeout": 60})
            t.start()
            time.sleep(rng.uniform(0.3, 1.0))
            gw.proc.send_signal(signal.SIGKILL)
            gw.proc.wait(10)
            stop.set()
            t.join(30)
            assert not t.is_alive()
            seq = max(acked, default=seq) + 1000    # never reuse a value of an unacknowledged rotate
            _check(gw, tag, acked)
        assert len(acked) > KILLS, "hardly any rotate was acknowledged: the kills did not hit writes"
        with sqlite3.connect(gw.state_dir / "vault.db") as c:
            assert c.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        gw.start()                                  # and the daemon comes back with the same store
        r = call_in_netns(lab.gw_ns, lambda: httpx.get(
            f"http://127.0.0.1:{port}/v1/secrets/{TENANT}/{SID}", headers={"Authorization": f"Bearer {token}"}))
        assert r.status_code == 200 and r.json()["current_version"] >= max(acked.values())
        report("vault-daemon-kill9", kills=KILLS, acknowledged_rotates=len(acked), lost=0)
    finally:
        gw.stop()
