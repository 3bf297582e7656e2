"""Streaming decoders for HTTP Content-Encoding, bounded in output (pure, no I/O).

    dec = make_decoder(response.headers.get("content-encoding"), max_output=64 << 20)
    for chunk in body: scan(dec.feed(chunk))
    scan(dec.finish())            # DecodeError: truncated or trailing bytes

identity, gzip / x-gzip (several members, as zcat reads them), deflate (zlib-
wrapped or raw, as browsers accept), br, zstd (window <= 8 MiB, RFC 9659) and
chains of them ("gzip, br": decoded br first). Anything else: UnsupportedEncoding.
Output is produced in pieces of at most 1 MiB, and BodyTooLarge is raised as
soon as the decoded total would pass max_output, so a bomb never materialises
much more than max_output. No message carries body or header bytes.
"""
from __future__ import annotations

import zlib
from typing import Iterator

import brotli
from backports import zstd

_GZIP_MAGIC = b"\x1f\x8b"
_PIECE = 1 << 20          # largest piece one decompress call may produce
_MAX_CODINGS = 4          # longer chains are refused: each stage holds a window
_ZSTD_WINDOW_LOG_MAX = 23  # 8 MiB: what RFC 9659 asks HTTP decoders to accept


class UnsupportedEncoding(ValueError):
    """A Content-Encoding this gateway cannot decode (so cannot inspect)."""


class DecodeError(ValueError):
    """The body is not valid in its Content-Encoding (corrupt, truncated, trailing bytes)."""


class BodyTooLarge(ValueError):
    """The decoded body would exceed its limit."""


class _Identity:
    name = "identity"

    def pieces(self, data: bytes) -> Iterator[bytes]:
        if data:
            yield data

    def end(self) -> Iterator[bytes]:
        return iter(())


