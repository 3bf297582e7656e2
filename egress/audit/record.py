"""Audit records: plain dicts with a fixed, closed schema.

Only known keys with simple typed values are accepted, so nobody can dump an
arbitrary object (request headers, a credential binding, ...) into the log.
Serialised records always carry every field, in schema order, `None` where
unset: the file is self-describing and `jq` filters never miss a key.
"""
from __future__ import annotations

import json
import random
import re
import time
from datetime import datetime, timezone
from typing import Any, Optional, Union

import msgspec

EVENTS = frozenset({"decision", "connection_closed", "request", "response", "websocket", "admin", "net_drop", "dns"})
DECISIONS = frozenset({"allow", "deny"})

_STR = (str,)
_INT = (int,)
_NUM = (int, float)
_BOOL = (bool,)

# field -> accepted value types (None is always accepted except where required)
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "id": _STR,
    "ts": _STR,
    "event": _STR,
    "sandbox": _STR,
    "client": _STR,
    "host": _STR,
    "port": _INT,
    "sni": _STR,
    "scheme": _STR,
    "method": _STR,
    "path": _STR,
    "decision": _STR,
    "reason": _STR,
    "rule": _STR,
    "policy": _STR,
    "mode": _STR,
    "would_deny": _BOOL,
    "bytes_in": _INT,
    "bytes_out": _INT,
    "duration_ms": _NUM,
    "upstream": _STR,
    "conn_id": _STR,
    "status": _INT,
    "extra": (dict,),
}
FIELDS: tuple[str, ...] = tuple(FIELD_TYPES)
_EXACT_TYPES = {name: frozenset(types) for name, types in FIELD_TYPES.items()}   # bool only where listed
_KNOWN = frozenset(FIELD_TYPES)
_ALL_NONE = dict.fromkeys(FIELDS)        # a record's keys in schema order (to_line fills in the values)
REQUIRED = ("id", "ts", "event")

# Long strings are cut in make_record so one hostile URL cannot bloat the log.
MAX_STR_LEN = 2048
_TRUNCATED = "...[truncated]"

_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_TS_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
_EXTRA_VALUE_TYPES = (str, int, float, bool, type(None))


def format_ts(dt: datetime) -> str:
    """RFC3339 UTC with milliseconds, e.g. 2024-05-01T10:00:00.123Z."""
    if dt.tzinfo is None:
        raise ValueError("format_ts needs an aware datetime")
    dt = dt.astimezone(timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


_second: tuple[int, str] = (-1, "")   # (unix second, its "YYYY-MM-DDTHH:MM:SS" UTC), swapped whole (threads)


def now_ts() -> str:
    """format_ts(now), cheaply: the date and time of day are formatted once per second."""
    global _second
    t = time.time()
    sec = int(t)
    cached = _second
    if cached[0] != sec:
        cached = _second = (sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec)))
    return f"{cached[1]}.{int((t - sec) * 1000):03d}Z"


def parse_ts(ts: str) -> datetime:
    """Parse a record timestamp (as written by format_ts) into an aware datetime."""
    if not isinstance(ts, str) or not _TS_RE.match(ts):
        raise ValueError(f"bad audit timestamp {ts!r}: want YYYY-MM-DDTHH:MM:SS.mmmZ")
    return datetime.fromisoformat(ts)


_parsed_second: tuple[str, int] = ("", 0)   # ("YYYY-MM-DDTHH:MM:SS", its epoch microseconds), swapped whole


