import json

import pytest

from egress.audit.log import AuditLog
from egress.audit.record import FIELDS, from_line, make_record, to_line, validate

from ._util import rec


def test_record_has_full_fixed_schema():
    r = make_record("decision", sandbox="sb1", host="a.example", port=443, decision="deny",
                    reason="no_rule", would_deny=True, duration_ms=1.5)
    assert tuple(r) == FIELDS
    assert len(r["id"]) == 32 and int(r["id"], 16) >= 0
    assert r["ts"].endswith("Z") and len(r["ts"]) == len("2024-01-01T00:00:00.000Z")
    line = to_line(r)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert list(json.loads(line)) == list(FIELDS)
    assert from_line(line) == r


def test_unknown_key_rejected_by_make_record():
    with pytest.raises(ValueError, match="unknown audit record key.*headers"):
        make_record("request", headers={"Authorization": "Bearer x"})


def test_unknown_key_rejected_by_append_and_nothing_written(audit_dir):
    r = rec()
    r["headers"] = {"authorization": "Bearer secret"}
    with AuditLog(audit_dir, fsync="never") as log:
        with pytest.raises(ValueError, match="headers"):
            log.append(r)
    assert (audit_dir / "audit-current.jsonl").read_bytes() == b""


@pytest.mark.parametrize("field,value", [
    ("port", "443"), ("port", True), ("port", 70000), ("would_deny", 1), ("decision", "maybe"),
    ("host", {"x": 1}), ("bytes_in", 1.5), ("extra", {"h": {"nested": "no"}}),
    ("extra", {"h": ["a"]}), ("extra", {"f": float("nan")}),
])
def test_bad_values_rejected(field, value):
    with pytest.raises(ValueError):
        make_record("decision", **{field: value})


def test_bad_event_and_missing_required():
    with pytest.raises(ValueError, match="event"):
        make_record("whatever")
    r = rec()
    del r["id"]
    with pytest.raises(ValueError, match="id"):
        validate(r)


def test_path_loses_query_and_long_strings_are_cut():
    r = make_record("request", path="/v1/x?api_key=SECRET#frag", host="h" * 5000)
    assert r["path"] == "/v1/x"
    assert len(r["host"]) == 2048 and r["host"].endswith("[truncated]")


def test_from_line_skips_garbage():
    assert from_line(b"not json\n") is None
    assert from_line(b'{"id":"x"}\n') is None
    assert from_line(b"[1,2]\n") is None


def test_ts_epoch_ms_is_the_parsed_timestamp_in_ms():
    """The index stores ts_epoch_ms; filters compare against to_epoch_ms(parse_ts(...)): the
    same integer for every millisecond (float rounding included), across second boundaries."""
    import random
    from datetime import datetime, timedelta, timezone

    from egress.audit.filters import to_epoch_ms
    from egress.audit.record import format_ts, parse_ts, ts_epoch_ms
    rnd = random.Random(11)
    start = datetime(2026, 12, 1, 13, 0, 0, tzinfo=timezone.utc)
    stamps = [format_ts(start + timedelta(milliseconds=ms)) for ms in range(3000)]
    stamps += [format_ts(datetime.fromtimestamp(rnd.uniform(0, 4e9), timezone.utc)) for _ in range(3000)]
    for ts in stamps:
        assert ts_epoch_ms(ts) == to_epoch_ms(parse_ts(ts)), ts


@pytest.mark.parametrize("ts", ["2026-02-30T10:00:00.000Z", "2026-12-01T24:00:00.000Z", "2026-12-01T10:00:00Z",
                                "2026-12-01 10:00:00.000Z", 1700000000])
def test_ts_epoch_ms_refuses_what_parse_ts_refuses(ts):
    from egress.audit.record import ts_epoch_ms
    with pytest.raises(ValueError):
        ts_epoch_ms(ts)
    with pytest.raises(ValueError):
        validate({"id": "0" * 32, "ts": ts, "event": "decision"})
