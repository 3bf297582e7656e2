"""The spellings of a secret value that count as "the value" (pure).

Used to find a value (or placeholder) in outgoing data and to scrub it from
responses. Base64 is covered at every alignment (the value may sit at any
offset inside a longer base64 string, e.g. "user:secret" in Basic auth).

`value_forms` lists spellings to look for (and to replace) literally;
`decode_round` decodes one round of escapes (percent, JSON/JS, HTML) of some
or all families, so escaped spellings show up as the bytes they stand for and
a matcher needs no form per escaping scheme. `normalize` is one such view
(all families at once, three rounds); a leak check needs every view
(`scan.VIEWS`): an escape starter next to a spelled value can make the
all-at-once decode eat part of it.
"""
from __future__ import annotations

import base64
import heapq
import html.entities
import json
import re
from itertools import accumulate
from typing import NamedTuple
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
FAMILIES = b"%\\&"   # the escape families by their first byte: percent, JSON/JS backslash, HTML entity
# One pattern per first byte: each has a literal prefix, so the regex engine skips to
# candidates fast. Their matches never overlap (no escape holds another family's first
# byte), so the families can be decoded one by one and spliced together.
_FAMILIES = {
    b"%": re.compile(rb"%[0-9A-Fa-f]{2}"),
    b"\\": re.compile(rb"\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"  # surrogate pair
                      rb"|u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[/\"\\])"),
    b"&": re.compile(rb"&(?:#(?:[0-9]{1,5}(?![0-9])|[xX][0-9a-fA-F]{1,4}(?![0-9a-fA-F]));?"
                     rb"|[A-Za-z]{2,6};)"),
}
_SPLITTERS = {first: re.compile(b"(" + pattern.pattern + b")") for first, pattern in _FAMILIES.items()}
_SLICE = 256 * 1024     # decode at most this much at once: bounds the list of pieces
_HEX = "0123456789abcdefABCDEF"
_FIXED: dict[bytes, bytes] = dict(_NAMED)   # escapes that decode without arithmetic
for _a in _HEX:
    for _b in _HEX:
        _byte = bytes([int(_a + _b, 16)])
        _FIXED[f"%{_a}{_b}".encode()] = _byte
        _FIXED[f"\\x{_a}{_b}".encode()] = _byte
        _FIXED[f"\\u00{_a}{_b}".encode()] = chr(_byte[0]).encode()
_FIXED.update({b"\\/": b"/", b'\\"': b'"', b"\\\\": b"\\"})


def starters(families: bytes) -> tuple[bytes, ...]:
    """The first bytes of the escapes of `families` (e.g. FAMILIES, or b"%" alone)."""
    found = _STARTERS.get(families)
    if found is None:
        found = _STARTERS[families] = tuple(families[i:i + 1] for i in range(len(families)))
    return found


_STARTERS: dict[bytes, tuple[bytes, ...]] = {}


def has_escape(data: bytes, families: bytes = FAMILIES) -> bool:
    """Whether an escape of `families` occurs in `data`. If none does, a round of them
    returns `data` unchanged (a starter alone, as in '?a=1&b=2', decodes to itself); for
    all FAMILIES: every decoded view of `data` is `data` itself."""
    pattern = _ANY_ESCAPE.get(families)
    if pattern is None:
        pattern = _ANY_ESCAPE[families] = re.compile(
            b"|".join(_FAMILIES[first].pattern for first in starters(families)))
    return pattern.search(data) is not None


_ANY_ESCAPE: dict[bytes, re.Pattern] = {}


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


def _pieces(data: bytes, families: bytes) -> list[bytes]:
    """`data` as [literal, escape, literal, ..., literal] for the escapes of `families`."""
    # (a starter with no escape after it, as the '&' of a query string, splits nothing)
    present = [first for first in starters(families) if first in data and _FAMILIES[first].search(data)]
    if len(present) <= 1:
        return _SPLITTERS[present[0]].split(data) if present else [data]
    # Split by the most frequent family (in C; judged by a sample); splice the others in.
    dense = max(present, key=lambda first: data.count(first, 0, 8192))
    split = _SPLITTERS[dense].split
    sparse = heapq.merge(*(_FAMILIES[first].finditer(data) for first in present if first != dense),
                         key=lambda m: m.start())
    out, pos = [], 0
    for m in sparse:
        out += split(data[pos:m.start()])
        out.append(m[0])
        pos = m.end()
    out += split(data[pos:])
    return out


def _cut(pieces: list[bytes], n: int, stop: int) -> int:
    """Drop what starts at or after `stop` (an escape started before it stays whole);
    returns how many input bytes the remaining pieces stand for."""
    pos = n
    for i in range(len(pieces) - 1, -1, -1):
        start = pos - len(pieces[i])
        if start < stop:
            del pieces[i + 1:]
            if i % 2:                                 # an escape: decoded whole
                return pos
            pieces[i] = pieces[i][:stop - start]
            return stop
        pos = start
    pieces[:] = [b""]
    return 0


# An escape cut short by the end of the data, from its first byte to that end: more bytes
# may still make it an escape, a longer one ('&#5' -> '&#51;'), or a pair ('\ud83d' -> '\ud83d\ude00').
# None is longer than MAX_ESCAPE_LEN - 1 bytes.
_OPEN = {
    b"%": re.compile(rb"%[0-9A-Fa-f]?"),
    b"\\": re.compile(rb"\\(?:u[0-9a-fA-F]{0,3}|u[dD][89abAB][0-9a-fA-F]{2}"
                      rb"(?:\\(?:u(?:[dD](?:[c-fC-F][0-9a-fA-F]?)?)?)?)?|x[0-9a-fA-F]?)?"),
    b"&": re.compile(rb"&(?:#(?:[0-9]{0,5}|[xX][0-9a-fA-F]{0,4})|[A-Za-z]{0,6})?"),
}