def ts_epoch_ms(ts: str) -> int:
    """filters.to_epoch_ms(parse_ts(ts)), the same integer, cheaply: the date and time of day
    are parsed once per second of records (the index and validate() read thousands a second)."""
    global _parsed_second
    if not isinstance(ts, str) or not _TS_RE.match(ts):
        raise ValueError(f"bad audit timestamp {ts!r}: want YYYY-MM-DDTHH:MM:SS.mmmZ")
    second, cached = ts[:19], _parsed_second
    if cached[0] != second:
        moment = datetime.fromisoformat(second).replace(tzinfo=timezone.utc)   # ValueError: no such date
        cached = _parsed_second = (second, int(moment.timestamp()) * 1_000_000)
    # datetime.timestamp() is the microseconds since the epoch / 10**6, correctly rounded: so is this
    return int((cached[1] + int(ts[20:23]) * 1000) / 1_000_000 * 1000)


def _strip_query(path: str) -> str:
    # Query strings and fragments often carry tokens; the audit log never holds them.
    for sep in ("?", "#"):
        cut = path.find(sep)
        if cut >= 0:
            path = path[:cut]
    return path


def _clip(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_STR_LEN:
        return value[: MAX_STR_LEN - len(_TRUNCATED)] + _TRUNCATED
    return value


_getrandbits = random.getrandbits
_UUID4_BITS = (4 << 76) | (2 << 62)          # version 4, RFC 4122 variant
_UUID4_MASK = ~((0xF << 76) | (0x3 << 62))


def new_id() -> str:
    """uuid.uuid4().hex, without building a UUID object: 122 random bits, 32 lowercase hex digits.
    An id names a record (unique, not secret): the random module's generator (seeded from
    os.urandom in each process, reseeded in a forked child), not a getrandom() syscall per id."""
    return f"{_getrandbits(128) & _UUID4_MASK | _UUID4_BITS:032x}"


def make_record(event: str, **fields: Any) -> dict[str, Any]:
    """Build a validated record with a fresh id and timestamp.

    `path` loses its query string and fragment; strings longer than
    MAX_STR_LEN are truncated. Unknown keys raise ValueError.
    """
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown audit record key(s): {', '.join(sorted(unknown))}")
    rec: dict[str, Any] = {name: None for name in FIELDS}
    rec["id"] = new_id()
    rec["ts"] = now_ts()
    rec.update(fields)
    rec["event"] = event
    if isinstance(rec["path"], str):
        rec["path"] = _strip_query(rec["path"])
    for name in FIELDS:
        rec[name] = _clip(rec[name])
    if isinstance(rec["extra"], dict):
        rec["extra"] = {k: _clip(v) for k, v in rec["extra"].items()}
    validate(rec)
    return rec


def validate(record: Any) -> None:
    """Raise ValueError unless `record` fits the schema (missing optional keys are fine)."""
    if not isinstance(record, dict):
        raise ValueError(f"audit record must be a dict, not {type(record).__name__}")
    if not _KNOWN.issuperset(record):
        unknown = [k for k in record if k not in FIELD_TYPES]
        raise ValueError(f"unknown audit record key(s): {', '.join(sorted(map(str, unknown)))}")
    for name in REQUIRED:
        if record.get(name) is None:
            raise ValueError(f"audit record is missing {name!r}")
    exact = _EXACT_TYPES
    for name, value in record.items():
        if value is None or type(value) in exact[name]:
            continue   # the usual case, without isinstance calls; subclasses take the general check
        types = FIELD_TYPES[name]
        # bool is an int subclass; only would_deny may be a bool.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = "/".join(t.__name__ for t in types)
            raise ValueError(f"audit field {name!r} must be {want} or None, not {type(value).__name__}")
    if not _ID_RE.match(record["id"]):
        raise ValueError(f"audit id must be 32 lowercase hex chars, got {record['id']!r}")
    ts_epoch_ms(record["ts"])
    if record["event"] not in EVENTS:
        raise ValueError(f"unknown audit event {record['event']!r}; one of {sorted(EVENTS)}")
    if record.get("decision") is not None and record["decision"] not in DECISIONS:
        raise ValueError(f"audit decision must be 'allow' or 'deny', got {record['decision']!r}")
    port = record.get("port")
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"audit port out of range: {port}")
    extra = record.get("extra")
    if extra is not None:
        for key, value in extra.items():
            if not isinstance(key, str):
                raise ValueError(f"audit extra keys must be str, got {type(key).__name__}")
            if not isinstance(value, _EXTRA_VALUE_TYPES):
                raise ValueError(
                    f"audit extra[{key!r}] must be a scalar (str/int/float/bool/None), "
                    f"not {type(value).__name__}"
                )
            if isinstance(value, float) and value != value:
                raise ValueError(f"audit extra[{key!r}] is NaN")


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)   # made once, not per line
# What _ENCODER.encode builds anew on every call (json's C encoder), built once. No circular-reference
# markers: validate() leaves only scalars and one flat dict of scalars. Pure-Python json: encode().
_encode_chunks = (json.encoder.c_make_encoder(None, _ENCODER.default, json.encoder.encode_basestring_ascii, None,
                                              ":", ",", False, False, False)
                  if json.encoder.c_make_encoder is not None else None)


