"""Find and scrub secret values in data and in streams, in bounded memory (pure, no I/O).

- `Needles` finds which secrets occur in one buffer, raw or in any of its
  decoded views (`VIEWS`: percent, JSON/JS and HTML escapes decoded one family
  at a time in every order, and all families at once; up to three rounds each).
- `StreamLeakScanner` does the same over a stream and releases only the bytes
  that cannot belong to an occurrence not yet seen whole.
- `StreamScrubber` replaces the one injected secret's forms in a stream and
  refuses (`Unscrubbable`) when a spelling it cannot replace remains.

Why so many views: one decode of every family at once is not what a receiver
does, and an escape starter placed next to a spelled value ('%' before hex
digits, '\\u' before them, '&#5' before an escaped '1;', '%25' before '30')
makes that decode eat part of the value, or miss an escape a receiver that
undoes one family first would complete. A receiver that undoes up to three
layers one family at a time (URL-decoding, JSON/JS string decoding, HTML
unescaping, in any order and repeats) reads exactly one of the views.

A stream is decoded exactly as the whole buffer would be (each escape round
runs as its own small stream stage), so chunk boundaries change nothing.
What none of this can catch: data the sandbox (or a colluding upstream)
encrypts or re-encodes itself — base32, UTF-16, hex with separators, its own
compression inside a body (HTTP Content-Encoding is decoded before, by the
gateway), escapes nested deeper than three rounds or longer than
`forms.MAX_ESCAPE_LEN`, escapes we do not decode (named HTML entities for
non-ASCII characters, JSON's \\n \\t, JS octal), layers that mix families
within one layer *and* have an escape starter next to them *and* take a
one-family-at-a-time receiver more than three rounds to undo, a decoder of
the attacker's own making (e.g. one that decodes only every second escape),
a value sent in pieces across separate bodies.
"""
from __future__ import annotations

import re
from itertools import product
from typing import Iterable

import ahocorasick_rs as _ac

from .forms import (ESCAPE_ROUNDS, FAMILIES, MAX_ESCAPE_LEN, MIN_FORM_LEN, REDACTED, ROUND_EXPANSION,
                    decode_round, decode_round_marked, starters)

