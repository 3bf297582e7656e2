"""egress.body_codec: streaming Content-Encoding decoders with an output bound."""
from __future__ import annotations

import gzip
import random
import tracemalloc
import zlib

import brotli
import pytest
from backports import zstd

from egress.body_codec import BodyTooLarge, DecodeError, UnsupportedEncoding, decode_all, make_decoder

MARK = b"sk-MARKER-never-in-a-message-0123456789"
DATA = (b"plain text with the key " + MARK + b" inside\n") * 500 + bytes(range(256)) * 8
LIMIT = 1 << 20


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


ENCODERS = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "deflate": zlib.compress,               # zlib-wrapped, as the RFC says
    "deflate-raw": _raw_deflate,            # raw, as some servers send and browsers accept
    "br": brotli.compress,
    "zstd": zstd.compress,
}


def _header(name: str) -> str:
    return "deflate" if name == "deflate-raw" else name


def _feed_in_chunks(content_encoding, blob: bytes, sizes, max_output=LIMIT) -> bytes:
    dec = make_decoder(content_encoding, max_output=max_output)
    out, i = [], 0
    for size in sizes:
        out.append(dec.feed(blob[i:i + size]))
        i += size
    out.append(dec.feed(blob[i:]))
    out.append(dec.finish())
    assert dec.decoded == len(b"".join(out))
    return b"".join(out)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_each_coding_decodes_whole_and_byte_by_byte(name):
    blob = ENCODERS[name](DATA)
    assert decode_all(_header(name), blob, max_output=LIMIT) == DATA
    assert _feed_in_chunks(_header(name), blob, [1] * len(blob)) == DATA


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_each_coding_at_random_chunk_boundaries(name):
    blob = ENCODERS[name](DATA)
    rnd = random.Random(name)
    for _ in range(20):
        sizes = [rnd.choice((0, 1, 2, 3, 7, 100, 4096)) for _ in range(rnd.randrange(1, 60))]
        assert _feed_in_chunks(_header(name), blob, sizes) == DATA


@pytest.mark.parametrize("header", [None, "", "identity", " Identity ", "identity, identity"])
def test_identity(header):
    assert _feed_in_chunks(header, DATA, [3, 1000, 1]) == DATA


