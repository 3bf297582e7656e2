"""Find and scrub secret values in data and in streams, in bounded memory (pure, no I/O).

- `Needles` finds which secrets occur in one buffer, raw or in its normalised
  view (`forms.normalize`: percent, JSON/JS and HTML escapes decoded, up to
  three rounds).
- `StreamLeakScanner` does the same over a stream and releases only the bytes
  that cannot belong to an occurrence not yet seen whole.
- `StreamScrubber` replaces the one injected secret's forms in a stream and
  refuses (`Unscrubbable`) when a spelling it cannot replace remains.

A stream is decoded exactly as the whole buffer would be (each escape round
runs as its own small stream stage), so chunk boundaries change nothing.
What none of this can catch: data the sandbox (or a colluding upstream)
encrypts or re-encodes itself — base32, UTF-16, hex with separators, its own
compression inside a body (HTTP Content-Encoding is decoded before, by the
gateway), escapes nested deeper than three rounds or longer than
`forms.MAX_ESCAPE_LEN`, a value sent in pieces across separate bodies.
"""
from __future__ import annotations

import re

from typing import Iterable

import ahocorasick_rs as _ac

from .forms import (ESCAPE_ROUNDS, MAX_ESCAPE_LEN, MIN_FORM_LEN, REDACTED, ROUND_EXPANSION,
                    decode_round)

MAX_NEEDLE_LEN = 256      # longer forms are matched by their first 256 bytes (bounds the window)
_SLICE = 256 * 1024       # work on at most this much at once: bounds the match lists


_HEX_DIGITS = re.compile(rb"[0-9a-fA-F]+")
_HEX_LETTER = re.compile(rb"[a-fA-F]")

class LeakFound(Exception):
    """A secret's value or placeholder occurs in the data; names ids only, never values."""

    def __init__(self, secret_ids: Iterable[str]):
        self.secret_ids = tuple(sorted(set(secret_ids)))
        super().__init__("secret value found in data: " + ", ".join(self.secret_ids))


class Unscrubbable(Exception):
    """The injected value occurs in a spelling that cannot be replaced in place."""

    def __init__(self) -> None:
        super().__init__("response carries the injected secret in a form that cannot be scrubbed")


class Needles:
    """The forms of some secrets, compiled once for matching.

    `entries`: (secret_id, value_forms) pairs. Each form is also matched as it
    normalises (a value that itself contains '%41' still matches after decoding).
    """

    def __init__(self, entries: Iterable[tuple[str, frozenset[bytes]]]):
        owners: dict[bytes, set[str]] = {}
        for secret_id, forms in entries:
            for form in forms:
                for needle in _rounds_of(form):
                    if needle and (needle == form or len(needle) >= MIN_FORM_LEN):
                        owners.setdefault(needle[:MAX_NEEDLE_LEN], set()).add(secret_id)
        self._needles = sorted(owners)
        self._owners = [frozenset(owners[n]) for n in self._needles]
        self._automaton = _ac.BytesAhoCorasick(self._needles) if self._needles else None
        # Hex decoders accept any case: hex needles are also matched on a case-folded view
        # (all-lower and all-upper are only two of the 2^n spellings).
        folded: dict[bytes, set[str]] = {}
        for needle, ids in owners.items():
            if len(needle) >= MIN_FORM_LEN and _HEX_DIGITS.fullmatch(needle) and _HEX_LETTER.search(needle):
                folded.setdefault(needle.lower(), set()).update(ids)
        self._folded = sorted(folded)
        self._folded_owners = [frozenset(folded[n]) for n in self._folded]
        self._folded_automaton = _ac.BytesAhoCorasick(self._folded) if self._folded else None
        self.max_len = max(map(len, self._needles), default=0)
        self.empty = not self._needles

    def find_raw(self, data: bytes) -> set[str]:
        """Secret ids whose needles occur in `data` as it is."""
        found: set[str] = set()
        if self._automaton is None or len(data) < 1:
            return found
        step, overlap = _SLICE, self.max_len - 1
        for start in range(0, max(len(data) - overlap, 1), step):
            piece = data[start:start + step + overlap]
            for index, _, _ in self._automaton.find_matches_as_indexes(piece, overlapping=True):
                found |= self._owners[index]
            if self._folded_automaton is not None:
                for index, _, _ in self._folded_automaton.find_matches_as_indexes(piece.lower(), overlapping=True):
                    found |= self._folded_owners[index]
        return found

    def find(self, data: bytes) -> set[str]:
        """Secret ids whose needles occur in `data` or in any escape round of it."""
        data = bytes(data)
        found = self.find_raw(data)
        for _ in range(ESCAPE_ROUNDS):
            decoded, _ = decode_round(data)
            if len(decoded) == len(data):
                break
            found |= self.find_raw(decoded)
            data = decoded
        return found


def _rounds_of(form: bytes) -> set[bytes]:
    out = {form}
    for _ in range(ESCAPE_ROUNDS):
        form, _ = decode_round(form)
        out.add(form)
    return out


def _raw_hold(max_len: int) -> int:
    """Raw bytes to hold back so no byte of a not-yet-seen occurrence is released.

    An occurrence not yet seen in round r's output starts in its last max_len
    bytes; each round holds back <= MAX_ESCAPE_LEN undecoded bytes, and D
    decoded bytes come from <= ROUND_EXPANSION * D + MAX_ESCAPE_LEN input bytes.
    """
    if max_len == 0:
        return 0
    depth = max_len
    for _ in range(ESCAPE_ROUNDS):
        depth = ROUND_EXPANSION * depth + 2 * MAX_ESCAPE_LEN
    return depth