class _Zlib:
    """gzip (wbits 31, members back to back) or zlib/raw deflate (one stream)."""

    def __init__(self, name: str, wbits: int | None, members: bool):
        self.name, self._wbits, self._members = name, wbits, members
        self._d = zlib.decompressobj(wbits) if wbits is not None else None
        self._head = b""           # deflate: first bytes, until the wrapper is known
        self._seen_input = False

    def _start_deflate(self) -> None:
        cmf, flg = self._head[0], self._head[1] if len(self._head) > 1 else 0
        wrapped = len(self._head) > 1 and cmf & 0x0F == 8 and cmf >> 4 <= 7 and (cmf << 8 | flg) % 31 == 0
        self._d = zlib.decompressobj(15 if wrapped else -15)

    def pieces(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self._seen_input = True
        if self._d is None:                       # deflate: wait for two bytes to tell
            self._head += data
            if len(self._head) < 2:
                return
            self._start_deflate()
            data, self._head = self._head, b""
        yield from self._decompress(data)

    def _decompress(self, pending: bytes) -> Iterator[bytes]:
        while True:
            if self._d.eof and pending:
                if not self._members or not _GZIP_MAGIC.startswith(pending[:2]):
                    raise DecodeError(f"{self.name}: bytes after the end of the stream")
                self._d = zlib.decompressobj(self._wbits)   # next gzip member
            try:
                out = self._d.decompress(pending, _PIECE)
            except zlib.error:
                raise DecodeError(f"{self.name}: corrupt data") from None
            if out:
                yield out
            if self._d.eof:
                pending = self._d.unused_data
                if not pending:
                    return
            else:
                pending = self._d.unconsumed_tail
                if not pending and len(out) < _PIECE:
                    return

    def end(self) -> Iterator[bytes]:
        if self._d is None and self._head:        # one byte of deflate: cannot be complete
            self._start_deflate()
            yield from self._decompress(self._head)
            self._head = b""
        if self._seen_input and not self._d.eof:
            raise DecodeError(f"{self.name}: truncated stream")


class _Brotli:
    name = "br"

    def __init__(self) -> None:
        self._d = brotli.Decompressor()
        self._seen_input = False

    def pieces(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        if self._d.is_finished():
            raise DecodeError("br: bytes after the end of the stream")
        self._seen_input = True
        try:
            out = self._d.process(data, output_buffer_limit=_PIECE)
            while True:
                if out:
                    yield out
                if self._d.can_accept_more_data():
                    return
                out = self._d.process(b"", output_buffer_limit=_PIECE)
        except brotli.error:
            raise DecodeError("br: corrupt data") from None

    def end(self) -> Iterator[bytes]:
        if self._seen_input and not self._d.is_finished():
            raise DecodeError("br: truncated stream")
        return iter(())


class _Zstd:
    name = "zstd"

    def __init__(self) -> None:
        self._d = self._new()
        self._seen_input = False

    @staticmethod
    def _new() -> zstd.ZstdDecompressor:
        return zstd.ZstdDecompressor(options={zstd.DecompressionParameter.window_log_max: _ZSTD_WINDOW_LOG_MAX})

    def pieces(self, data: bytes) -> Iterator[bytes]:
        if not data:
            return
        self._seen_input = True
        pending = data
        try:
            while True:
                if self._d.eof:
                    if not pending:
                        return
                    self._d = self._new()                 # next frame
                out = self._d.decompress(pending, _PIECE)
                pending = b""
                if out:
                    yield out
                if self._d.eof:
                    pending = self._d.unused_data
                elif self._d.needs_input:
                    return
        except zstd.ZstdError:
            raise DecodeError("zstd: corrupt data") from None

    def end(self) -> Iterator[bytes]:
        if self._seen_input and not self._d.eof:
            raise DecodeError("zstd: truncated stream")
        return iter(())


_CODINGS = {
    "gzip": lambda: _Zlib("gzip", 31, members=True),
    "x-gzip": lambda: _Zlib("gzip", 31, members=True),
    "deflate": lambda: _Zlib("deflate", None, members=False),
    "br": _Brotli,
    "zstd": _Zstd,
}


class Decoder:
    """Decodes one body: feed() its chunks in order, then finish() once."""

    def __init__(self, stages: list, max_output: int, max_per_feed: int | None = None):
        self._stages = stages or [_Identity()]
        self._max_output = max_output
        # One call's output, bounded: the work one network read can cause where it is
        # decoded (on the event loop), however compressible the stream is.
        self._max_per_feed = max_per_feed
        # Intermediate streams are never kept whole; their bound only caps the work.
        self._max_between = 2 * max_output + _PIECE
        self._between = [0] * len(self._stages)
        self.decoded = 0
        self._failed: ValueError | None = None

    def feed(self, chunk: bytes) -> bytes:
        return self._collect(lambda: self._through(1, self._stages[0].pieces(bytes(chunk))))

    def finish(self) -> bytes:
        """The rest of the output; DecodeError if a stage's stream is incomplete."""
        def ends() -> Iterator[bytes]:
            for i, stage in enumerate(self._stages):
                yield from self._through(i + 1, stage.end())
        return self._collect(ends)

    def _through(self, index: int, pieces: Iterator[bytes]) -> Iterator[bytes]:
        """Push pieces of stage index-1's output through stages index.. (the last one's output out)."""
        if index >= len(self._stages):
            yield from pieces
            return
        for piece in pieces:
            self._between[index] += len(piece)
            if self._between[index] > self._max_between:
                raise BodyTooLarge("decoded body too large")
            yield from self._through(index + 1, self._stages[index].pieces(piece))

    def _collect(self, run) -> bytes:
        if self._failed is not None:         # fail closed: a broken decoder stays broken
            raise self._failed
        out = []
        produced = 0
        try:
            for piece in run():
                self.decoded += len(piece)
                produced += len(piece)
                if self.decoded > self._max_output:
                    out.clear()
                    raise BodyTooLarge("decoded body too large")
                if self._max_per_feed is not None and produced > self._max_per_feed:
                    out.clear()
                    raise BodyTooLarge("one read of the body decodes to too much")
                out.append(piece)
        except (DecodeError, BodyTooLarge) as exc:
            self._failed = exc
            raise
        return b"".join(out)


def make_decoder(content_encoding: str | None, *, max_output: int, max_per_feed: int | None = None) -> Decoder:
    """A decoder for the codings named in a Content-Encoding header (applied left to right)."""
    names = [t.strip().lower() for t in (content_encoding or "").split(",")]
    names = [n for n in names if n and n != "identity"]
    if len(names) > _MAX_CODINGS:
        raise UnsupportedEncoding("too many content codings")
    if any(n not in _CODINGS for n in names):
        raise UnsupportedEncoding("unsupported content-encoding")
    return Decoder([_CODINGS[n]() for n in reversed(names)], max_output, max_per_feed)


def decode_all(content_encoding: str | None, data: bytes, *, max_output: int) -> bytes:
    decoder = make_decoder(content_encoding, max_output=max_output)
    return decoder.feed(data) + decoder.finish()
