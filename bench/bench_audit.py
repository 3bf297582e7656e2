"""Audit record cost per record, as a refused CONNECT writes them (pure Python, one core).

Per record: building it (egress.records.audit_record, as the data paths do), appending it
(AuditLog.append: validate, serialise, one write() under the flock; fsync off, so the disk
is not measured), reading it back (record.from_line), and the daemon's index ingesting it
(AuditIndex.sync: parse, validate, SQLite insert; CPU time per record). Each figure is the
best of `--repeat` runs. `--against DIR` also runs this same script on the code in DIR (e.g.
/work/main), alternating runs of the two, and prints both with the ratio: the machine is
shared, so compare figures of one run.

    .venv/bin/python bench/bench_audit.py [--records 20000] [--against /work/main]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def measure(records: int) -> dict[str, float]:
    """µs per record of each step, in this process (the code on sys.path)."""
    from egress import records as recs
    from egress.audit.index import AuditIndex
    from egress.audit.log import AuditLog
    from egress.audit.record import from_line, to_line
    from egress.conn_state import ConnState
    from egress.identity import Identity
    from egress.policy.model import Decision

    st = ConnState(conn_id="c0123456789abcdef", client="10.11.0.2:40123", started=time.time(),
                   identity=Identity("sb-bench"), host="denied.bench.test", port=443)
    deny = Decision("deny", "no_matching_rule", None, "default", "enforce", False, False, None)
    out: dict[str, float] = {}

    t = time.perf_counter()
    built = [recs.audit_record("decision", st, **recs.decision_fields(deny)) for _ in range(records)]
    out["build"] = (time.perf_counter() - t) / records * 1e6
    with tempfile.TemporaryDirectory() as d:
        log = AuditLog(Path(d) / "log", fsync="never")
        t = time.perf_counter()
        for rec in built:
            log.append(rec)
        out["append"] = (time.perf_counter() - t) / records * 1e6
        log.close()
        line = to_line(built[0])
        t = time.perf_counter()
        for _ in range(records):
            from_line(line)
        out["from_line"] = (time.perf_counter() - t) / records * 1e6
        with AuditIndex(Path(d) / "index.db", Path(d) / "log", on_record=lambda rec: None) as index:
            t = time.process_time()
            assert index.sync() == records
            out["index"] = (time.process_time() - t) / records * 1e6
    return out


def _run(tree: Path, records: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    got = subprocess.run([sys.executable, __file__, "--records", str(records), "--json"], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(got.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--against", type=Path, help="another checkout to compare with (run alternately)")
    ap.add_argument("--json", action="store_true", help="one run in this process, as JSON (internal)")
    args = ap.parse_args()
    if args.json:
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(HERE)))
        print(json.dumps(measure(args.records)))
        return
    trees = {"this": HERE} | ({"against": args.against.resolve()} if args.against else {})
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():
            for what, us in _run(tree, args.records).items():
                best[name][what] = min(us, best[name].get(what, us))
    print(f"µs per record ({args.records} records, best of {args.repeat})")
    header = f"{'step':10s} {'this':>8s}"
    if args.against:
        header += f" {str(args.against):>16s} {'ratio':>6s}"
    print(header)
    for what, us in best["this"].items():
        row = f"{what:10s} {us:8.2f}"
        if args.against:
            other = best["against"][what]
            row += f" {other:16.2f} {other / us:5.2f}x"
        print(row)


if __name__ == "__main__":
    main()
