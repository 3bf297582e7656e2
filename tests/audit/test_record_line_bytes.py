"""to_line's bytes are those of the validate-then-JSONEncoder.encode it replaced, on any valid
record (hypothesis); validate still refuses a wrong type in a shape it has just seen pass, and
to_line a NaN."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from egress.audit import record as audit_record
from egress.audit.record import FIELD_TYPES, FIELDS, make_record, new_id, now_ts, to_line, validate

_REFERENCE_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _reference_line(rec: dict) -> bytes:
    validate(rec)
    ordered = dict.fromkeys(FIELDS)
    ordered.update(rec)
    return _REFERENCE_ENCODER.encode(ordered).encode("ascii") + b"\n"


_TEXT = st.text(max_size=20)      # any unicode: the escapes must match too
_SCALAR = st.none() | _TEXT | st.integers(-2**70, 2**70) | st.booleans() | st.floats(allow_nan=False, allow_infinity=False)
_VALUES = {
    str: _TEXT,
    int: st.integers(0, 65535),
    float: st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 10**6),
    bool: st.booleans(),
    dict: st.dictionaries(_TEXT, _SCALAR, max_size=4),
}
_OPTIONAL = [n for n in FIELDS if n not in ("id", "ts", "event", "decision")]


@st.composite
def records(draw):
    fields = {}
    for name in draw(st.lists(st.sampled_from(_OPTIONAL), unique=True, max_size=len(_OPTIONAL))):
        kinds = FIELD_TYPES[name]
        fields[name] = draw(st.none() | _VALUES[float if float in kinds else kinds[0]])
    fields["decision"] = draw(st.sampled_from([None, "allow", "deny"]))
    return draw(st.sampled_from(sorted(audit_record.EVENTS))), fields


@settings(max_examples=500, deadline=None)
@given(records())
def test_to_line_bytes_are_the_reference_bytes(drawn):
    rec = make_record(drawn[0], **drawn[1])
    assert to_line(rec) == _reference_line(rec)
    assert audit_record.from_line(to_line(rec)) == json.loads(_reference_line(rec))


def test_the_gateways_request_record_shape():
    rec = {"id": new_id(), "ts": now_ts(), "event": "request", "conn_id": "c1", "client": "10.0.0.2",
           "sandbox": "sb-1", "host": "example.com", "port": 80, "scheme": "http", "method": "GET",
           "path": "/x\u00e9", "decision": "allow", "reason": "rule", "status": 200, "bytes_in": 10,
           "bytes_out": 615, "duration_ms": 0.5, "extra": {"k": 1.5, "n": None, "b": True}}
    assert to_line(rec) == _reference_line(rec)


def test_a_wrong_type_in_a_shape_that_passed_is_still_refused():
    good = {"id": new_id(), "ts": now_ts(), "event": "request", "port": 80, "would_deny": True}
    validate(good)
    with pytest.raises(ValueError, match="'port' must be int"):
        validate({**good, "port": True})           # bool is no port, though it is an int
    with pytest.raises(ValueError, match="'port' must be int"):
        validate({**good, "port": "80"})
    validate(good)                                 # and the good shape still passes


def test_nan_is_still_refused_by_to_line():
    rec = {"id": new_id(), "ts": now_ts(), "event": "request", "duration_ms": float("nan")}
    with pytest.raises(ValueError, match="not serialisable"):
        to_line(rec)
