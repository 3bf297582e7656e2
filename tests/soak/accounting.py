"""Exact audit accounting for a load run (pure: client log + audit records in, problems out).

Markers (see testbed/loadgen.py): every client connection has its own source
address 127.a.b.c (audit field `client` = "ip:port"), every request the
gateway can see has a unique path /soak/<run>/<n> (audit keeps the path, never
the query). Expected records per connection:

  kind          decision (CONNECT)   request                 connection_closed
  denied        1, deny, status 403  0                       1 (kind denied), or none when the
                                                             decision has extra.closed (the fast
                                                             path's one record of a refusal)
  passthrough   1, allow             0 (inner requests opaque) 1 (kind passthrough)
  intercept     1, allow             1 per path sent          1 (kind intercept)
  inject        1, allow             1 per path, names secret 1 (kind intercept)
  plain         0                    1 per path sent          1 (kind http)

A denied connection past its sandbox's refusal budget (egress/refusal_budget.py) has no record
of its own: it is counted in a `refusals_counted` record of its sandbox instead, and per sandbox
the counts add up exactly to the denied connections without records.

Both ways: every expectation above is met by exactly that many records, and
every audit record (but `admin` ones) belongs to a client connection. A
connection that ended in an error (e.g. cut by a restart) may lack the records
of what was never acknowledged, but never has an extra or unknown one, and
every *acknowledged* request still has its record.
"""
from __future__ import annotations

from collections import defaultdict

CLOSED_KIND = {"denied": "denied", "passthrough": "passthrough", "intercept": "intercept",
               "inject": "intercept", "plain": "http"}
TUNNEL_KINDS = {"denied", "passthrough", "intercept", "inject"}
ACCOUNTED_EVENTS = {"decision", "request", "connection_closed"}


def _ip(client: str | None) -> str | None:
    return client.rsplit(":", 1)[0] if client else None


def check(conns: list[dict], records: list[dict], *, inject_secret_id: str | None = None) -> tuple[list[str], dict]:
    """Returns (problems, summary). An empty problem list means exact accounting."""
    problems: list[str] = []
    by_ip: dict[str, list[dict]] = defaultdict(list)
    ignored = defaultdict(int)
    counted: dict[str | None, int] = defaultdict(int)        # sandbox -> refusals counted in summaries
    for r in records:
        if r.get("reason") == "refusals_counted":
            counted[r.get("sandbox")] += (r.get("extra") or {}).get("refused", 0)
            continue
        if r.get("event") not in ACCOUNTED_EVENTS:
            ignored[r.get("event")] += 1
            continue
        by_ip[_ip(r.get("client"))].append(r)
    conn_by_ip = {}
    for c in conns:
        if c["ip"] in conn_by_ip:
            problems.append(f"client bug: source address {c['ip']} used twice")
        conn_by_ip[c["ip"]] = c

    # every record belongs to a connection of ours
    for ip, recs in by_ip.items():
        if ip not in conn_by_ip:
            problems.append(f"{len(recs)} audit record(s) from unknown client {ip}: {recs[0].get('event')} "
                            f"{recs[0].get('path') or recs[0].get('host')}")

    path_seen: dict[str, int] = defaultdict(int)
    n_expected = n_found = 0
    uncounted: dict[str | None, int] = defaultdict(int)      # sandbox -> denied connections without records
    for ip, c in conn_by_ip.items():
        recs = by_ip.get(ip, [])
        kind, clean = c["kind"], c["error"] is None
        if kind == "denied" and not recs and c.get("connect_status") == 403:
            uncounted[c["sandbox"]] += 1                     # must be in its sandbox's refusals_counted
            continue
        ev = defaultdict(list)
        for r in recs:
            ev[r["event"]].append(r)
        where = f"{c['kind']} conn {ip} ({c['sandbox']})"
        if any(r.get("sandbox") not in (c["sandbox"], None) for r in recs):
            problems.append(f"{where}: record names another sandbox")
        # decision records (CONNECT)
        dec = ev["decision"]
        want_dec = 1 if kind in TUNNEL_KINDS and c.get("connect_status") is not None else 0
        if clean or c.get("connect_status") is not None:
            if len(dec) != want_dec:
                problems.append(f"{where}: {len(dec)} decision records, want {want_dec}")
        elif len(dec) > (1 if kind in TUNNEL_KINDS else 0):
            problems.append(f"{where}: {len(dec)} decision records, want at most 1")
        for r in dec:
            want = "deny" if kind == "denied" else "allow"
            if r.get("decision") != want:
                problems.append(f"{where}: decision {r.get('decision')}/{r.get('reason')}, want {want}")
        # request records: acked ⊆ recorded ⊆ sent, each exactly once
        # inside a passthrough tunnel the requests are opaque to the gateway: no per-request record
        opaque = kind in ("denied", "passthrough")
        sent, acked = (set(), set()) if opaque else (set(c["paths"]), set(c["acked"]))
        rec_paths = [r.get("path") for r in ev["request"]]
        for p in rec_paths:
            path_seen[p] += 1
            if p not in sent:
                problems.append(f"{where}: request record for a path never sent: {p}")
        missing = acked - set(rec_paths)
        if missing:
            problems.append(f"{where}: {len(missing)} acknowledged request(s) without a record, e.g. {sorted(missing)[0]}")
        if kind in ("denied", "passthrough") and rec_paths:
            problems.append(f"{where}: {len(rec_paths)} request records on a {kind} connection")
        if clean and set(rec_paths) != sent:
            problems.append(f"{where}: recorded {len(rec_paths)} of {len(sent)} requests sent")
        if kind == "inject" and inject_secret_id:
            for r in ev["request"]:
                if (r.get("extra") or {}).get("secret") != inject_secret_id:
                    problems.append(f"{where}: request {r.get('path')} without injected secret in its record")
                    break
        for r in ev["request"]:
            if r.get("decision") != "allow":
                problems.append(f"{where}: request {r.get('path')} {r.get('decision')}/{r.get('reason')}")
                break
        # connection_closed (or the decision record that closed the connection: README, Audit)
        closed = ev["connection_closed"] + [r for r in dec if (r.get("extra") or {}).get("closed")]
        accepted = clean or c.get("connect_status") is not None or bool(c["acked"])
        if accepted and len(closed) != 1:
            problems.append(f"{where}: {len(closed)} connection_closed records, want 1")
        elif len(closed) > 1:
            problems.append(f"{where}: {len(closed)} connection_closed records, want at most 1")
        for r in closed:
            k = (r.get("extra") or {}).get("kind")
            if k != CLOSED_KIND[kind] and not (not clean and k == "pending"):
                problems.append(f"{where}: connection_closed kind {k}, want {CLOSED_KIND[kind]}")
        closes_in_decision = any((r.get("extra") or {}).get("closed") for r in dec)
        n_expected += want_dec + len(sent if clean else acked) + (1 if accepted and not closes_in_decision else 0)
        n_found += len(recs)
    for sb in set(counted) | set(uncounted):
        if counted[sb] != uncounted[sb]:
            problems.append(f"sandbox {sb}: {uncounted[sb]} denied connection(s) without records, "
                            f"{counted[sb]} counted in refusals_counted records")
    dup = [p for p, n in path_seen.items() if n > 1]
    if dup:
        problems.append(f"{len(dup)} path(s) with more than one request record, e.g. {dup[0]}")
    summary = {"connections": len(conns), "records": sum(len(v) for v in by_ip.values()),
               "min_expected_records": n_expected, "ignored_events": dict(ignored),
               "errored_connections": sum(1 for c in conns if c["error"]),
               "refusals_counted": sum(counted.values())}
    return problems, summary
