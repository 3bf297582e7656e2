"""The spellings of a secret value that count as "the value" (pure).

Used to find a value (or placeholder) in outgoing data and to scrub it from
responses. Base64 is covered at every alignment (the value may sit at any
offset inside a longer base64 string, e.g. "user:secret" in Basic auth).

`value_forms` lists spellings to look for (and to replace) literally;
`normalize` is the decoding-only view of some data in which escaped
spellings (percent, JSON/JS, HTML) show up as the bytes they stand for, so a
matcher needs no form per escaping scheme.
"""
from __future__ import annotations

import base64
import html.entities
import json
import re
from itertools import islice
from urllib.parse import quote, quote_plus

REDACTED = b"[REDACTED]"
MIN_FORM_LEN = 8  # shorter derived forms would match random text

# -- normalize -------------------------------------------------------------------------
ESCAPE_ROUNDS = 3       # %2563 -> %63 -> c: data escaped up to three times over
MAX_ESCAPE_LEN = 12     # the longest escape decoded: a \uXXXX\uXXXX surrogate pair
ROUND_EXPANSION = 8     # no escape spends more than 8 bytes per byte it decodes to
# One round: L decoded bytes come from at most 8L bytes of full escapes plus a partly
# used escape at each end (<= 12 bytes for >= 1 byte), so <= 8L + 8. Three rounds:
# 8(8(8L + 8) + 8) + 8 = 512L + 584 <= 584L + 584.
MAX_ESCAPE_EXPANSION = ROUND_EXPANSION ** 3 + ROUND_EXPANSION ** 2 + ROUND_EXPANSION

# Named HTML entities for ASCII characters that fit the 8-byte budget (&lowbar; &sol; &amp; ...).
_NAMED = {("&" + name).encode(): ch.encode() for name, ch in html.entities.html5.items()
          if name.endswith(";") and len(ch) == 1 and ord(ch) < 128 and len(name) <= 7}
# One pattern per first byte: each has a literal prefix, so the regex engine skips to
# candidates fast. Their matches never overlap (no escape holds another's first byte
# past its own start), so together they decode like one alternation would.
_FAMILIES = {
    b"%": re.compile(rb"%[0-9A-Fa-f]{2}"),
    b"\\": re.compile(rb"\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"  # surrogate pair
                      rb"|u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[/\"\\])"),
    b"&": re.compile(rb"&(?:#(?:[0-9]{1,5}(?![0-9])|[xX][0-9a-fA-F]{1,4}(?![0-9a-fA-F]));?"
                     rb"|[A-Za-z]{2,6};)"),
}
_MERGE_LIMIT = 20_000   # matches spliced in Python; past that re.sub does the bulk
_HEX = "0123456789abcdefABCDEF"
_FIXED: dict[bytes, bytes] = dict(_NAMED)   # escapes that decode without arithmetic
for _a in _HEX:
    for _b in _HEX:
        _byte = bytes([int(_a + _b, 16)])
        _FIXED[f"%{_a}{_b}".encode()] = _byte
        _FIXED[f"\\x{_a}{_b}".encode()] = _byte
        _FIXED[f"\\u00{_a}{_b}".encode()] = chr(_byte[0]).encode()
_FIXED.update({b"\\/": b"/", b'\\"': b'"', b"\\\\": b"\\"})


def _decode(s: bytes) -> bytes:
    fixed = _FIXED.get(s)
    if fixed is not None:
        return fixed
    if s[0] == 0x5C:                                  # \uXXXX or a surrogate pair
        if len(s) == 12:
            hi, lo = int(s[2:6], 16), int(s[8:12], 16)
            cp = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00)
        else:
            cp = int(s[2:6], 16)
    elif s[1:2] == b"#":                              # &#DDDDD; or &#xHHHH;
        digits = s[2:].rstrip(b";")
        cp = int(digits[1:], 16) if digits[:1] in (b"x", b"X") else int(digits)
    else:
        return s                                      # a name we do not decode
    if cp == 0 or 0xD800 <= cp <= 0xDFFF or cp > 0x10FFFF:
        return s                                      # invalid: stays as it is
    return chr(cp).encode()