def _open_start(data: bytes, pieces: list[bytes], families: bytes) -> int:
    """Where the first escape that more bytes could still change starts (len(data) if none).

    Only the last MAX_ESCAPE_LEN bytes can hold one, at a byte where the parse tries an
    escape: the start of a decoded one, or a starter byte in a literal piece (where the
    leftmost parse tried and found none). Starters inside a decoded escape are not tried.
    """
    n = len(data)
    lo = n - MAX_ESCAPE_LEN
    firsts = starters(families)
    tried = []
    end = n
    for i in range(len(pieces) - 1, -1, -1):
        start = end - len(pieces[i])
        if i % 2:
            if start >= lo:
                tried.append(start)
        else:
            for first in firsts:
                q = data.find(first, max(start, lo), end)
                while q >= 0:
                    tried.append(q)
                    q = data.find(first, q + 1, end)
        if start <= lo:
            break
        end = start
    for q in sorted(tried):
        if _OPEN[data[q:q + 1]].fullmatch(data, q):
            return q
    return n


class RoundOutput(NamedTuple):
    decoded: bytes
    consumed: int               # input bytes `decoded` stands for
    marks: tuple | None         # (start, end) output spans of the decoded escapes; None: more than max_marks
    spans: tuple                # where escapes changed something, as (out_start, out_end, in_start, in_end):
                                # the last max_spans - 1 one by one, all before them as one span


def decode_round_marked(data: bytes, stop: int | None, families: bytes = FAMILIES,
                        max_marks: int = 0, max_spans: int = 0) -> RoundOutput:
    """decode_round on at most a slice, with where it changed something (see RoundOutput).

    stop=None: a stream's step, decode up to the first escape that more bytes could still
    change (that escape and what follows are not consumed).
    """
    pieces = _pieces(data, families)
    n = len(data)
    if stop is None:
        stop = n if not any(first in data[-MAX_ESCAPE_LEN:] for first in starters(families)) \
            else _open_start(data, pieces, families)
    if len(pieces) == 1:
        return RoundOutput(data[:stop], stop, (), ())
    end = _cut(pieces, n, stop) if stop < n else n
    escapes = pieces[1::2]
    decoded = list(map(_FIXED.get, escapes))
    if None in decoded:
        decoded = [d if d is not None else _decode(e) for d, e in zip(decoded, escapes)]
    pieces[1::2] = decoded
    out = b"".join(pieces)
    marks = None
    if len(decoded) <= max_marks:
        ends = list(accumulate(map(len, pieces)))
        marks = tuple((ends[i - 1], ends[i]) for i in range(1, len(pieces), 2))
    spans = _changed_spans(pieces, escapes, len(out), end, max_spans) if max_spans else ()
    return RoundOutput(out, end, marks, spans)


def _changed_spans(pieces: list[bytes], escapes: list[bytes], out_end: int, in_end: int,
                   max_spans: int) -> tuple:
    """RoundOutput.spans of decoded `pieces`, walking back from the end: work for at most
    max_spans changed escapes (the earlier ones are one span from the first escape on)."""
    spans = []
    out_pos, in_pos = out_end, in_end
    for i in range(len(pieces) - 1, 0, -1):
        piece = pieces[i]
        if i % 2:
            escape = escapes[i >> 1]
            if piece != escape:
                if len(spans) == max_spans - 1:
                    first = len(pieces[0])                 # only a literal before the first escape
                    spans.append((first, out_pos, first, in_pos))
                    break
                spans.append((out_pos - len(piece), out_pos, in_pos - len(escape), in_pos))
            out_pos -= len(piece)
            in_pos -= len(escape)
        else:
            out_pos -= len(piece)
            in_pos -= len(piece)
    return tuple(reversed(spans))


def decode_round(data: bytes, stop: int | None = None,
                 families: bytes = FAMILIES) -> tuple[bytes, int]:
    """One round of escape decoding: (decoded bytes, input bytes they stand for).

    `families`: which escapes to decode (all, or some of b"%", b"\\\\", b"&").
    Escapes that start at or after `stop` are left undecoded and not consumed,
    so a stream can decode a prefix now and the rest once more bytes arrived.
    With stop=None everything is consumed. Every escape shrinks when decoded,
    so `len(decoded) == consumed` means nothing changed.
    """
    data = bytes(data)
    n = len(data)
    if stop is None or stop > n:
        stop = n
    parts, pos = [], 0
    while True:                      # slice by slice: the same parse, bounded lists
        piece_stop = min(stop, pos + _SLICE)
        out, used = decode_round_marked(data[pos:piece_stop + MAX_ESCAPE_LEN], piece_stop - pos, families)[:2]
        parts.append(out)
        pos += used
        if pos >= stop:
            return b"".join(parts), pos


def normalize(data: bytes) -> bytes:
    """One decoding-only view: percent, JSON/JS and HTML numeric escapes decoded all at
    once, up to ESCAPE_ROUNDS times over. Invalid escapes stay; never longer than `data`.
    Not a leak check by itself: use scan.Needles, which matches every view."""
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