@pytest.mark.parametrize("header, layers", [
    ("gzip, br", ["gzip", "br"]),
    ("GZIP ,  Br", ["gzip", "br"]),
    ("deflate,zstd", ["deflate", "zstd"]),
    ("br, gzip", ["br", "gzip"]),
    ("identity, gzip, identity", ["gzip"]),
    ("zstd, gzip, br", ["zstd", "gzip", "br"]),
])
def test_chains_decode_in_reverse_order_of_application(header, layers):
    blob = DATA
    for name in layers:                      # applied left to right, as the header lists them
        blob = ENCODERS[name](blob)
    assert decode_all(header, blob, max_output=LIMIT) == DATA
    assert _feed_in_chunks(header, blob, [5] * (len(blob) // 5)) == DATA


def test_gzip_members_back_to_back_and_empty_body():
    assert decode_all("gzip", gzip.compress(b"a" * 10) + gzip.compress(b"b" * 10), max_output=LIMIT) == \
        b"a" * 10 + b"b" * 10
    for name in ENCODERS:                    # no body at all: nothing to decode, nothing wrong
        assert decode_all(_header(name), b"", max_output=LIMIT) == b""


@pytest.mark.parametrize("header", ["compress", "x-compress", "x-deflate", "gzip, " + MARK.decode(),
                                    MARK.decode(), "pack200-gzip", "gzip, gzip, gzip, gzip, gzip"])
def test_unsupported_encodings_are_refused_without_quoting_them(header):
    with pytest.raises(UnsupportedEncoding) as info:
        make_decoder(header, max_output=LIMIT)
    assert MARK.decode() not in str(info.value) and "MARKER" not in repr(info.value)


def _corruptions(name: str):
    blob = ENCODERS[name](DATA)
    yield "truncated", blob[:-1]
    yield "half", blob[:len(blob) // 2]
    yield "trailing garbage", blob + MARK
    yield "trailing zero", blob + b"\0"
    if name in ("gzip", "x-gzip", "deflate"):          # the ones with a checksum
        flipped = bytearray(blob)
        flipped[len(blob) // 2] ^= 0x55
        yield "flipped byte", bytes(flipped)
    yield "not that coding at all", MARK * 3


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_corrupt_truncated_or_trailing_bytes_raise_decode_error_without_body_bytes(name):
    for what, blob in _corruptions(name):
        for sizes in ([], [1] * len(blob)):
            dec = make_decoder(_header(name), max_output=LIMIT)
            with pytest.raises(DecodeError) as info:
                i = 0
                for size in sizes:
                    dec.feed(blob[i:i + size])
                    i += size
                dec.feed(blob[i:])
                dec.finish()
            assert b"MARKER" not in str(info.value).encode() and b"MARKER" not in repr(info.value).encode(), what
            with pytest.raises(DecodeError):       # stays failed
                dec.feed(b"more")


def test_zstd_window_over_8_mib_is_refused():
    opts = {zstd.CompressionParameter.window_log: 25}
    c = zstd.ZstdCompressor(options=opts)
    blob = c.compress(DATA) + c.flush()      # streamed: the frame declares a 32 MiB window
    with pytest.raises(DecodeError):
        decode_all("zstd", blob, max_output=LIMIT)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_output_over_the_limit_raises_body_too_large(name):
    blob = ENCODERS[name](DATA)
    with pytest.raises(BodyTooLarge):
        decode_all(_header(name), blob, max_output=len(DATA) - 1)
    assert decode_all(_header(name), blob, max_output=len(DATA)) == DATA
    dec = make_decoder(_header(name), max_output=100)
    with pytest.raises(BodyTooLarge):
        for i in range(len(blob)):
            dec.feed(blob[i:i + 1])
    assert dec.decoded <= 100 + (1 << 20)
    with pytest.raises(BodyTooLarge):
        dec.finish()


def _gzip_bomb(mib: int) -> bytes:
    """About 1 KiB per MiB of zeros: full flushes make each MiB's compressed block identical."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    first = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH) == block
    return first + block * (mib - 1) + c.flush()     # trailer does not match: never reached


def _peak_while(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_gzip_bomb_of_1_gib_stops_at_the_limit_in_bounded_memory():
    bomb = _gzip_bomb(1024)
    assert len(bomb) < 1_200_000
    limit = 64 << 20

    def whole():
        with pytest.raises(BodyTooLarge):
            decode_all("gzip", bomb, max_output=limit)

    def streamed():
        dec = make_decoder("gzip", max_output=limit)
        with pytest.raises(BodyTooLarge):
            for i in range(0, len(bomb), 16384):
                dec.feed(bomb[i:i + 16384])
        assert limit - (1 << 20) <= dec.decoded <= limit + (1 << 20)

    for run in (whole, streamed):
        peak = _peak_while(run)
        assert peak < 80 << 20, f"peak {peak >> 20} MiB"


@pytest.mark.parametrize("header", ["br", "zstd", "gzip, br"])
def test_other_bombs_stop_at_the_limit(header):
    zeros = bytes(1 << 20)
    if header == "br":
        c = brotli.Compressor(quality=1)
        blob = b"".join(c.process(zeros) for _ in range(256)) + c.finish()
    elif header == "zstd":
        c = zstd.ZstdCompressor()
        blob = b"".join(c.compress(zeros) for _ in range(256)) + c.flush()
    else:
        blob = brotli.compress(_gzip_bomb(256), quality=5)
    limit = 16 << 20

    def run():
        with pytest.raises(BodyTooLarge):
            decode_all(header, blob, max_output=limit)
    assert _peak_while(run) < 40 << 20
