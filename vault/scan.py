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
runs as its own small stream stage), so chunk boundaries change nothing. It
holds back only what may still become part of an occurrence: in each view the
longest suffix that is a proper prefix of a needle (with the base64
characters right before it), and each round's escape cut short at the end,
mapped back round by round to the raw bytes they came from (with the escape
right before, in each round).
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
from bisect import bisect_left, bisect_right
from itertools import product
from typing import Iterable

import ahocorasick_rs as _ac

from .forms import (ESCAPE_ROUNDS, FAMILIES, MAX_ESCAPE_LEN, MIN_FORM_LEN, REDACTED, ROUND_EXPANSION,
                    decode_round, decode_round_marked, has_escape, starters)

MAX_NEEDLE_LEN = 256      # longer forms are matched by their first 256 bytes (bounds the window)
B64_LEAD = 8              # base64 characters held before a possible occurrence (see _Prefixes.lead)
_MAX_SPANS = 16           # escapes a stream round maps exactly (older ones: merged into one span)
_GAP = 256                # windows closer than this are scanned as one (fewer calls, few more bytes)
_SLICE = 256 * 1024       # work on at most this much at once: bounds the match lists
_SMALL = 16 * 1024        # buffers up to this size (a URL and headers) are decoded whole, view by view


_HEX_DIGITS = re.compile(rb"[0-9a-fA-F]+")
_HEX_LETTER = re.compile(rb"[a-fA-F]")
_B64_ALPHABET = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_")
_STARTERS = starters(FAMILIES)
_HEAD = 4                 # prefixes this long are looked up in a set before a full comparison


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
        self.prefixes = _Prefixes(self._needles, self._folded)

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
        if not any(first in data for first in _STARTERS) or not has_escape(data):
            return self.find_raw(data)    # no escape: every view is the data itself
        if len(data) <= _SMALL:
            return self._find_in_whole_views(data)
        return self._find_in_streamed_views(data)

    def _find_in_whole_views(self, data: bytes) -> set[str]:
        """find() for a small buffer: every view decoded whole, each distinct one scanned once
        (on a URL and headers most views are the same few bytes: a handful of decodes and
        scans, not 42 of each)."""
        found: set[str] = set()
        for view in _whole_views(data):
            found |= self.find_raw(view)
        return found

    def _find_in_streamed_views(self, data: bytes) -> set[str]:
        """find() for a large buffer: the stream's views (_Views), slice by slice, scanning only
        around what each round changed (bounded memory: one slice's views at a time)."""
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
_VIEW_INDEX = {(): 0} | {path: i for i, path in enumerate(VIEWS, 1)}
_PARENTS = tuple(_VIEW_INDEX[path[:-1]] for path in VIEWS)   # each view's parent (0: the raw bytes)
_SINGLE_FAMILIES = starters(FAMILIES)


def _whole_views(data: bytes) -> set[bytes]:
    """The distinct views of a whole buffer: what decoding it along every path in VIEWS gives.

    Walked as VIEWS' two trees (all families at once, and one family at a time in every
    order) breadth first, a view at most once: a view with no escape of a round's families
    is its own child there, and one met again deeper has only children met already.
    """
    at_once = {data}
    view = data
    for _ in range(ESCAPE_ROUNDS):              # (FAMILIES,) * k
        if not has_escape(view):
            break
        view = decode_round(view)[0]
        at_once.add(view)
    one_by_one = {data}
    frontier = [data]
    for _ in range(ESCAPE_ROUNDS):              # every order of single families
        children = []
        for view in frontier:
            if not has_escape(view):
                continue                         # every path from here gives the view itself
            for family in _SINGLE_FAMILIES:
                if has_escape(view, family):
                    child = decode_round(view, families=family)[0]
                    if child not in one_by_one:
                        one_by_one.add(child)
                        children.append(child)
        frontier = children
    return at_once | one_by_one


