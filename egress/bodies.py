"""Bodies the gateway must look into, handled as streams in bounded memory.

Two jobs, both on flows that are intercepted or plain HTTP:
  * requests: leak check. The body is decoded (Content-Encoding, bounded) and
    matched against the sandbox's placeholders and its tenant's secret values;
    raw bytes are forwarded only once the decoded bytes they produced have been
    checked, so no byte of a secret leaves before the secret is recognised.
  * responses on flows where a secret was injected: scrub. The body is decoded,
    every spelling of the value replaced, and the decoded result forwarded
    (Content-Encoding dropped). Anything that cannot be decoded or scrubbed is
    refused, never forwarded.

Bodies of known length up to `inspect_buffer_bytes` may be buffered whole (so a
refusal is a readable 403/502); the rest are checked as they stream, and a
refusal in the middle of a stream resets the connection. Work per call is
bounded by one network read (64 KiB) decoded up to `max_body_bytes`.
No exception or message here ever holds body bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import vault as vaultlib
from egress import body_codec


@dataclass(frozen=True)
class BodyLimits:
    max_body_bytes: int = 64 * 1024 * 1024          # decoded size of one inspected body
    inspect_buffer_bytes: int = 1024 * 1024         # known-length bodies up to this may be buffered whole
    max_buffered_bytes_per_sandbox: int = 16 * 1024 * 1024
    max_held_raw_bytes: int = 4 * 1024 * 1024       # raw bytes waiting for their decoded form to be checked
    max_decoded_per_read: int = 8 * 1024 * 1024     # one read (<= 64 KiB) may not decode to more, where it is
                                                    # checked on the event loop (ratio > 128: a bomb, refused)


@dataclass(frozen=True)
class BodyRefused(Exception):
    status: int
    reason: str
    detail: str
    secret_ids: tuple[str, ...] = ()     # ids only (credential_leak), never values

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def content_encoding(headers) -> str | None:
    values = headers.get_all("content-encoding")
    joined = ",".join(v for v in values if v.strip())
    return joined or None


def make_decoder(encoding: str | None, limits: BodyLimits, *, what: str,
                 on_loop: bool = True) -> body_codec.Decoder:
    try:
        return body_codec.make_decoder(encoding, max_output=limits.max_body_bytes,
                                       max_per_feed=limits.max_decoded_per_read if on_loop else None)
    except body_codec.UnsupportedEncoding:
        status = 502 if what == "response" else 415
        raise BodyRefused(status, f"{what}_undecodable",
                          f"{what} Content-Encoding cannot be decoded for inspection") from None


def _refusal_for(e: Exception, what: str, limits: BodyLimits) -> BodyRefused:
    if isinstance(e, BodyRefused):
        return e
    if isinstance(e, body_codec.BodyTooLarge):
        why = (f"one read decodes to more than {limits.max_decoded_per_read} bytes (a compression bomb)"
               if "one read" in str(e) else f"decodes to more than {limits.max_body_bytes} bytes")
        return BodyRefused(413 if what == "request" else 502, "body_too_large", f"{what} body {why}")
    if isinstance(e, body_codec.DecodeError):
        return BodyRefused(400 if what == "request" else 502, f"{what}_undecodable",
                           f"{what} body is not valid for its Content-Encoding")
    if isinstance(e, vaultlib.Unscrubbable):
        return BodyRefused(502, "response_unscrubbable",
                           "response carries the injected credential in a form that cannot be removed")
    if isinstance(e, vaultlib.LeakFound):
        return BodyRefused(403, "credential_leak",
                           f"request body carries secret(s) {', '.join(e.secret_ids)} to a host they are not bound to",
                           tuple(e.secret_ids))
    return BodyRefused(502, "inspection_failed", f"{what} body could not be inspected ({type(e).__name__})")


class RequestLeakStream:
    """`flow.request.stream` for a body that must be leak-checked. Forwards the raw bytes."""

    def __init__(self, needles, encoding: str | None, limits: BodyLimits,
                 on_refused: Callable[[BodyRefused], None], *, on_loop: bool = True):
        self._decoder = make_decoder(encoding, limits, what="request", on_loop=on_loop)
        self._identity = encoding is None
        self._scanner = vaultlib.StreamLeakScanner(needles)
        # The raw bytes go upstream as they came, and decoders skip some (gzip FNAME/FCOMMENT/FEXTRA,
        # zstd skippable frames, brotli metadata): an encoded body is checked raw as well.
        self._raw_scanner = None if self._identity else vaultlib.StreamLeakScanner(needles)
        self._raw_fed = self._raw_released = 0
        self._limits = limits
        self._on_refused = on_refused
        self._held: list[tuple[bytes, int, int]] = []   # (raw chunk, decoded total once it was fed, raw total)
        self._held_bytes = 0
        self._released_decoded = 0
        self.failed: BodyRefused | None = None

    def __call__(self, chunk: bytes) -> list[bytes]:
        if self.failed is not None:
            return []
        try:
            return self._step(chunk)
        except Exception as e:  # noqa: BLE001 - any failure refuses the body; never forward unchecked bytes
            self.failed = _refusal_for(e, "request", self._limits)
            self._held.clear()
            self._on_refused(self.failed)
            return []

    def _step(self, chunk: bytes) -> list[bytes]:
        end = chunk == b""
        decoded = self._decoder.finish() if end else self._decoder.feed(chunk)
        safe = self._scanner.feed(decoded)
        if end:
            safe += self._scanner.finish()
        if self._identity:
            return [safe] if safe else []
        self._released_decoded += len(safe)
        self._raw_released += len(self._raw_scanner.finish() if end else self._raw_scanner.feed(chunk))
        if chunk:
            self._raw_fed += len(chunk)
            self._held.append((chunk, self._decoder.decoded, self._raw_fed))
            self._held_bytes += len(chunk)
        out = []
        while self._held and (end or (self._held[0][1] <= self._released_decoded
                                      and self._held[0][2] <= self._raw_released)):
            raw, _, _ = self._held.pop(0)
            self._held_bytes -= len(raw)
            out.append(raw)
        if self._held_bytes > self._limits.max_held_raw_bytes:
            raise BodyRefused(413, "body_uninspectable", "request body's encoded form yields too little to check")
        return out


class ResponseScrubStream:
    """`flow.response.stream` on an injected flow: forwards the decoded, scrubbed body."""

    def __init__(self, forms, encoding: str | None, limits: BodyLimits,
                 on_refused: Callable[[BodyRefused], None], *, on_loop: bool = True):
        self._decoder = make_decoder(encoding, limits, what="response", on_loop=on_loop)
        self._scrubber = vaultlib.StreamScrubber(forms)     # a vault.ScrubForms (or the spellings)
        self._limits = limits
        self._on_refused = on_refused
        self.failed: BodyRefused | None = None

    def __call__(self, chunk: bytes) -> list[bytes]:
        if self.failed is not None:
            return []
        try:
            if chunk:
                out = self._scrubber.feed(self._decoder.feed(chunk))
            else:
                out = self._scrubber.feed(self._decoder.finish()) + self._scrubber.finish()
            return [out] if out else []
        except Exception as e:  # noqa: BLE001 - fail closed: nothing unscrubbed reaches the sandbox
            self.failed = _refusal_for(e, "response", self._limits)
            self._on_refused(self.failed)
            return []


def check_request_body(body: bytes, encoding: str | None, needles, limits: BodyLimits, *,
                       on_loop: bool = True) -> None:
    """A whole (buffered) request body; raises BodyRefused. Off the event loop (on_loop=False)
    its decoding is bounded by max_body_bytes alone."""
    refused: list[BodyRefused] = []
    stream = RequestLeakStream(needles, encoding, limits, refused.append, on_loop=on_loop)
    stream(body)
    stream(b"")
    if refused:
        raise refused[0]


def scrub_response_body(body: bytes, encoding: str | None, forms, limits: BodyLimits, *,
                        on_loop: bool = True) -> bytes:
    """A whole (buffered) response body, decoded and scrubbed as ResponseScrubStream would;
    raises BodyRefused. `forms`: a vault.ScrubForms (or the frozenset of spellings)."""
    compiled = forms if isinstance(forms, vaultlib.ScrubForms) else vaultlib.ScrubForms(forms)
    decoder = make_decoder(encoding, limits, what="response", on_loop=on_loop)
    try:
        return compiled.scrub(decoder.feed(body) + decoder.finish())
    except Exception as e:  # noqa: BLE001 - fail closed: nothing unscrubbed reaches the sandbox
        raise _refusal_for(e, "response", limits) from None


class RefusedResponseStream:
    """After a refusal at response-headers time: send our short body once, drop the upstream's."""

    def __init__(self, body: bytes):
        self._body = body

    def __call__(self, chunk: bytes) -> list[bytes]:
        body, self._body = self._body, b""
        return [body] if body else []


class BufferBudget:
    """Bytes of inspected bodies held whole, per sandbox. Over budget → the body streams instead."""

    def __init__(self, per_sandbox: int):
        self.per_sandbox = per_sandbox
        self._used: dict[str, int] = {}

    def reserve(self, sandbox: str, n: int) -> bool:
        used = self._used.get(sandbox, 0)
        if used + n > self.per_sandbox:
            return False
        self._used[sandbox] = used + n
        return True

    def release(self, sandbox: str, n: int) -> None:
        left = self._used.get(sandbox, 0) - n
        if left > 0:
            self._used[sandbox] = left
        else:
            self._used.pop(sandbox, None)

    def used(self, sandbox: str) -> int:
        return self._used.get(sandbox, 0)
