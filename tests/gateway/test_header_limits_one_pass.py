"""check_header_limits scans the values once: the same answer as the three-scans-per-value
check it replaced, on any header list (hypothesis), including hostile bytes and bounds."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from egress.http_checks import Refusal, check_header_limits


def _reference(fields, *, max_count: int, max_bytes: int) -> Refusal | None:
    """The previous implementation, kept verbatim as the oracle."""
    count = 0
    size = 0
    for name, value in fields:
        count += 1
        size += len(name) + len(value) + 4
        if b"\r" in value or b"\n" in value or b"\x00" in value:
            return Refusal(400, "bad_header_value", f"header {name.decode('latin-1')!r} contains CR, LF or NUL")
    if count > max_count:
        return Refusal(431, "too_many_headers", f"{count} headers, limit {max_count}")
    if size > max_bytes:
        return Refusal(431, "headers_too_large", f"{size} bytes of headers, limit {max_bytes}")
    return None


_BYTES = st.binary(max_size=12) | st.sampled_from([b"", b"a\rb", b"\n", b"x\x00", b"ok", b"\xff\xfe"])
_FIELDS = st.lists(st.tuples(_BYTES, _BYTES), max_size=12)


@settings(max_examples=400, deadline=None)
@given(_FIELDS, st.integers(0, 14), st.integers(0, 200))
def test_one_pass_answers_as_the_reference(fields, max_count, max_bytes):
    want = _reference(fields, max_count=max_count, max_bytes=max_bytes)
    assert check_header_limits(fields, max_count=max_count, max_bytes=max_bytes) == want
    assert check_header_limits(iter(fields), max_count=max_count, max_bytes=max_bytes) == want   # any iterable


def test_the_first_bad_header_is_named_and_wins_over_the_bounds():
    fields = [(b"A", b"ok"), (b"B", b"x\ny"), (b"C", b"\x00")] * 50
    got = check_header_limits(fields, max_count=3, max_bytes=10)
    assert got == Refusal(400, "bad_header_value", "header 'B' contains CR, LF or NUL")


def test_a_bad_byte_at_a_values_edge_is_found_and_clean_values_pass():
    """Values are scanned joined: a bad last byte of one value names that header."""
    assert check_header_limits([(b"A", b"x"), (b"B", b"y")], max_count=2, max_bytes=100) is None
    assert check_header_limits([(b"A", b"x\r"), (b"B", b"y")], max_count=2, max_bytes=100).reason == "bad_header_value"
