"""egress/bodies.py without a network: what a streamed body releases, and when it is refused."""
from __future__ import annotations

import gzip
import zlib

import pytest

from egress.bodies import (BodyLimits, BodyRefused, BufferBudget, RequestLeakStream, ResponseScrubStream,
                           check_request_body, scrub_response_body)
from vault import Needles
from vault.forms import value_forms

SECRET = b"sk-live-unit-7f3a9c1e5b2d"
LIMITS = BodyLimits(max_body_bytes=4 << 20, max_decoded_per_read=1 << 20)


def needles():
    return Needles([("openai", value_forms(SECRET))])


def feed_all(stream, chunks):
    out = []
    for c in chunks:
        out += stream(c)
    out += stream(b"")
    return b"".join(out)


def chunked(data: bytes, n: int):
    return [data[i:i + n] for i in range(0, len(data), n)]


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_identity_request_without_secret_passes_unchanged(size):
    refused = []
    body = b"x=1&" * 5000
    assert feed_all(RequestLeakStream(needles(), None, LIMITS, refused.append), chunked(body, size)) == body
    assert refused == []


@pytest.mark.parametrize("encoding,encode", [(None, lambda b: b), ("gzip", gzip.compress), ("deflate", zlib.compress)])
@pytest.mark.parametrize("size", [1, 13, 65536])
def test_secret_in_body_is_refused_before_any_of_it_leaves(encoding, encode, size):
    refused = []
    plain = b"a" * 30000 + b"key=" + SECRET + b"&" + b"b" * 30000
    raw = encode(plain)
    stream = RequestLeakStream(needles(), encoding, LIMITS, refused.append)
    released = b"".join(sum((stream(c) for c in chunked(raw, size)), []) + stream(b""))
    assert [r.reason for r in refused] == ["credential_leak"] and refused[0].secret_ids == ("openai",)
    if encoding is None:
        assert SECRET[:4] not in released   # not even the start of the value left
    else:
        # the raw bytes released decode to less than where the value begins
        d = zlib.decompressobj(wbits=47)
        assert plain.index(SECRET) >= len(d.decompress(released)) or not released
    assert stream(b"more") == []        # refused stays refused


def test_percent_and_json_escaped_secret_is_caught_in_a_stream():
    for spelled in ("".join(f"%{b:02x}" for b in SECRET).encode(),
                    "".join(f"\\u{b:04x}" for b in SECRET).encode()):
        refused = []
        feed_all(RequestLeakStream(needles(), None, LIMITS, refused.append), chunked(b"v=" + spelled, 5))
        assert [r.reason for r in refused] == ["credential_leak"]


def test_undecodable_request_body_is_refused():
    refused = []
    feed_all(RequestLeakStream(needles(), "gzip", LIMITS, refused.append), [b"\x1f\x8b\x08\x00garbage"])
    assert refused and refused[0].reason == "request_undecodable"
    with pytest.raises(BodyRefused) as e:
        RequestLeakStream(needles(), "x-custom", LIMITS, refused.append)
    assert e.value.status == 415


def test_response_is_decoded_and_scrubbed_across_chunks():
    body = (b'{"echo": "Bearer ' + SECRET + b'", "again": "' + SECRET + b'"}') * 3
    refused = []
    out = feed_all(ResponseScrubStream(value_forms(SECRET), "gzip", LIMITS, refused.append),
                   chunked(gzip.compress(body), 3))
    assert refused == [] and SECRET not in out and b"[REDACTED]" in out


@pytest.mark.parametrize("body,reason", [
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03broken", "response_undecodable"),
    (gzip.compress(b"x" * 100)[:-6], "response_undecodable"),                       # truncated
    (gzip.compress(b"v=" + "".join(f"\\u{b:04X}" for b in SECRET).encode()), "response_unscrubbable"),
], ids=["broken-header", "truncated", "escaped-key"])   # gzip's bytes carry the time: no stable id
def test_response_that_cannot_be_made_safe_is_refused(body, reason):
    with pytest.raises(BodyRefused) as e:
        scrub_response_body(body, "gzip", value_forms(SECRET), LIMITS)
    assert e.value.reason == reason and e.value.status == 502
    assert SECRET.decode() not in str(e.value)


def test_a_bomb_is_cut_at_one_reads_decoded_budget_on_the_loop_and_at_the_total_off_it():
    bomb = gzip.compress(b"\0" * (8 << 20))
    with pytest.raises(BodyRefused) as e:
        scrub_response_body(bomb, "gzip", value_forms(SECRET), LIMITS)               # one read -> 8 MiB > 1 MiB
    assert e.value.reason == "body_too_large"
    with pytest.raises(BodyRefused) as e:
        scrub_response_body(bomb, "gzip", value_forms(SECRET), LIMITS, on_loop=False)  # 8 MiB > 4 MiB total
    assert e.value.reason == "body_too_large"
    small = gzip.compress(b"\0" * (3 << 20))
    assert len(scrub_response_body(small, "gzip", value_forms(SECRET), LIMITS, on_loop=False)) == 3 << 20


def test_check_request_body_raises_with_ids_never_values():
    with pytest.raises(BodyRefused) as e:
        check_request_body(b"token=" + SECRET, None, needles(), LIMITS)
    assert e.value.secret_ids == ("openai",) and SECRET.decode() not in str(e.value)
    check_request_body(b"token=harmless", None, needles(), LIMITS)


def test_buffer_budget_is_per_sandbox_and_released():
    b = BufferBudget(100)
    assert b.reserve("a", 60) and not b.reserve("a", 50) and b.reserve("b", 100)
    b.release("a", 60)
    assert b.used("a") == 0 and b.reserve("a", 100)
