"""Secret sweep after the load run (which injected the test secret ~1000 times).

Searched: every file under the gateway's dir (audit JSONL, SQLite audit index,
vault db, identities, CA, settings, gateway.log = its stdout+stderr), /metrics,
the vault admin API's read endpoints, and core files. Encodings: raw, base64
and url-safe base64 at 3 alignments, url-encoded, hex (see sweep.py).
Control: the same sweep finds each encoding once planted, so it can fail.
"""
from __future__ import annotations

import base64

import pytest

from tests.soak import soakkit, sweep

pytestmark = pytest.mark.netns


def test_no_secret_anywhere_while_running_and_after_stop(soak_run):
    gw, secret = soak_run["gw"], soak_run["secret"]
    assert soak_run["load"]["inject_verified"] > 100, "the run must have injected the secret"
    live = soakkit.secret_sweep(gw, [secret])
    print(f"\nsweep (running): {live['files']} files, blobs {live['blob_bytes']}, cores {live['core_files']}, "
          f"{live['patterns']} patterns, hits {live['hits']}")
    assert live["hits"] == []
    assert live["blob_bytes"]["/metrics"] > 1000
    for name, status in live["blob_status"].items():   # real answers, not 401/404 pages
        assert status == 200, (name, status)
    searched = {p.name for p in sweep.walk([gw.dir])}
    assert {"audit-current.jsonl", "audit-index.db", "gateway.log", "vault.db"} <= searched, searched
    gw.stop()   # drain + final audit flush + index sync + shutdown logs
    assert gw.proc.returncode == 0, gw.log()
    done = soakkit.secret_sweep(gw, [secret], gateway_running=False)
    assert done["hits"] == [], done["hits"]


def test_sweep_finds_planted_secret_in_every_encoding(soak_run, tmp_path):
    """Control: plant each encoding (in random surroundings, base64 of it at each offset)."""
    gw, secret = soak_run["gw"], soak_run["secret"]
    encs = sweep.encodings(secret)
    planted = []
    try:
        for name, pat in encs.items():
            f = gw.audit_dir / f"planted-{name}.txt"
            f.write_bytes(b"{\"junk\": \"" + pat + b"\"}\n")
            planted.append(f)
        for k in range(3):   # a real base64 blob with the secret at byte offset k
            f = gw.state_dir / f"planted-b64-offset{k}.bin"
            f.write_bytes(base64.b64encode(b"xyz"[:k] + b"Bearer " + secret.encode() + b" tail"))
            planted.append(f)
        res = soakkit.secret_sweep(gw, [secret], gateway_running=False,
                                   extra_blobs={"/metrics": b'm{label="' + secret.encode() + b'"} 1\n'})
        found = {(h[0].rsplit("/", 1)[-1], h[2]) for h in res["hits"]}
        for name in encs:
            assert (f"planted-{name}.txt", name) in found, (name, sorted(found))
        for k in range(3):
            assert any(w == f"planted-b64-offset{k}.bin" for w, _ in found), (k, sorted(found))
        assert ("metrics", "raw") in found
    finally:
        for f in planted:
            f.unlink(missing_ok=True)
