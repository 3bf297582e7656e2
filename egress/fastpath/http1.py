"""HTTP/1.1 messages read with llhttp (httptools), strict: the fast plain-HTTP path's parser.

Pure parsing, no I/O. llhttp is used as shipped (no lenient flags): it refuses CL+TE,
duplicate Content-Length, obs-fold, bare CR/LF, NUL, invalid chunk sizes. What it still
accepts and a proxy must not (several Transfer-Encodings, trailers) is refused by the
caller (egress.http_checks.check_framing) or turned into an event here.

Requests become a queue of events the connection works through in order:
  ("head", RequestHead) ("body", bytes) ("end", None) ("trailers", None) ("error", why)
  ("upgrade", None)
The responses of one upstream connection are read by its ResponseReader, which calls its
sink as it goes.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import httptools


@dataclass
class RequestHead:
    method: str
    target: bytes
    version: str
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool
    chunked: bool
    content_length: int | None
    replay: bytearray | None = None    # raw bytes from this request's first on (None: not known whole)
    names: list[bytes] = field(default_factory=list)    # headers' names lowercased, in their order
    by_name: dict[bytes, list[bytes]] = field(default_factory=dict)   # lowercased name → its values in order

    def __post_init__(self) -> None:
        if not self.names and self.headers:
            self.names = [k.lower() for k, _ in self.headers]
        if not self.by_name:
            for n, (_, v) in zip(self.names, self.headers):
                self.by_name.setdefault(n, []).append(v)

    def get_all(self, name: bytes) -> Sequence[bytes]:
        """Every value of the (lowercase) `name`, in order (read-only: the head's own list)."""
        return self.by_name.get(name, _NONE)

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.content_length)


_NONE: tuple[bytes, ...] = ()    # get_all's answer for a name not sent


def _framing(by_name: dict[bytes, list[bytes]]) -> tuple[bool, int | None]:
    length = None
    for v in by_name.get(b"content-length", _NONE):
        if v.strip().isdigit():
            length = int(v.strip())
    return b"transfer-encoding" in by_name, length


class RequestReader:
    """Feeds a client's bytes to llhttp; the parsed pieces land in `events` (bounded by the
    caller, who stops reading while they pile up). Each head's `replay` collects the raw bytes
    from its start (and everything read after) until the caller is done with it, so the
    request can still be handed over whole; it is None when the request began in the middle
    of a read, after another one (its first byte's position is unknown to us), or grew too long."""

    def __init__(self, max_head_bytes: int) -> None:
        self.events: deque = deque()
        self.pending_bytes = 0
        self.max_head_bytes = max_head_bytes
        self._parser = httptools.HttpRequestParser(self)
        self._url = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._names: list[bytes] = []
        self._by_name: dict[bytes, list[bytes]] = {}
        self._in_head = False
        self._in_message = False
        self._head_bytes = 0
        self._failed = False
        self._open: list[RequestHead] = []       # heads whose replay still grows
        self._cur_replay: bytearray | None = None
        self._data = b""
        self._feed_start_idle = True
        self._began_in_feed = False
        self._replay_limit = max_head_bytes + (1 << 17)
        self._why: str | None = None
        self._framing = _FramingBound(max_head_bytes)

    # -------------------------------------------------------------- feeding
    def feed(self, data: bytes) -> None:
        if self._failed:
            return
        for h in self._open:
            if h.replay is not None:
                h.replay += data
                if len(h.replay) > self._replay_limit:
                    h.replay = None           # only about a head's worth is ever replayed
        if self._in_head:
            self._head_bytes += len(data)
            if self._cur_replay is not None:
                self._cur_replay += data
        self._feed_start_idle = not self._in_message
        self._began_in_feed = False
        self._data = data
        self._framing.feed_started()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._push("upgrade", None)
            self._failed = True
        except httptools.HttpParserError as e:   # a callback's own refusal says why (llhttp: "callback error")
            self._push("error", self._why or str(e)[:200] or type(e).__name__)
            self._failed = True
        if self._in_head and self._head_bytes > self.max_head_bytes and not self._failed:
            self._push("error", "head_too_large")
            self._failed = True
        if self._framing.over(len(data), self._in_message and not self._in_head) and not self._failed:
            self._push("error", "head_too_large: a chunk header or trailer section too long")
            self._failed = True

    def _push(self, kind: str, value) -> None:
        self.events.append((kind, value))
        if kind == "body":
            self.pending_bytes += len(value)

    def pop(self):
        kind, value = self.events.popleft()
        if kind == "body":
            self.pending_bytes -= len(value)
        return kind, value

    # ----------------------------------------------------- llhttp callbacks
    def done_with(self, head: RequestHead) -> None:
        """The caller decided this request: its raw bytes are no longer needed."""
        head.replay = None
        if head in self._open:
            self._open.remove(head)

    def on_message_begin(self) -> None:
        first = self._feed_start_idle and not self._began_in_feed
        self._cur_replay = bytearray(self._data) if first else None
        self._began_in_feed = True
        self._in_message = self._in_head = True
        self._head_bytes = 0
        self._framing.reset()
        self._url.clear()
        self._headers = []
        self._names = []
        self._by_name = {}

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self.max_head_bytes:
            self._refuse("head_too_large")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            self._push("trailers", None)      # refused: a trailer cannot be checked before it is sent
            self._refuse("trailers")
        name, value = bytes(name), bytes(value)
        self._headers.append((name, value))
        lower = name.lower()
        self._names.append(lower)
        values = self._by_name.get(lower)
        if values is None:
            self._by_name[lower] = [value]
        else:
            values.append(value)
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.max_head_bytes:
            self._refuse("head_too_large")

    def _refuse(self, why: str):
        self._why = why
        raise httptools.HttpParserError(why)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._framing.reset()
        p = self._parser
        chunked, length = _framing(self._by_name)
        head = RequestHead(method=p.get_method().decode("ascii", "replace"), target=bytes(self._url),
                           version=p.get_http_version(), headers=self._headers, keep_alive=p.should_keep_alive(),
                           chunked=chunked, content_length=length, replay=self._cur_replay,
                           names=self._names, by_name=self._by_name)
        self._cur_replay = None
        if head.replay is not None:
            self._open.append(head)
        self._push("head", head)

    def on_body(self, body: bytes) -> None:
        self._framing.reset()
        self._push("body", bytes(body))

    def on_message_complete(self) -> None:
        self._in_message = False
        self._push("end", None)