def _decodings(form: bytes) -> set[bytes]:
    """`form` as every view decodes it."""
    if not any(first in form for first in starters(FAMILIES)):
        return {form}                     # nothing to decode: the common case
    out: dict[tuple[bytes, ...], bytes] = {(): form}
    for path in VIEWS:
        out[path] = decode_round(out[path[:-1]], families=path[-1])[0]
    return set(out.values())


class _Prefixes:
    """Which suffix of a stream may begin an occurrence of a needle not yet complete.

    `folded`: needles also matched on the lower-cased data (hex in any case).
    """

    def __init__(self, needles: Iterable[bytes], folded: Iterable[bytes] = ()):
        self._sorted = sorted(needles)
        self._folded = sorted(folded)
        self._heads = {n[:k] for n in self._sorted for k in range(1, _HEAD + 1)}
        # the folded needles' heads in every case, so no position needs lower-casing
        self._folded_heads = {spelling for n in self._folded for k in range(1, _HEAD + 1)
                              for spelling in _in_any_case(n[:k])}
        # where a head starts, found in one pass (short needles: the whole needle is its head)
        whole_heads = sorted({h for h in self._heads | self._folded_heads if len(h) == _HEAD}
                             | {n for n in self._sorted if len(n) < _HEAD})
        self._head_automaton = _ac.BytesAhoCorasick(whole_heads) if whole_heads else None

    def first(self, data: bytes, start: int) -> int:
        """The first i >= start with data[i:] a prefix of a needle (len(data) if none):
        where the longest suffix from `start` on that a needle may still complete begins."""
        n = len(data)
        if self._head_automaton is not None and n - start > _HEAD:
            found = {start + s for _, s, _ in self._head_automaton.find_matches_as_indexes(
                memoryview(data)[start:], overlapping=True)}
            candidates = sorted(found.union(range(n - _HEAD + 1, n)))   # (the last: too short for a whole head)
        else:
            candidates = range(start, n)
        heads, folded_heads = self._heads, self._folded_heads
        for i in candidates:
            head = data[i:i + _HEAD]
            if head in heads and _is_prefix(data[i:], self._sorted):
                return i
            if head in folded_heads and _is_prefix(data[i:].lower(), self._folded):
                return i
        return n

    @staticmethod
    def lead(data: bytes, i: int) -> int:
        """Base64 characters right before data[i] (at most B64_LEAD; B64_LEAD if they reach the
        start of `data`, which may be cut from a longer stream). An aligned base64 form starts
        up to 3 characters into the encoded string, and the quanta before it encode what
        preceded the value (a 'user:' in Basic auth): the string's start is held with it."""
        j = i
        while j > 0 and i - j < B64_LEAD and data[j - 1] in _B64_ALPHABET:
            j -= 1
        return B64_LEAD if j == 0 and i - j < B64_LEAD else i - j


def _in_any_case(text: bytes) -> set[bytes]:
    """Every upper/lower-case spelling of ASCII `text`."""
    return {bytes(letters) for letters in product(*({c, ord(chr(c).upper())} for c in text))}


def _is_prefix(piece: bytes, needles: list[bytes]) -> bool:
    """Whether `piece` is a prefix of one of the sorted `needles`."""
    i = bisect_left(needles, piece)
    return i < len(needles) and needles[i].startswith(piece)


def _raw_hold(max_len: int) -> int:
    """Raw bytes held back at most, so no byte of a not-yet-seen occurrence is released.

    An occurrence not yet complete in a view's output starts in its last max_len - 1
    bytes, with up to B64_LEAD bytes before it; each round holds back < MAX_ESCAPE_LEN
    undecoded bytes and the escape right before (<= MAX_ESCAPE_LEN), and D decoded
    bytes come from <= ROUND_EXPANSION * D + MAX_ESCAPE_LEN input bytes. Every view
    has at most ESCAPE_ROUNDS rounds. The hold actually needed is usually far
    smaller: see StreamLeakScanner.
    """
    if max_len == 0:
        return 0
    depth = max_len + B64_LEAD
    for _ in range(ESCAPE_ROUNDS):
        depth = ROUND_EXPANSION * depth + 3 * MAX_ESCAPE_LEN
    return depth


