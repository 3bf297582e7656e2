"""The spellings of a secret value that count as "the value" (pure).

Used to find a value (or placeholder) in outgoing data and to scrub it from
responses. Base64 is covered at every alignment (the value may sit at any
offset inside a longer base64 string, e.g. "user:secret" in Basic auth).
"""
from __future__ import annotations

import base64
from urllib.parse import quote, quote_plus

REDACTED = b"[REDACTED]"
MIN_FORM_LEN = 8  # shorter derived forms would match random text


def _b64_aligned(value: bytes, encode) -> set[bytes]:
    """The part of encode(prefix + value) that depends only on value, per alignment."""
    out = set()
    for shift in range(3):
        enc = encode(b"\0" * shift + value)
        total = shift + len(value)
        stable_end = 4 * (total // 3)           # chars after this depend on what follows
        head = (0, 2, 3)[shift]                  # chars before this depend on what precedes
        piece = enc[head:stable_end]
        if len(piece) >= MIN_FORM_LEN:
            out.add(piece)
    full = encode(value)
    out.add(full)
    out.add(full.rstrip(b"="))
    return out


def value_forms(value: bytes, extra: tuple[bytes, ...] = ()) -> frozenset[bytes]:
    """Raw value plus its base64 (std/urlsafe, any alignment), url-encoded and hex forms."""
    forms: set[bytes] = {value}
    forms |= _b64_aligned(value, base64.b64encode)
    forms |= _b64_aligned(value, base64.urlsafe_b64encode)
    text = value.decode("utf-8", "surrogateescape")
    for q in (quote(text, safe="", errors="surrogateescape"),
              quote(text, safe="/", errors="surrogateescape"),
              quote_plus(text, safe="", errors="surrogateescape")):
        forms.add(q.encode())
        forms.add(_lower_percent(q).encode())
    forms.add(value.hex().encode())
    forms.add(value.hex().upper().encode())
    forms.update(extra)
    return frozenset(f for f in forms if f and (f == value or len(f) >= MIN_FORM_LEN))


def _lower_percent(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s[i] == "%" and i + 2 < len(s):
            out.append(s[i:i + 3].lower())
            i += 3
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def contains_any(data: bytes, forms: frozenset[bytes]) -> bool:
    return any(f in data for f in forms)


def scrub(data: bytes, forms: frozenset[bytes]) -> bytes:
    """Replace every form with [REDACTED], longest first so no fragment survives."""
    for f in sorted(forms, key=len, reverse=True):
        if f in data:
            data = data.replace(f, REDACTED)
    return data


def as_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8", "surrogateescape")
    return bytes(data)