class _FramingBound:
    """Bytes of a message after its head that are not body: chunk headers and the trailer section.
    llhttp streams them, but httptools joins a header (a trailer) in memory until it ends, by
    bytes concatenation; bounded like a head. Counted per read (a read with body bytes starts the
    count again), so the bound is `limit` plus one read."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._bytes = 0
        self._reset_in_feed = False

    def feed_started(self) -> None:
        self._reset_in_feed = False

    def reset(self) -> None:
        self._bytes = 0
        self._reset_in_feed = True

    def over(self, n: int, counting: bool) -> bool:
        if not counting or self._reset_in_feed:
            return False
        self._bytes += n
        return self._bytes > self.limit


def serialize_request_head(method: str, target: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The head we forward, rebuilt from the parsed pieces (never the raw bytes)."""
    out = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
    for k, v in headers:
        out += (k, b": ", v, b"\r\n")
    out.append(b"\r\n")
    return b"".join(out)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


# ------------------------------------------------------------------- responses
class ResponseReader:
    """The responses of one upstream connection (and the 1xx before each), re-framed for the client.

    `begin(head_request=...)` before each response. The sink gets: head(status, reason, headers,
    body_framing) where body_framing is "none" | "length" | "chunked" | "close"; body(bytes);
    trailers(list); end(keep_alive); error(why). A response head over `max_head_bytes`, more than
    MAX_INFORMATIONAL 1xx heads or more than `max_head_bytes` of them, or any framing error is an error.
    Bytes after a response and before the next begin() are an error too.

    llhttp's parser is kept from one response to the next only when llhttp itself ended the last
    one (its keep-alive state, as for any message sequence); else (a HEAD or 204/304 response it
    still reads a body for, a failure) the next response gets a new parser."""

    MAX_INFORMATIONAL = 32      # 1xx heads before one response (a flood is bounded, not timed out)

    def __init__(self, sink, *, max_head_bytes: int) -> None:
        self.sink = sink
        self.max_head_bytes = max_head_bytes
        self._framing_bound = _FramingBound(max_head_bytes)
        self._parser = None
        self._reusable = False          # llhttp ended the last response: its state is a message boundary
        self.done = True                # no response expected until begin()
        self.failed = False

    def begin(self, *, head_request: bool) -> "ResponseReader":
        if self.failed:
            raise RuntimeError("a failed upstream connection is not reused")
        if not self._reusable:
            self._parser = httptools.HttpResponseParser(self)
        self._reusable = False
        self.head_request = head_request
        self._headers: list[tuple[bytes, bytes]] = []
        self._trailers: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._in_head = True
        self._head_bytes = 0            # bytes fed while in a head (a head that never ends)
        self._header_size = 0           # the current head's fields, as counted against max_head_bytes
        self._informational = 0
        self._informational_bytes = 0
        self._why: str | None = None    # a callback's own refusal (llhttp reports "callback error")
        self.framing = None
        self.done = False
        self._framing_bound.reset()
        return self

    def feed(self, data: bytes) -> None:
        if self.done or self.failed:
            if data:
                self._fail("bytes after the response")
            return
        if self._in_head:
            self._head_bytes += len(data)
        self._framing_bound.feed_started()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("upgrade")
        except httptools.HttpParserError as e:
            self._fail(self._why or str(e)[:200] or "parse error")
        if self._in_head and self._head_bytes > self.max_head_bytes:
            self._fail("upstream response head too large")    # a head that never ends (bounded)
        if self._framing_bound.over(len(data), not self._in_head and not self.done):
            self._fail("upstream chunk header or trailer section too long")

    def eof(self) -> None:
        """The upstream closed: the end of a close-delimited body, else a cut response."""
        if self.done or self.failed:
            return
        if self.framing == "close":
            self.done = True
            self.sink.end(False)
        else:
            self._fail("upstream closed mid-response")

    def _fail(self, why: str) -> None:
        self._reusable = False
        if not self.failed:          # after the response too: the sink drops a misbehaving upstream
            self.failed = True
            self.sink.error(why)

    def on_message_begin(self) -> None:
        if self.done:
            raise httptools.HttpParserError("bytes after the response")
        self._in_head = True
        self._headers = []
        self._header_size = 0
        self._reason = b""

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            self._trailers.append((bytes(name), bytes(value)))
            return
        self._headers.append((bytes(name), bytes(value)))
        self._header_size += len(name) + len(value) + 4
        if self._header_size > self.max_head_bytes:
            self._why = "upstream response head too large"     # (llhttp would say "callback error")
            raise httptools.HttpParserError(self._why)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._framing_bound.reset()
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            if status == 101:
                raise httptools.HttpParserError("101 without an upgrade request")
            self._informational += 1
            self._informational_bytes += 16 + len(self._reason) + self._header_size
            if self._informational > self.MAX_INFORMATIONAL or self._informational_bytes > self.max_head_bytes:
                self._why = f"more than {self.MAX_INFORMATIONAL} informational (1xx) responses or their bytes"
                raise httptools.HttpParserError(self._why)
            self.sink.head(status, bytes(self._reason), self._headers, "none")
            self._in_head = True       # the final response follows
            self._head_bytes = 0
            return
        te = None
        has_cl = False
        for k, v in self._headers:
            n = k.lower()
            if n == b"transfer-encoding":
                te = v.strip().lower() if te is None else te + b"," + v.strip().lower()
            elif n == b"content-length":
                has_cl = True
        if self.head_request or status in (204, 304):
            self.framing = "none"
        elif te is not None:
            self.framing = "chunked" if te.split(b",")[-1].strip() == b"chunked" else "close"
        elif has_cl:
            self.framing = "length"
        else:
            self.framing = "close"
        self.sink.head(status, bytes(self._reason), self._headers, self.framing)
        if self.framing == "none":
            self.done = True           # llhttp would wait for a HEAD response's body: never fed again
            self.sink.end(self._parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.done:
            raise httptools.HttpParserError("body on a response without one")
        self._framing_bound.reset()
        self.sink.body(bytes(body))

    def on_message_complete(self) -> None:
        if self._in_head:              # 1xx: not the response yet
            return
        if self.done:                  # "none": llhttp agrees there is no body (204/304, HEAD without one)
            self._reusable = not self.failed
            return
        self.done = True
        self._reusable = True
        if self._trailers:
            self.sink.trailers(self._trailers)
        self.sink.end(self._parser.should_keep_alive())


def serialize_response_head(status: int, reason: bytes, headers: list[tuple[bytes, bytes]]) -> bytes:
    out = [b"HTTP/1.1 %d " % status, reason, b"\r\n"]
    for k, v in headers:
        out += (k, b": ", v, b"\r\n")
    out.append(b"\r\n")
    return b"".join(out)
