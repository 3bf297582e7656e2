"""Audit: filtered query (the SQLite index), export as JSON lines, live tail (server-sent events).

The tail reads the JSONL files themselves (egress.audit.tail.LogReader, one reader per
stream, starting at the end) and applies the same filters as the query (RecordFilter).
Bounded: at most ctx.max_streams streams at once, at most TAIL_BATCH records sent per
poll (the rest is counted as skipped), and a stream ends when its session does.
"""
from __future__ import annotations

import asyncio
import json
import time

from httpkit import ApiError

from egress.audit.filters import RecordFilter
from egress.audit.tail import LogReader

from . import forms
from .base import ConsoleHandler

EXPORT_MAX = 100_000
EXPORT_CHUNK = 1000
TAIL_POLL = 0.5
TAIL_BATCH = 200
TAIL_MAX_SECONDS = 3600.0      # then the browser reconnects (EventSource does so by itself)
DECISIONS = ("allow", "deny")


def _filters(handler: ConsoleHandler) -> dict[str, str]:
    return forms.audit_filters({k: handler.get_query_argument(k, "") for k in forms.AUDIT_FILTERS})


def _check(filters: dict) -> RecordFilter:
    try:
        return RecordFilter.build(**filters)
    except ValueError as e:
        raise forms.invalid(str(e)) from None


class AuditPage(ConsoleHandler):
    action = "console.audit"
    template = "audit.html"

    async def page_context(self) -> dict:
        filters = _filters(self)
        return {"filters": filters, "records": [], "limit": 200, "decisions": DECISIONS,
                "query_string": self.request.query}

    async def get(self) -> None:
        filters = _filters(self)
        _check(filters)
        limit = forms.audit_limit(self.get_query_argument("limit", ""))
        records = await self.run(self.ctx.audit_index.query, **filters, limit=limit)
        await self.render_page(self.template, records=records, limit=limit)


class AuditExport(ConsoleHandler):
    """The filtered records, oldest first, as a JSON-lines download (audited: it is a bulk read)."""
    action = "console.audit.export"
    audit_reads = True

    async def get(self) -> None:
        filters = _filters(self)
        _check(filters)
        records = await self.run(self.ctx.audit_index.query, **filters, limit=EXPORT_MAX, order="asc")
        self.audit["records"] = len(records)
        self.set_header("Content-Type", "application/x-ndjson")
        self.set_header("Content-Disposition", 'attachment; filename="cubegate-audit.jsonl"')
        for i in range(0, len(records), EXPORT_CHUNK):
            self.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records[i:i + EXPORT_CHUNK]))
            await self.flush()
        self.finish()


class AuditStream(ConsoleHandler):
    """New records matching the filters: `record` events, `skipped` {count} when over the batch."""
    action = "console.audit.stream"
    kind, touch = "api", False

    async def get(self) -> None:
        flt = _check(_filters(self))
        ctx = self.ctx
        if ctx.streams >= ctx.max_streams:
            raise ApiError(429, "busy", f"{ctx.max_streams} live streams are open already")
        ctx.streams += 1
        try:
            await self._tail(flt)
        finally:
            ctx.streams -= 1
        if not self._finished:
            self.finish()

    async def _tail(self, flt: RecordFilter) -> None:
        reader = LogReader(self.ctx.audit_dir)
        await self.run(reader.skip_existing)
        self.begin_events()
        if not await self.send_event({"filters": _filters(self)}, event="hello"):
            return
        started, quiet = time.monotonic(), 0.0
        sid = self.get_cookie(self.cookie_name)
        while time.monotonic() - started < TAIL_MAX_SECONDS:
            if self.sessions.get(sid, touch=False) is None:     # logged out or idle: the stream ends too
                await self.send_event({"reason": "session ended"}, event="end")
                return
            batch = await self.run(lambda: [r for r in reader.read_new() if flt.matches(r)])
            for rec in batch[-TAIL_BATCH:]:
                if not await self.send_event(rec, event="record"):
                    return
            if len(batch) > TAIL_BATCH and not await self.send_event({"count": len(batch) - TAIL_BATCH},
                                                                      event="skipped"):
                return
            quiet = 0.0 if batch else quiet + TAIL_POLL
            if quiet >= 15.0:
                quiet = 0.0
                if not await self.send_comment("keepalive"):
                    return
            if not self.events_open:
                return
            await asyncio.sleep(TAIL_POLL)