class _Round:
    """One escape round of some families as a stream: decodes what later bytes cannot change.

    For a stream's hold it also maps its output offsets back to input offsets: exactly
    over its last _MAX_SPANS escapes that changed something, over older ones merged
    into one span, and before that by the expansion bound; never past the true
    offset (nor past the escape right before it), so what is released stays safe.
    """

    def __init__(self, families: bytes, track: bool) -> None:
        self.families = families
        self._starters = starters(families)
        self.held = b""
        self.consumed = 0             # input bytes decoded so far (`held` starts there)
        self.emitted = 0              # output bytes so far
        self._max_spans = _MAX_SPANS if track else 0
        self._spans: list[tuple[int, int, int, int]] = []   # (out_start, out_end, in_start, in_end)
        self._base = (0, 0)           # exact (out, in) with only literals from it up to _spans[0]
        self._out_need = 0            # nothing before these offsets can still be needed
        self._in_need = 0

    def copies(self, data: bytes) -> bool:
        """Whether `data` passes through unchanged (nothing held, no escape starter in it);
        if so it has been accounted for."""
        if self.held or any(first in data for first in self._starters):
            return False
        self.consumed += len(data)
        self.emitted += len(data)
        return True

    def decode(self, data: bytes, final: bool, max_marks: int):
        """This round's output for `data` (see forms.RoundOutput); `advance` applies it."""
        window = self.held + data if self.held else data
        return decode_round_marked(window, len(window) if final else None, self.families,
                                   max_marks, self._max_spans), window

    def advance(self, result) -> None:
        (out, used, _, spans), window = result
        if spans:
            in_at, out_at = self.consumed, self.emitted
            self._spans += [(out_at + a, out_at + b, in_at + c, in_at + d) for a, b, c, d in spans]
            extra = len(self._spans) - self._max_spans
            if extra > 0:             # merge the oldest: bounded memory, coarser far back
                first, last = self._spans[0], self._spans[extra]
                self._spans[:extra + 1] = [(first[0], last[1], first[2], last[3])]
        self.held = window[used:]
        self.consumed += used
        self.emitted += len(out)

    def input_need(self, out_need: int) -> int:
        """Given that output bytes from `out_need` on may still be needed, the input offset from
        which input bytes may be (monotone: what was safe stays safe)."""
        if out_need <= self._out_need:
            return self._in_need
        self._out_need = out_need
        spans = self._spans
        if spans and spans[0][1] < out_need:          # (one ending at out_need is still needed)
            count = bisect_left(spans, out_need, key=_span_end)
            self._base = spans[count - 1][1], spans[count - 1][3]
            del spans[:count]
        self._in_need = max(self._in_need, self._to_input(out_need))
        return self._in_need

    def _to_input(self, out: int) -> int:
        """Where the input that output offset `out` (and what follows) came from begins,
        the escape right before `out` included: an escape starter put next to a spelled
        value pairs with its first escaped byte ('\\' + '&#92;'), so that escape holds
        bytes of the spelling."""
        out = min(out, self.emitted)
        spans = self._spans
        k = bisect_left(spans, out, key=_span_end)
        if k < len(spans) and spans[k][1] == out:    # an escape (or a merged span's last) ends here
            return max(spans[k][2], spans[k][3] - MAX_ESCAPE_LEN)
        if out == self.emitted:
            return self.consumed
        i = bisect_right(spans, out, key=_span_start) - 1
        if i >= 0:
            out_start, out_end, in_start, in_end = spans[i]
            if out > out_end:
                return in_end + out - out_end
            # inside: a single escape starts at in_start; a merged span, no earlier than that
            # and than its end less what out_end - out output bytes can have come from
            return max(in_start, in_end - ROUND_EXPANSION * (out_end - out) - MAX_ESCAPE_LEN)
        base_out, base_in = self._base
        if out >= base_out:
            return base_in + out - base_out
        return max(base_in - ROUND_EXPANSION * (base_out - out) - MAX_ESCAPE_LEN, 0)


