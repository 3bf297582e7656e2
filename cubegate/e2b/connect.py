"""The Connect protocol (connectrpc.com/docs/protocol), JSON codec, as envd speaks it (pure).

Unary: POST /<pkg.Service>/<Method>, `application/json` both ways; an error is an HTTP
status + `{"code", "message"}`. Server streams: `application/connect+json`, the request
is one envelope, the answer is envelopes (flags 0) and one end-of-stream envelope
(flags 0x02) holding `{}` or `{"error": {...}}`. Envelope: flags (1 byte), length
(4 bytes, big-endian), the JSON message.
"""
from __future__ import annotations

import json
import struct

END_STREAM = 0x02
MAX_MESSAGE = 16 << 20

# Connect code -> HTTP status for unary errors (the protocol's own table)
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


class ConnectError(Exception):
    """An error answered in the protocol's shape; the message is safe to show."""

    def __init__(self, code: str, message: str):
        assert code in HTTP_STATUS, code
        super().__init__(message)
        self.code, self.message = code, message

    def body(self) -> dict:
        return {"code": self.code, "message": self.message}


def envelope(message: dict, flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_of_stream(error: ConnectError | None = None) -> bytes:
    return envelope({"error": error.body()} if error else {}, END_STREAM)


def parse_envelope(body: bytes) -> dict:
    """The one message of a server-stream request."""
    if len(body) < 5:
        raise ConnectError("invalid_argument", "request is not a Connect envelope")
    flags, length = struct.unpack(">BI", body[:5])
    if flags & 0x01:
        raise ConnectError("unimplemented", "compressed messages are not supported")
    if length != len(body) - 5 or length > MAX_MESSAGE:
        raise ConnectError("invalid_argument", "envelope length does not match the body")
    return parse_json(body[5:])


def parse_json(raw: bytes) -> dict:
    try:
        doc = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        raise ConnectError("invalid_argument", "message is not JSON") from None
    if not isinstance(doc, dict):
        raise ConnectError("invalid_argument", "message must be a JSON object")
    return doc


def timeout_seconds(header: str | None, default: float | None) -> float | None:
    """Connect-Timeout-Ms (at most 10 digits by the spec); None: no deadline."""
    if header is None:
        return default
    if not header.isdigit() or len(header) > 10:
        raise ConnectError("invalid_argument", "bad Connect-Timeout-Ms")
    return int(header) / 1000
