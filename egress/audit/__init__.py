"""Audit subsystem: append-only JSONL log (source of truth), SQLite index, tail, CLI."""
from .index import AuditIndex
from .log import AuditLog, AuditWriteError
from .record import EVENTS, FIELDS, make_record, validate
from .tail import LogReader, follow, iter_records

__all__ = [
    "AuditIndex", "AuditLog", "AuditWriteError", "EVENTS", "FIELDS", "LogReader",
    "follow", "iter_records", "make_record", "validate",
]