def to_line(record: dict[str, Any]) -> bytes:
    """Validate and serialise one record as a single JSON line (ASCII, ends in \\n)."""
    validate(record)
    ordered = _ALL_NONE.copy()
    ordered.update(record)                  # (validate: no key outside FIELDS, so the order stays)
    try:
        text = "".join(_encode_chunks(ordered, 0)) if _encode_chunks is not None else _ENCODER.encode(ordered)
    except ValueError as exc:  # NaN / inf in duration_ms or extra
        raise ValueError(f"audit record not serialisable: {exc}") from None
    return text.encode("ascii") + b"\n"


def _line_type(name: str, types: tuple[type, ...]) -> Any:
    """FIELD_TYPES[name] as a msgspec type: None allowed except for the required fields."""
    t = {_STR: str, _INT: int, _NUM: Union[int, float], _BOOL: bool,
         (dict,): dict[str, Union[str, int, float, bool, None]]}[types]
    return t if name in REQUIRED else Optional[t]


# A line's record typed in one C pass (unknown keys, wrong types, bool for int, null for a required
# field: refused, as validate() refuses them). REQUIRED are FIELDS' first three (no default first).
_LineRecord = msgspec.defstruct(
    "_LineRecord", [(n, _line_type(n, t)) if n in REQUIRED else (n, _line_type(n, t), None)
                    for n, t in FIELD_TYPES.items()], forbid_unknown_fields=True)
_decode_line = msgspec.json.Decoder(_LineRecord).decode
_as_dict = msgspec.structs.asdict


def parse_line(line: bytes | str) -> tuple[dict[str, Any], int] | None:
    """(record, ts_epoch_ms(record["ts"])) of one complete line; None for garbage: the answer of
    json.loads + validate() (from_line), which decide whatever msgspec refuses (a lone surrogate
    escape: paths are read with surrogateescape; NaN; numbers past a double)."""
    try:
        r = _decode_line(line)
    except (msgspec.MsgspecError, UnicodeError):     # (a str line holding a lone surrogate)
        rec = _from_line_json(line)
        return None if rec is None else (rec, ts_epoch_ms(rec["ts"]))
    # validate()'s checks of values (the types were the decoder's)
    if r.event not in EVENTS or (r.decision is not None and r.decision not in DECISIONS) \
            or (r.port is not None and not 0 <= r.port <= 65535) or not _ID_RE.match(r.id):
        return None
    try:
        ts_ms = ts_epoch_ms(r.ts)
    except ValueError:
        return None
    return _as_dict(r), ts_ms


def from_line(line: bytes | str) -> dict[str, Any] | None:
    """Parse one complete line; None for garbage (torn or foreign lines are skipped)."""
    parsed = parse_line(line)
    return None if parsed is None else parsed[0]


def _from_line_json(line: bytes | str) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict):
        return None
    try:
        validate(rec)
    except ValueError:
        return None
    return rec