MAX_NEEDLE_LEN = 256      # longer forms are matched by their first 256 bytes (bounds the window)
_BATCH = 4096             # a stream is scanned in steps of at least this much (or at its end)
_GAP = 256                # windows closer than this are scanned as one (fewer calls, few more bytes)
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

    `entries`: (secret_id, value_forms) pairs. Each form is also matched as every
    view decodes it (a value that itself contains '%41' still matches after decoding).
    """

    def __init__(self, entries: Iterable[tuple[str, frozenset[bytes]]]):
        owners: dict[bytes, set[str]] = {}
        for secret_id, forms in entries:
            for form in forms:
                for needle in _decodings(form):
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
        """Secret ids whose needles occur in `data` or in any view of it (see `VIEWS`)."""
        if self.empty:
            return set()
        data = bytes(data)
        views = _Views(self)
        found: set[str] = set()
        for start in range(0, len(data), _SLICE):
            found |= views.step(data[start:start + _SLICE], final=False)
        return found | views.step(b"", final=True)


def _view_paths() -> tuple[tuple[bytes, ...], ...]:
    """Each view: the escape families decoded by each round, parents before children.

    A receiver undoes layers one family at a time (URL-decoding, JSON/JS string
    decoding, HTML unescaping, in any order), and an escape starter the attacker
    put next to a spelled value (a '%' before hex digits, '&#5' before an escaped
    '1;') parses differently when all families are decoded at once. So every
    order of single families, up to ESCAPE_ROUNDS rounds, is a view of its own;
    all families at once, up to ESCAPE_ROUNDS rounds, covers layers that mix them.
    """
    singles = starters(FAMILIES)
    paths = [(FAMILIES,) * k for k in range(1, ESCAPE_ROUNDS + 1)]
    for k in range(1, ESCAPE_ROUNDS + 1):
        paths += product(singles, repeat=k)
    return tuple(sorted(paths, key=len))


VIEWS = _view_paths()


def _decodings(form: bytes) -> set[bytes]:
    """`form` as every view decodes it."""
    if not any(first in form for first in starters(FAMILIES)):
        return {form}                     # nothing to decode: the common case
    out: dict[tuple[bytes, ...], bytes] = {(): form}
    for path in VIEWS:
        out[path] = decode_round(out[path[:-1]], families=path[-1])[0]
    return set(out.values())


def _raw_hold(max_len: int) -> int:
    """Raw bytes to hold back so no byte of a not-yet-seen occurrence is released.

    An occurrence not yet seen in round r's output starts in its last max_len
    bytes; each round holds back <= MAX_ESCAPE_LEN undecoded bytes, and D
    decoded bytes come from <= ROUND_EXPANSION * D + MAX_ESCAPE_LEN input bytes.
    Every view has at most ESCAPE_ROUNDS rounds, whatever families they decode.
    """
    if max_len == 0:
        return 0
    depth = max_len
    for _ in range(ESCAPE_ROUNDS):
        depth = ROUND_EXPANSION * depth + 2 * MAX_ESCAPE_LEN
    return depth


class _Round:
    """One escape round of some families as a stream: decodes what later bytes cannot change."""

    def __init__(self, families: bytes) -> None:
        self.families = families
        self._starters = starters(families)
        self.held = b""

    def feed(self, data: bytes, final: bool, max_marks: int) -> tuple[bytes, tuple | None]:
        """(decoded bytes, their changed spans or None for "maybe all"), as decode_round_marked."""
        window = self.held + data if self.held else data
        stop = len(window)
        tail = window[-MAX_ESCAPE_LEN:]
        if not final and any(first in tail for first in self._starters):
            stop -= MAX_ESCAPE_LEN        # an escape may start there: wait for its end
        if stop <= 0:
            self.held = window
            return b"", ()
        out, used, marks = decode_round_marked(window, stop, self.families, max_marks)
        self.held = window[used:]
        return out, marks


class _Matcher:
    """Needles over one view's stream, carrying max_len - 1 bytes across calls.

    Given where the view's round changed something, it scans only around those
    spans: an occurrence that touches no changed byte lies in bytes the round
    copied through, so it occurs in the parent view, which is scanned already.
    """

    def __init__(self, needles: Needles):
        self._needles = needles
        self._keep = max(needles.max_len - 1, 0)
        self.tail = b""
        self.tail_marks: tuple = ()      # changed spans inside `tail`

    def scan(self, data: bytes, marks: tuple | None) -> set[str]:
        tail, keep, find = self.tail, self._keep, self._needles.find_raw
        base = len(tail)
        size = base + len(data)
        if marks is None:
            found = find(tail + data)
            spans: tuple = ((0, size),)
        else:
            found = set()
            spans = self.tail_marks + (tuple((s + base, e + base) for s, e in marks) if base else marks)
            lo, hi = 0, -(keep + _GAP + 1)
            for s, e in spans:                # merged windows of keep bytes around each span
                if s - keep > hi + _GAP:
                    if hi > base:
                        found |= find(self._window(data, lo, hi))
                    lo = max(s - keep, 0)
                hi = min(e + keep, size)
            if hi > base:                     # (a window that ends in the tail was scanned before)
                found |= find(self._window(data, lo, hi))
        cut = max(size - keep, 0)
        self.tail = (tail + data)[cut:] if keep and len(data) < keep else data[cut - base:] if keep else b""
        self.tail_marks = tuple((max(s, cut) - cut, e - cut) for s, e in spans if e > cut) if keep else ()
        return found

    def _window(self, data: bytes, lo: int, hi: int) -> bytes:
        base = len(self.tail)
        if lo >= base:
            return data[lo - base:hi - base]
        return self.tail[lo:] + data[:hi - base]


class _Views:
    """Every view of one stream (the raw bytes and each path in VIEWS), decoded as it
    arrives, with the needles found in each. Views that got the same input in the
    same state are decoded and scanned once (e.g. a percent round over data without '%')."""

    def __init__(self, needles: Needles):
        self._needles = needles
        index = {(): 0}
        for i, path in enumerate(VIEWS, 1):
            index[path] = i
        self._parents = [index[path[:-1]] for path in VIEWS]
        self._rounds = [_Round(path[-1]) for path in VIEWS]
        self._matchers = [_Matcher(needles) for _ in range(len(VIEWS) + 1)]

    def step(self, data: bytes, final: bool) -> set[str]:
        max_marks = max(len(data) // (4 * max(self._needles.max_len, 1)), 16)
        outs = [data]
        found = self._matchers[0].scan(data, None)
        rounds_done: dict[tuple, tuple] = {}
        scans_done: dict[tuple, tuple] = {}
        for parent, rnd, matcher in zip(self._parents, self._rounds, self._matchers[1:]):
            source = outs[parent]
            key = (rnd.families, rnd.held, id(source))      # `outs` keeps `source` alive
            done = rounds_done.get(key)
            if done is None:
                out, marks = rnd.feed(source, final, max_marks)
                done = rounds_done[key] = (out, marks, rnd.held)
            out, marks, rnd.held = done
            outs.append(out)
            key = (id(out), marks, matcher.tail, matcher.tail_marks)
            done = scans_done.get(key)
            if done is None:
                hits = matcher.scan(out, marks)
                done = scans_done[key] = (hits, matcher.tail, matcher.tail_marks)
            hits, matcher.tail, matcher.tail_marks = done
            found |= hits
        return found


class StreamLeakScanner:
    """Leak check over a stream: feed() returns what is safe to forward now.

    Small feeds are gathered into steps of _BATCH bytes (the views cost per
    step, not per byte); unscanned bytes are never returned. Raises LeakFound
    in the step where a needle occurs, raw or in any view (see `VIEWS`), before
    any byte of that occurrence was returned. After a LeakFound every further
    call raises it again. Memory: the held tail (`hold` bytes), a few hundred bytes per view,
    the chunk being fed and, while a step runs, every view of that step (at most
    len(VIEWS) + 1 times 256 KiB).
    """

    def __init__(self, needles: Needles):
        self._needles = needles
        self.hold = _raw_hold(needles.max_len) + _BATCH
        self._raw_hold = _raw_hold(needles.max_len)
        self._unscanned = bytearray()
        self._pending = bytearray()
        self._views = _Views(needles) if not needles.empty else None
        self._leak: LeakFound | None = None

    def feed(self, chunk: bytes) -> bytes:
        if self._views is None:
            return bytes(chunk)
        if self._leak is not None:
            raise self._leak
        self._unscanned += chunk
        if len(self._unscanned) < _BATCH:
            return b""
        data, self._unscanned = bytes(self._unscanned), bytearray()
        out = []
        for start in range(0, len(data), _SLICE):
            out.append(self._step(data[start:start + _SLICE], final=False))
        return b"".join(out)

    def finish(self) -> bytes:
        if self._views is None:
            return b""
        data, self._unscanned = bytes(self._unscanned), bytearray()
        out = self._step(data, final=False) if data else b""
        return out + self._step(b"", final=True)

    def _step(self, data: bytes, final: bool) -> bytes:
        if self._leak is not None:
            raise self._leak
        self._pending += data
        found = self._views.step(data, final)
        if found:
            self._pending.clear()
            self._leak = LeakFound(found)
            raise self._leak
        release = len(self._pending) if final else len(self._pending) - self._raw_hold
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
