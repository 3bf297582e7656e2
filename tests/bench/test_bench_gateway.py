"""The gateway bench runs end to end and reads hey's output (a test of the bench, not a timed test)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import hey

REPO = Path(__file__).resolve().parents[2]

SUMMARY_WITH_ERRORS = """
Summary:
  Total:\t0.0420 secs
  Slowest:\t0.0000 secs
  Fastest:\t0.0000 secs
  Average:\t NaN secs
  Requests/sec:\t1190.4762

Latency distribution:

Status code distribution:

Error distribution:
  [50]\tGet "https://denied.bench.test/": Forbidden
"""


def test_summary_parser_counts_refusals_and_takes_hey_total():
    r = hey.parse_summary(SUMMARY_WITH_ERRORS, sent=50)
    assert (r.answered, r.failed, r.wall_s) == (0, 50, 0.042)
    assert r.errors == {'Get "https://denied.bench.test/": Forbidden': 50}
    assert r.p(50) is None and round(r.rps) == 1190


def test_csv_parser_gives_exact_percentiles_and_wall_from_offsets():
    text = hey.CSV_HEADER + "\n" + "\n".join(
        f"{rt:.4f},0.0001,0.0000,0.0000,{rt:.4f},0.0000,200,{off:.4f}"
        for rt, off in [(0.002, 0.0), (0.001, 0.001), (0.004, 0.002), (0.003, 0.003)])
    r = hey.parse_csv(text, sent=5)
    assert (r.answered, r.failed, r.status_counts) == (4, 1, {200: 4})
    assert (r.p(50), r.p(99)) == (0.002, 0.004)
    assert r.wall_s == pytest.approx(0.006)
    with pytest.raises(ValueError):
        hey.parse_csv("Summary:\n", sent=1)


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (lab namespaces)"
    for tool in ("hey", "nginx", "tinyproxy", "curl", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool} (make apt)"
    return None


@pytest.mark.netns
@pytest.mark.slow
def test_bench_runs_a_reference_and_cubegate_and_reads_hey(tmp_path):
    if reason := _missing():
        pytest.skip(reason)
    out = tmp_path / "result"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_gateway.py"), "--requests", "50",
                        "--concurrency", "5", "--proxies", "tinyproxy,cubegate", "--workers", "1,2",
                        "--scenarios", "passthrough-new,deny", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    rows = {(row["proxy"], row["workers"], row["scenario"]): row for row in data["rows"]}
    for key in [("tinyproxy", "", "passthrough-new"), ("cubegate", "1", "passthrough-new")]:
        row = rows[key]
        assert row["status"] == "ok", row
        assert row["answered"] == 50 and row["upstream_requests"] == 50
        assert row["upstream_conns"] == 50, row       # one tunnel per request, counted at nginx
        assert row["rps"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["cpu_ms_per_req"] > 0              # the proxy's process tree did work
    for key in [("tinyproxy", "", "deny"), ("cubegate", "1", "deny")]:
        row = rows[key]
        assert row["status"] == "ok" and row["answered"] == 0 and row["upstream_conns"] == 0, row
        assert sum(row["errors"].values()) == 50 and row["p50_ms"] is None
    assert rows[("cubegate", "1", "passthrough-new")]["vs_squid_cpu"] is None   # squid not in this run
    if not data["meta"]["gateway_knows_workers"]:
        assert rows[("cubegate", "2", "deny")]["status"] == "n/a"
    table = out.with_suffix(".md").read_text()
    assert "| passthrough (CONNECT), new connection each | cubegate | 1 |" in table
