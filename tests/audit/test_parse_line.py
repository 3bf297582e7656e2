"""parse_line (msgspec, the index's reader) gives json.loads + validate()'s answer on every line:
the records to_line writes, JSON objects with any of the schema's keys and odd values, and bytes
that are no JSON at all (hypothesis, the old reader as the oracle)."""
from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from egress.audit.index import AuditIndex
from egress.audit.log import AuditLog
from egress.audit.record import (FIELDS, _from_line_json, make_record, new_id, now_ts, parse_line, to_line,
                                 ts_epoch_ms)

from .test_record_line_bytes import records


_oracle = _from_line_json   # json.loads + validate(): the reader msgspec's pass must agree with


def _same_answer(line: bytes | str) -> None:
    want, got = _oracle(line), parse_line(line)
    if want is None:
        assert got is None, line
        return
    assert got is not None, line
    rec, ts_ms = got
    assert {**dict.fromkeys(FIELDS), **want} == {**dict.fromkeys(FIELDS), **rec}
    assert ts_ms == ts_epoch_ms(want["ts"])


@settings(max_examples=300, deadline=None)
@given(records())
def test_every_written_record_reads_back_whole(drawn):
    line = to_line(make_record(drawn[0], **drawn[1]))
    rec, ts_ms = parse_line(line)
    assert rec == json.loads(line) and ts_ms == ts_epoch_ms(rec["ts"])
    _same_answer(line.decode("ascii"))


_ODD_TEXT = st.text(max_size=8) | st.sampled_from(["\udc80", "/a\udcff", "\ud800x", "\x00", "é"])
_ODD = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | _ODD_TEXT
        | st.lists(st.integers(), max_size=2) | st.dictionaries(_ODD_TEXT, st.none() | st.booleans()
                                                               | st.integers() | st.floats() | _ODD_TEXT
                                                               | st.lists(st.none(), max_size=1), max_size=3))
_GOOD = {"id": st.sampled_from([new_id(), "x", new_id().upper()]),
         "ts": st.sampled_from([now_ts(), "2026-02-30T00:00:00.000Z", "yesterday"]),
         "event": st.sampled_from(["request", "decision", "nope"]),
         "decision": st.sampled_from(["allow", "deny", "maybe"]),
         "port": st.integers(-2, 70000)}


@st.composite
def objects(draw):
    obj = {}
    for name in draw(st.lists(st.sampled_from([*FIELDS, "headers"]), unique=True, max_size=12)):
        obj[name] = draw(_GOOD[name] | _ODD) if name in _GOOD and draw(st.booleans()) else draw(_ODD)
    for name in ("id", "ts", "event"):
        if draw(st.integers(0, 9)):
            obj[name] = draw(_GOOD[name])
    return obj


@settings(max_examples=1500, deadline=None)
@given(objects(), st.booleans(), st.booleans())
def test_any_object_gets_the_old_readers_answer(obj, ascii_only, as_bytes):
    line = json.dumps(obj, ensure_ascii=ascii_only)        # NaN and Infinity too (json writes them)
    _same_answer(line.encode("utf-8", "surrogatepass") if as_bytes else line)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | st.sampled_from([b"[1,2]", b"{}", b"null", b'{"id": "\xff"}', b"\xef\xbb\xbf{}"]))
def test_bytes_that_are_no_record_are_garbage_for_both(raw):
    _same_answer(raw)


def test_a_path_read_with_surrogateescape_is_indexed(tmp_path):
    """The fast path decodes a request's path with surrogateescape: to_line writes a lone surrogate
    escape, which msgspec refuses; the record is still indexed (the old reader decides it)."""
    path = b"/caf\xe9".decode("utf-8", "surrogateescape")
    with AuditLog(tmp_path, fsync="never") as log:
        log.append(make_record("request", sandbox="sb-1", host="example.com", path=path))
    with AuditIndex(tmp_path / "idx.db", tmp_path) as idx:
        assert idx.sync() == 1 and idx.bad_lines == 0
        (got,) = idx.query(sandbox="sb-1")
        assert got["path"] == path