class _Round:
    """One escape round as a stream: decodes what later bytes cannot change."""

    def __init__(self) -> None:
        self._held = b""
        self.changed = False   # has this round ever decoded anything?

    def feed(self, data: bytes, final: bool) -> bytes:
        window = self._held + data
        stop = len(window) if final else len(window) - MAX_ESCAPE_LEN
        if stop <= 0:
            self._held = window
            return b""
        out, used = decode_round(window, stop)
        self._held = window[used:]
        if len(out) != used:
            self.changed = True
        return out


class _Matcher:
    """Needles over one stream, carrying max_len - 1 bytes across calls."""

    def __init__(self, needles: Needles):
        self._needles = needles
        self._keep = max(needles.max_len - 1, 0)
        self._tail = b""

    def _carry(self, window: bytes) -> None:
        self._tail = window[-self._keep:] if self._keep else b""

    def scan(self, data: bytes) -> set[str]:
        window = self._tail + data
        self._carry(window)
        return self._needles.find_raw(window)

    def skip(self, data: bytes) -> None:
        """`data` repeats bytes another matcher already scanned: only carry the tail."""
        self._carry(self._tail + data[-self._keep:] if self._keep else b"")


class StreamLeakScanner:
    """Leak check over a stream: feed() returns what is safe to forward now.

    Raises LeakFound as soon as a needle occurs in the bytes seen so far, raw
    or normalised, before any byte of that occurrence was returned. After a
    LeakFound every further call raises it again. Memory: the held tail
    (`hold` bytes) plus the chunk being fed.
    """

    def __init__(self, needles: Needles):
        self._needles = needles
        self.hold = _raw_hold(needles.max_len)
        self._pending = bytearray()
        self._rounds = [_Round() for _ in range(ESCAPE_ROUNDS)]
        self._matchers = [_Matcher(needles) for _ in range(ESCAPE_ROUNDS + 1)]
        self._leak: LeakFound | None = None

    def feed(self, chunk: bytes) -> bytes:
        if self._needles.empty:
            return bytes(chunk)
        out = []
        view = memoryview(bytes(chunk))
        for start in range(0, len(view), _SLICE):
            out.append(self._step(bytes(view[start:start + _SLICE]), final=False))
        return b"".join(out)

    def finish(self) -> bytes:
        if self._needles.empty:
            return b""
        return self._step(b"", final=True)

    def _step(self, data: bytes, final: bool) -> bytes:
        if self._leak is not None:
            raise self._leak
        self._pending += data
        found = self._matchers[0].scan(data)
        for rnd, matcher in zip(self._rounds, self._matchers[1:]):
            data = rnd.feed(data, final)
            if rnd.changed:
                found |= matcher.scan(data)
            else:             # identical to the round before, which was scanned
                matcher.skip(data)
        if found:
            self._pending.clear()
            self._leak = LeakFound(found)
            raise self._leak
        release = len(self._pending) if final else len(self._pending) - self.hold
        if release <= 0:
            return b""
        out = bytes(self._pending[:release])
        del self._pending[:release]
        return out


class StreamScrubber:
    """Replace the injected secret's forms in a stream; refuse what cannot be replaced.

    Leftmost-longest replacement (no fragment of a longer form survives a
    shorter one), held back across chunk boundaries, so the output over any
    chunking equals feeding everything at once. The replaced stream then goes
    through a StreamLeakScanner on the same forms: a spelling that survived
    (e.g. every character as \\u00XX) raises Unscrubbable.
    """

    def __init__(self, forms: frozenset[bytes], replacement: bytes = REDACTED):
        self._forms = sorted(f for f in forms if f)
        self._replacement = bytes(replacement)
        self._automaton = (_ac.BytesAhoCorasick(self._forms, matchkind=_ac.MatchKind.LeftmostLongest)
                           if self._forms else None)
        self._keep = max(map(len, self._forms), default=1) - 1
        self._held = b""
        self._check = StreamLeakScanner(Needles([("injected", frozenset(self._forms))]))

    def feed(self, chunk: bytes) -> bytes:
        out = []
        view = memoryview(bytes(chunk))
        for start in range(0, len(view), _SLICE):
            out.append(self._step(bytes(view[start:start + _SLICE]), final=False))
        return b"".join(out)

    def finish(self) -> bytes:
        return self._step(b"", final=True)

    def _step(self, data: bytes, final: bool) -> bytes:
        window = self._held + data
        stop = len(window) if final else len(window) - self._keep
        replaced, used = self._replace(window, stop) if stop > 0 else (b"", 0)
        self._held = window[used:]
        try:
            out = self._check.feed(replaced)
            return out + self._check.finish() if final else out
        except LeakFound:
            self._held = b""
            raise Unscrubbable() from None

    def _replace(self, window: bytes, stop: int) -> tuple[bytes, int]:
        """Replace matches starting before `stop`; (output, input bytes consumed)."""
        if self._automaton is None:
            return window[:stop], stop
        parts, pos = [], 0
        for _, start, end in self._automaton.find_matches_as_indexes(window):
            if start >= stop:
                break
            parts.append(window[pos:start])
            parts.append(self._replacement)
            pos = end
        used = max(pos, stop)
        parts.append(window[pos:used])
        return b"".join(parts), used
