"""The shapes both data paths write: audit records, refusal pages, connection-closed fields.

One definition, so a refusal from the fast path and from the mitmproxy gate read
the same to the sandbox (status, X-Cubegate-Reason, body) and in the audit log.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from egress.audit.log import AuditWriteError
from egress.audit.record import new_id, now_ts
from egress.conn_state import ConnState
from egress.destination import AGENT_HOST
from egress.http_checks import Refusal
from egress.policy import Decision

log = logging.getLogger("cubegate.gate")

ACCESS_HINT = (f"GET http://{AGENT_HOST}/v1/denials lists your recent denials; POST http://{AGENT_HOST}"
               "/v1/access-requests with {\"host\", \"port\", \"reason\"} asks a person for access")


def audit_record(event: str, st: ConnState | None, **fields: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"id": new_id(), "ts": now_ts(), "event": event}
    if st is not None:
        rec.update(conn_id=st.conn_id, client=st.client, sandbox=st.identity.sandbox_id if st.identity else None,
                   host=st.host, port=st.port, sni=st.sni)
    rec.update({k: v for k, v in fields.items() if v is not None})
    return rec


def decision_fields(d: Decision) -> dict[str, Any]:
    return dict(decision=d.action, reason=d.reason, rule=d.rule, policy=d.policy, mode=d.mode,
                would_deny=d.would_deny or None)


def closed_fields(st: ConnState, duration: float) -> dict[str, Any]:
    """The connection_closed record's fields (besides the connection's own)."""
    if st.kind == "denied":
        decision = "deny"
    else:
        decision = st.decision.action if st.decision else None
    return dict(bytes_in=st.bytes_in, bytes_out=st.bytes_out, duration_ms=round(duration * 1000, 3),
                upstream=st.upstream, decision=decision,
                reason=st.denied_reason or (st.decision.reason if st.decision else None),
                extra={"kind": st.kind, "requests": st.requests})


def policy_refusal(d: Decision) -> Refusal:
    """A policy's deny as the sandbox is answered: 403, but 400 for `invalid_host` (a host that
    cannot be read is a malformed request, and the parsers answer it 400 too)."""
    return Refusal(400 if d.reason == "invalid_host" else 403, d.reason, explain(d))


def explain(d: Decision) -> str:
    parts = [f"policy {d.policy}" if d.policy else "no policy"]
    if d.rule:
        parts.append(f"rule {d.rule}")
    return ", ".join(parts)


def deny_body(status: int, reason: str, detail: str, *, st: ConnState | None = None,
              decision: Decision | None = None) -> bytes:
    """Every refusal's body: a short JSON document an agent can read (what was refused, by
    which rule of which policy, and where to ask for access)."""
    body = {"error": "refused_by_cubegate", "reason": reason, "detail": detail,
            "host": st.host if st is not None else None, "port": st.port if st is not None else None,
            "rule": decision.rule if decision is not None else None,
            "policy": decision.policy if decision is not None else None}
    if status == 403:
        body["ask_for_access"] = ACCESS_HINT
    return (json.dumps(body) + "\n").encode()


def deny_headers(reason: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "X-Cubegate-Reason": reason, "Connection": "close"}


def refusal_source(rec: dict[str, Any]) -> tuple[str, str]:
    """Whose refusal-budget a refusal record spends: its sandbox's, else (not identified yet:
    407, unknown source) its client address's."""
    if rec.get("sandbox"):
        return ("sandbox", rec["sandbox"])
    return ("client", (rec.get("client") or "").rpartition(":")[0] or "-")


def append_refusal(audit, metrics, budget, st: ConnState | None, rec: dict[str, Any]) -> bool:
    """A refusal's record: written when its source's budget allows (False if that failed), else
    counted into the interval's summary (st.refusal_counted: its connection_closed is skipped too)."""
    return append_refusal_built(audit, metrics, budget, st, refusal_source(rec), rec.get("reason"),
                                rec.get("host"), lambda: rec)


def state_refusal_source(st: ConnState) -> tuple[str, str]:
    """refusal_source of a record made from `st` (audit_record), without making it."""
    if st.identity is not None and st.identity.sandbox_id:
        return ("sandbox", st.identity.sandbox_id)
    return ("client", (st.client or "").rpartition(":")[0] or "-")


def append_refusal_built(audit, metrics, budget, st: ConnState | None, source: tuple[str, str],
                         reason: str | None, host: str | None, build, tally=None) -> bool:
    """append_refusal, with the record made by build() only when the budget lets it be written:
    a refusal past the budget (a flood: the case that must stay cheap) is only counted (in
    `tally`, an egress.metrics.MetricBatch, when given)."""
    if budget.admit(source, reason, host):
        return append(audit, metrics, build())
    if tally is not None:
        tally.inc(metrics.audit_refusals_counted)
    else:
        metrics.audit_refusals_counted.inc()
    if st is not None:
        st.refusal_counted = True
    return True


def refusal_summaries(counted: dict, *, since: str, interval_s: float, per_interval: int) -> list[dict[str, Any]]:
    """One `refusals_counted` record per source whose refusals past the budget were only counted."""
    out = []
    for (kind, value), c in counted.items():
        rec: dict[str, Any] = {"id": new_id(), "ts": now_ts(), "event": "decision", "decision": "deny",
                               "reason": "refusals_counted"}
        if kind == "sandbox":
            rec["sandbox"] = value
        elif kind == "client":
            rec["client"] = value
        rec["extra"] = {"refused": c.counted, "written": c.written, "max_written": per_interval,
                        "counts": c.counts_text(), "since": since, "interval_s": interval_s}
        out.append(rec)
    return out


def append(audit, metrics, rec: dict[str, Any]) -> bool:
    """Append one record; False (counted, logged) when the log cannot take it: the caller refuses."""
    try:
        audit.append(rec)
        return True
    except (AuditWriteError, OSError, ValueError) as e:
        metrics.audit_errors.inc()
        log.error("audit append failed, refusing flow: %s", e)
        return False