def decode_round(data: bytes, stop: int | None = None) -> tuple[bytes, int]:
    """One round of escape decoding: (decoded bytes, input bytes they stand for).

    Escapes that start at or after `stop` are left undecoded and not consumed,
    so a stream can decode a prefix now and the rest once more bytes arrived.
    With stop=None everything is consumed. Every escape shrinks when decoded,
    so `len(decoded) == consumed` means nothing changed.
    """
    n = len(data)
    if stop is None or stop > n:
        stop = n
    found = {first: list(islice(pattern.finditer(data), _MERGE_LIMIT + 1))
             for first, pattern in _FAMILIES.items() if first in data}
    if not any(found.values()):
        return data[:stop], stop
    # Few matches: splice them in here. Many of one family (JSON's \/ and \"): let
    # re.sub decode that family in C and splice the others in around it.
    bulk_first = max(found, key=lambda first: len(found[first]))
    if len(found[bulk_first]) <= _MERGE_LIMIT:
        bulk_first = None
    others = sorted((m for first in found if first != bulk_first
                     for m in (found[first] if len(found[first]) <= _MERGE_LIMIT
                               else _FAMILIES[first].finditer(data))), key=lambda m: m.start())
    end, base, parts, pos = stop, 0, [], 0

    def repl(m: re.Match) -> bytes:
        nonlocal end
        if base + m.start() >= stop:
            return m[0]
        end = max(end, base + m.end())                # an escape may run past stop
        return _decode(m[0])

    def literal(segment: bytes) -> bytes:
        return segment if bulk_first is None else _FAMILIES[bulk_first].sub(repl, segment)

    for m in others:
        if m.start() >= stop:
            break
        base = pos
        parts.append(literal(data[pos:m.start()]))
        parts.append(_decode(m[0]))
        pos = m.end()
        end = max(end, pos)
    base = pos
    parts.append(literal(data[pos:]))
    out = b"".join(parts)
    return out[:len(out) - (n - end)], end


def normalize(data: bytes) -> bytes:
    """Decoding-only view for matching: percent, JSON/JS and HTML numeric escapes decoded,
    up to ESCAPE_ROUNDS times over. Invalid escapes stay; never longer than `data`."""
    data = bytes(data)
    for _ in range(ESCAPE_ROUNDS):
        out, _ = decode_round(data)
        if len(out) == len(data):
            break
        data = out
    return data


# -- value forms -----------------------------------------------------------------------
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


def _json_forms(text: str) -> set[bytes]:
    """How JSON encoders spell the string: plain UTF-8 or \\u-escaped non-ASCII, and the
    HTML-safe variant (Go's encoding/json escapes < > & as \\u003c \\u003e \\u0026)."""
    out = set()
    for ensure_ascii in (False, True):
        body = json.dumps(text, ensure_ascii=ensure_ascii)[1:-1]
        out.add(body.encode("utf-8", "surrogateescape"))
        out.add(body.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
                .encode("utf-8", "surrogateescape"))
    return out


def _slash_escaped(form: bytes) -> set[bytes]:
    """JSON lets '/' be written as \\/ or \\u002f (PHP's json_encode does it by default)."""
    if b"/" not in form:
        return set()
    return {form.replace(b"/", esc) for esc in (b"\\/", b"\\u002f", b"\\u002F")}


def value_forms(value: bytes, extra: tuple[bytes, ...] = ()) -> frozenset[bytes]:
    """Raw value plus its base64 (std/urlsafe, any alignment), url-encoded, hex and
    JSON-escaped forms."""
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
    forms |= _json_forms(text)
    for f in list(forms):
        forms |= _slash_escaped(f)
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