def _span_start(span: tuple) -> int:
    return span[0]


def _span_end(span: tuple) -> int:
    return span[1]


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
        self._partial = 0                # offset in the view where its longest needle prefix starts

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

    def pending(self, size: int, seen: dict) -> int:
        """Offset in the view (whose output is `size` bytes so far) from which its bytes may
        belong to an occurrence not yet complete: the longest suffix that is a proper prefix
        of a needle, with the base64 characters right before it (_Prefixes.lead).
        `seen`: answers for tails other views share, during one hold computation."""
        tail = self.tail
        at = size - len(tail)                 # view offset of tail[0]
        start = max(self._partial - at, 0)    # monotone: a longer suffix cannot become a prefix again
        key = (id(tail), start)
        i = seen.get(key)
        if i is None:
            i = seen[key] = self._needles.prefixes.first(tail, start)
        self._partial = at + i
        return max(at + i - _Prefixes.lead(tail, i), 0)

    def _window(self, data: bytes, lo: int, hi: int) -> bytes:
        base = len(self.tail)
        if lo >= base:
            return data[lo - base:hi - base]
        return self.tail[lo:] + data[:hi - base]


class _Views:
    """Every view of one stream (the raw bytes and each path in VIEWS), decoded as it
    arrives, with the needles found in each. Views that got the same input in the
    same state are decoded and scanned once (e.g. a percent round over data without '%').
    `track`: also keep what `hold_start` needs (a stream's; not a whole buffer's)."""

    def __init__(self, needles: Needles, track: bool = False):
        self._needles = needles
        self._track = track
        # Until the first escape starter every view is the raw stream itself: the rounds and
        # their matchers are made then (_unfold), in the state they would have had by then.
        self._rounds: list[_Round] = []
        self._matchers = [_Matcher(needles)]
        self.size = 0                   # raw bytes stepped so far
        self._quiet = True              # no round holds undecoded bytes

    def _unfold(self) -> None:
        copied, tail = self.size, self._matchers[0].tail
        for path in VIEWS:
            rnd = _Round(path[-1], self._track)
            rnd.consumed = rnd.emitted = copied
            matcher = _Matcher(self._needles)
            matcher.tail = tail       # (a copied view's tail is the raw tail, with no changed span)
            self._rounds.append(rnd)
            self._matchers.append(matcher)

    def step(self, data: bytes, final: bool) -> set[str]:
        if self._quiet and not any(first in data for first in _STARTERS):
            self.size += len(data)
            return self._step_copied(data)
        if not self._rounds:
            self._unfold()
        self.size += len(data)
        max_marks = max(len(data) // (4 * max(self._needles.max_len, 1)), 16)
        outs = [data]
        found = self._matchers[0].scan(data, None)
        rounds_done: dict[tuple, tuple] = {}
        scans_done: dict[tuple, tuple] = {}
        for parent, rnd, matcher in zip(_PARENTS, self._rounds, self._matchers[1:]):
            source = outs[parent]
            if rnd.copies(source):
                out, marks = source, ()
            else:
                key = (rnd.families, rnd.held, id(source))      # `outs` keeps `source` alive
                done = rounds_done.get(key)
                if done is None:
                    done = rounds_done[key] = rnd.decode(source, final, max_marks)
                rnd.advance(done)
                out, marks = done[0].decoded, done[0].marks
            outs.append(out)
            key = (id(out), marks, matcher.tail, matcher.tail_marks)
            done = scans_done.get(key)
            if done is None:
                hits = matcher.scan(out, marks)
                done = scans_done[key] = (hits, matcher.tail, matcher.tail_marks)
            hits, matcher.tail, matcher.tail_marks = done
            found |= hits
        self._quiet = not any(rnd.held for rnd in self._rounds)
        return found

    def _step_copied(self, data: bytes) -> set[str]:
        """step() for data without an escape starter while no round holds anything: every
        round copies it through, so every view gets `data` itself, with no changed span."""
        if not self._rounds:
            return self._matchers[0].scan(data, None)
        n = len(data)
        for rnd in self._rounds:
            rnd.consumed += n
            rnd.emitted += n
        found = self._matchers[0].scan(data, None)
        scans_done: dict[tuple, tuple] = {}
        for matcher in self._matchers[1:]:
            key = (matcher.tail, matcher.tail_marks)
            done = scans_done.get(key)
            if done is None:
                hits = matcher.scan(data, ())
                done = scans_done[key] = (hits, matcher.tail, matcher.tail_marks)
            hits, matcher.tail, matcher.tail_marks = done
            found |= hits
        return found

    def hold_start(self) -> int:
        """Raw offset before which no byte can belong to an occurrence not yet complete in
        any view: per view its pending suffix (_Matcher.pending) and its round's undecoded
        rest, mapped back round by round to the raw stream; the earliest of them."""
        need = [self.size] + [rnd.emitted for rnd in self._rounds]     # per view, in its output
        seen: dict[tuple, int] = {}
        for i in range(len(self._rounds), 0, -1):                        # children before parents
            rnd = self._rounds[i - 1]
            if rnd.held or rnd.consumed != rnd.emitted:
                in_need = rnd.input_need(min(need[i], self._matchers[i].pending(rnd.emitted, seen)))
            else:       # it changed nothing so far (escapes shrink): its parent's view, held by it
                in_need = need[i]
            parent = _PARENTS[i - 1]
            if in_need < need[parent]:
                need[parent] = in_need
        return min(need[0], self._matchers[0].pending(self.size, seen))


class StreamLeakScanner:
    """Leak check over a stream: feed() returns what is safe to forward now.

    Every feed is scanned at once, raw and in every view (see `VIEWS`); it raises
    LeakFound in the feed where a needle occurs, before any byte of that occurrence
    was returned. It returns every byte that cannot belong to an occurrence not yet
    complete: it holds back only, per view, the longest suffix that is a proper
    prefix of a needle (with the base64 characters right before it) and an escape
    cut short at the end, mapped back to the raw bytes they came from (with the
    escape right before, in each round). For text,
    JSON or event streams that is nothing at most event ends and a few bytes
    otherwise; at worst (escapes nested three deep) it is `hold` bytes. After a
    LeakFound every further call raises it again. Memory: the held tail (<= `hold`
    bytes), a few hundred bytes and up to _MAX_SPANS escape positions per view, the
    chunk being fed and, while a step runs, every view of that step (at most
    len(VIEWS) + 1 times 256 KiB).
    """

    def __init__(self, needles: Needles):
        self._needles = needles
        self.hold = _raw_hold(needles.max_len)
        self._pending = bytearray()
        self._released = 0
        self._views = _Views(needles, track=True) if not needles.empty else None
        self._leak: LeakFound | None = None

    @property
    def held(self) -> int:
        """Bytes fed but not yet returned."""
        return len(self._pending)

    def feed(self, chunk: bytes) -> bytes:
        if self._views is None:
            return bytes(chunk)
        if self._leak is not None:
            raise self._leak
        chunk = bytes(chunk)
        out = []
        for start in range(0, len(chunk), _SLICE):
            out.append(self._step(chunk[start:start + _SLICE], final=False))
        return b"".join(out)

    def finish(self) -> bytes:
        if self._views is None:
            return b""
        return self._step(b"", final=True)

    def _step(self, data: bytes, final: bool) -> bytes:
        if self._leak is not None:
            raise self._leak
        self._pending += data
        found = self._views.step(data, final)
        if found:
            self._pending.clear()
            self._leak = LeakFound(found)
            raise self._leak
        release = len(self._pending) if final else self._views.hold_start() - self._released
        if release <= 0:
            return b""
        out = bytes(self._pending[:release])
        del self._pending[:release]
        self._released += release
        return out


class ScrubForms:
    """One value's forms compiled once for scrubbing: the leftmost-longest replacement, the
    prefixes a stream holds back and the needles that check nothing survived. Building it is
    most of a scrub's cost on a small body: keep one per value (vault.Injection does) and
    share it between every StreamScrubber and whole-buffer scrub of that value."""

    def __init__(self, forms: frozenset[bytes], replacement: bytes = REDACTED):
        self.forms = tuple(sorted(f for f in forms if f))
        self.replacement = bytes(replacement)
        self._automaton = (_ac.BytesAhoCorasick(list(self.forms), matchkind=_ac.MatchKind.LeftmostLongest)
                           if self.forms else None)
        self.keep = max(map(len, self.forms), default=1) - 1
        self.prefixes = _Prefixes(self.forms)
        self.needles = Needles([("injected", frozenset(self.forms))])

    def occurs_in(self, data: bytes) -> bool:
        """Whether a form occurs in `data` as it is (one pass; forms.scrub has nothing to do if not)."""
        return self._automaton is not None and bool(self._automaton.find_matches_as_indexes(data))

    def visible(self, data: bytes) -> bool:
        """Whether the value occurs in `data` in any spelling a receiver could undo (every view)."""
        return bool(self.needles.find(data))

    def scrub(self, data: bytes) -> bytes:
        """A whole buffer, replaced as a StreamScrubber fed all of it would; raises Unscrubbable."""
        out, _ = self.replace(bytes(data), len(data))
        if self.needles.find(out):
            raise Unscrubbable()
        return out

    def replace(self, window: bytes, stop: int) -> tuple[bytes, int]:
        """Replace matches starting before `stop`; (output, input bytes consumed)."""
        if self._automaton is None:
            return window[:stop], stop
        parts, pos = [], 0
        for _, start, end in self._automaton.find_matches_as_indexes(window):
            if start >= stop:
                break
            parts.append(window[pos:start])
            parts.append(self.replacement)
            pos = end
        used = max(pos, stop)
        parts.append(window[pos:used])
        return b"".join(parts), used


class StreamScrubber:
    """Replace the injected secret's forms in a stream; refuse what cannot be replaced.

    Leftmost-longest replacement (no fragment of a longer form survives a
    shorter one); only a suffix that may still grow into a form is held back
    across chunk boundaries, so the output over any chunking equals feeding
    everything at once. The replaced stream then goes through a
    StreamLeakScanner on the same forms: a spelling that survived (e.g. every
    character as \\u00XX) raises Unscrubbable. What it holds back is that
    scanner's hold plus that suffix. `forms`: the spellings, or a ScrubForms of them.
    """

    def __init__(self, forms: "frozenset[bytes] | ScrubForms", replacement: bytes = REDACTED):
        self._compiled = forms if isinstance(forms, ScrubForms) else ScrubForms(forms, replacement)
        self._held = b""
        self._check = StreamLeakScanner(self._compiled.needles)

    @property
    def held(self) -> int:
        """Bytes fed but not yet returned (replaced or not)."""
        return len(self._held) + self._check.held

    def feed(self, chunk: bytes) -> bytes:
        out = []
        view = memoryview(bytes(chunk))
        for start in range(0, len(view), _SLICE):
            out.append(self._step(bytes(view[start:start + _SLICE]), final=False))
        return b"".join(out)

    def finish(self) -> bytes:
        return self._step(b"", final=True)

    def _step(self, data: bytes, final: bool) -> bytes:
        compiled = self._compiled
        window = self._held + data
        stop = len(window) if final else compiled.prefixes.first(window, max(len(window) - compiled.keep, 0))
        replaced, used = compiled.replace(window, stop) if stop > 0 else (b"", 0)
        self._held = window[used:]
        try:
            out = self._check.feed(replaced)
            return out + self._check.finish() if final else out
        except LeakFound:
            self._held = b""
            raise Unscrubbable() from None
