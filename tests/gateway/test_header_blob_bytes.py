"""header_blob (what the header leak check scans) builds the same bytes as the loop it replaced."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from egress.credentials import header_blob


def _reference(url: str, fields) -> bytes:
    parts = [url.encode("utf-8", "replace")]
    for k, v in fields:
        parts.append(k + b": " + v)
    parts.append(b"".join(v for _, v in fields))
    return b"\n".join(parts)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30), st.lists(st.tuples(st.binary(max_size=10), st.binary(max_size=10)), max_size=8))
def test_the_same_bytes_as_the_reference(url, fields):
    assert header_blob(url, fields) == _reference(url, fields)


def test_a_secret_split_across_two_headers_is_whole_in_the_blob():
    blob = header_blob("http://h/x", [(b"A", b"sk-12"), (b"B", b"34")])
    assert blob.endswith(b"\nsk-1234") and b"A: sk-12\nB: 34" in blob
