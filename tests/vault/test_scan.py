"""vault.forms.normalize / value_forms and vault.scan: table tests."""
from __future__ import annotations

import base64
import json
import random
from urllib.parse import quote

import pytest

from vault.forms import (MAX_ESCAPE_EXPANSION, MIN_FORM_LEN, REDACTED, decode_round, normalize, scrub,
                         value_forms)
from vault.scan import LeakFound, Needles, StreamLeakScanner, StreamScrubber, Unscrubbable

KEY = b"sk-live-4f9a/Zq+7Kd2XwY8"
PLACEHOLDER = b"cgph_abcdefghijklmnopqrstuvwxyz234567"


@pytest.mark.parametrize("data, expected", [
    (b"%63gph_", b"cgph_"),                                  # non-canonical percent
    (b"%63%47%70%48", b"cGpH"),
    (b"%6a%6A", b"jj"),
    (b"%2563", b"c"),                                        # %25 -> % -> c
    (b"%252563", b"c"),                                      # three rounds
    (b"%25252563", b"%63"),                                  # a fourth is not done
    (rb"\u0063\u0047", b"cG"),
    (rb"\u00e9", "\u00e9".encode()),
    (rb"\ud83d\ude00", "\U0001f600".encode()),              # surrogate pair -> UTF-8
    (rb"\ud83d", rb"\ud83d"),                                # lone surrogate stays
    (rb"\x63\x2F", b"c/"),
    (rb"a\/b\"c\\d", b'a/b"c\\d'),
    (rb"\\u0063", b"c"),                                     # \\ -> \, then \u0063 -> c
    (rb"\\\u0063", b"\\c"),
    (b"&#99;&#x63;&#X63;&#099;&#99", b"ccccc"),
    (b"&#0000099;", b"&#0000099;"),                          # longer than we decode: stays
    (b"&#0;&#xD800;", b"&#0;&#xD800;"),                      # invalid code points stay
    (b"&amp;&lowbar;&sol;&AMP;amp;", b"&_/&"),
    (b"&unknown;&amp", b"&unknown;&amp"),
    (b"%zz %4 % \\u12 \\x &# &#x;", b"%zz %4 % \\u12 \\x &# &#x;"),
    (b"%5C%75%30%30%36%33", b"c"),                           # percent-encoded JSON escape
    (b"plain text, nothing to decode", b"plain text, nothing to decode"),
])
def test_normalize(data, expected):
    assert normalize(data) == expected
    assert len(normalize(data)) <= len(data)


def test_decode_round_leaves_escapes_from_stop_on_for_later():
    assert decode_round(b"ab%63%6", 6) == (b"abc%", 6)        # '%6' may still become '%63'
    assert decode_round(rb"ab\u0063de", 3) == (b"abc", 8)     # an escape that started may finish
    assert decode_round(b"no escapes", 4) == (b"no e", 4)


def test_max_escape_expansion_holds_for_the_widest_nesting():
    """Three rounds of 8-byte entities per byte: 512 bytes for one byte, within k*L + k."""
    def widest(text: bytes) -> bytes:
        return b"".join(b"&#%05d;" % b for b in text)
    spelled = widest(widest(widest(b"c")))
    assert normalize(spelled) == b"c" and len(spelled) == 512 <= MAX_ESCAPE_EXPANSION * 2
    value = b"cgph_secret"
    spelled = widest(widest(widest(value)))
    assert normalize(spelled) == value
    assert len(spelled) <= MAX_ESCAPE_EXPANSION * len(value) + MAX_ESCAPE_EXPANSION


def test_value_forms_cover_json_escapes():
    value = b'ab/cd"ef\\gh<i>&j\xc3\xa9'          # '/', '"', '\\', HTML-unsafe and non-ASCII
    forms = value_forms(value)
    text = value.decode()
    assert json.dumps(text)[1:-1].encode() in forms                               # \u00e9, \" and \\
    assert json.dumps(text, ensure_ascii=False)[1:-1].encode() in forms
    assert json.dumps(text, ensure_ascii=False)[1:-1].replace("/", "\\/").encode() in forms
    assert rb"ab\u002fcd" in b" ".join(forms) and rb"ab\u002Fcd" in b" ".join(forms)
    assert rb"\u003ci\u003e\u0026j" in b" ".join(forms)                            # Go's HTML-safe JSON
    assert b"/" in base64.b64encode(b"?" * 9)                # base64 forms with '/' get \/ too
    assert base64.b64encode(b"?" * 9).replace(b"/", b"\\/") in value_forms(b"?" * 9)
    assert all(f == value or len(f) >= MIN_FORM_LEN for f in forms)


def test_value_forms_keep_short_forms_out():
    forms = value_forms(b"k" * 8)
    assert all(len(f) >= MIN_FORM_LEN for f in forms)


def _needles():
    return Needles([("openai", value_forms(KEY)), ("ph", value_forms(PLACEHOLDER))])


@pytest.mark.parametrize("spelling", [
    KEY,
    base64.b64encode(b"user:" + KEY),                        # inside longer base64 (Basic auth)
    base64.urlsafe_b64encode(b"xy" + KEY + b"z"),
    KEY.hex().encode(), KEY.hex().upper().encode(),
    b"".join(b"%%%02X" % c for c in KEY),                    # every byte %XX
    b"".join(b"%%%02x" % c for c in KEY),
    b"".join(b"%%25%02x" % c for c in KEY),                  # double percent-encoding
    b"".join(rb"\u%04x" % c for c in KEY),                   # every char \u00XX
    KEY.replace(b"/", rb"\/"),
    b"".join(b"&#%d;" % c for c in KEY),
    b"".join(b"&#x%x;" % c for c in KEY),
    json.dumps({"k": KEY.decode()}).replace("/", "\\/").encode(),
])
def test_needles_find_every_spelling(spelling):
    data = b'{"padding": "' + b"." * 100 + b'", "v": "' + spelling + b'"}'
    assert _needles().find(data) == {"openai"}


def test_needles_find_several_secrets_and_nothing_in_plain_data():
    n = _needles()
    both = b"a=" + KEY + b"&b=" + b"".join(b"%%%02x" % c for c in PLACEHOLDER)
    assert n.find(both) == {"openai", "ph"}
    plain = json.dumps([{"id": i, "url": f"https://example.com/a\\/{i}", "t": "caf\u00e9 &amp; %20"}
                        for i in range(500)]).encode()
    assert n.find(plain) == set()
    assert n.max_len >= len(KEY.hex()) and not n.empty
    assert Needles([]).empty and Needles([]).find(KEY) == set()


def test_a_value_that_contains_an_escape_is_found_in_every_round():
    odd = b"pass%41word-123"
    n = Needles([("odd", value_forms(odd))])
    assert n.find(odd) == {"odd"}
    assert n.find(b"pass%2541word-123") == {"odd"}            # its percent form
    assert n.find(b"pass%252541word-123") == {"odd"}          # that, once more
    assert n.find(b"\\u0070ass%41word-123") == {"odd"}        # JSON-escaped, '%41' left alone


# An escape starter (or a partial or escaped one) next to a spelled value: decoding every
# family at once parses it differently from a receiver that undoes one family at a time.
DESYNC = [
    # '%' before hex whose last char is \u-escaped: the JSON receiver reads '%' + the hex
    (b"0" * 29, b"%303030303030303030303030303030303030303030303030303030303\\u0030"),
    (b"0" * 8, b"\\u303030303030303&#48;"),                      # '\u' eats hex; HTML receiver
    (b"0" * 14, b"\\u0000000000000&#48;"),
    (b"0" * 8, b"\\u303030303030303&#38;#48;"),                  # HTML twice
    (b"0" * 15, b"\\\\u30303030303030303030303030303%5Cu0030"),  # percent, then JSON
    (b"abc3defghij", b"abc&#5\\u0031;defghij"),                  # JSON completes '&#51;'
    (b"abc3defghij", b"abc&#5%31;defghij"),                      # so does percent
    (b"abc3defghij", b"abc&#x3\\u0033;defghij"),
    (b"abc3defghij", b"abc&#38;#5\\u0031;defghij"),             # an escaped &, then as above
    (b"lt;secret-value1", b"&lt;secret-value\\u0031"),           # '&' makes an entity of it
    (b"x41secret-value1", b"\\x41secret-value%31"),              # '\' makes a \x escape of it
    (b"25secret-value1", b"%25secret-value&#49;"),
    (b"3Asecret-value1", b"%253Asecret-value&#49;"),             # '%25' then '%3A'
    (b"u0041secretvalue", b"\\\\\\u0041secretvalu&#101;"),       # backslash parity
]


@pytest.mark.parametrize("value, data", DESYNC)
def test_escape_starters_next_to_a_value_do_not_hide_it(value, data):
    needles = Needles([("v", value_forms(value))])
    assert needles.find(data) == {"v"}
    assert needles.find(b"." * 300 + data + b"." * 300) == {"v"}
    for size in (1, 7, 4096):
        with pytest.raises(LeakFound):
            _stream(StreamLeakScanner(needles), b"." * 5000 + data, [size] * (5000 // size + 40))
    with pytest.raises(Unscrubbable):
        _stream(StreamScrubber(value_forms(value)), data, [3] * 40)


def test_long_values_are_matched_by_their_first_bytes():
    value = bytes(random.Random(1).choice(b"abcdefghij0123456789") for _ in range(4000))
    n = Needles([("pem", value_forms(value))])
    assert n.max_len <= 256
    assert n.find(b"xx" + value[:300] + b"yy") == {"pem"}


def test_leak_found_names_ids_only():
    exc = LeakFound(["b", "a", "a"])
    assert exc.secret_ids == ("a", "b") and "a, b" in str(exc)
    assert "sk-" not in str(Unscrubbable())


def _stream(obj, data: bytes, sizes):
    out, i = [], 0
    for size in sizes:
        out.append(obj.feed(data[i:i + size]))
        i += size
    out.append(obj.feed(data[i:]))
    out.append(obj.finish())
    return b"".join(out)


@pytest.mark.parametrize("size", [13, 4096, 1 << 20])   # 1-byte feeds: see the leak tests
def test_scanner_passes_clean_data_through_whole(size):
    # 13-byte feeds cost ~1 ms each: 300 items (~13 KB, every feed boundary against every escape of
    # the item many times over) exercise what 3000 would, in a tenth of the time
    items = 300 if size < 4096 else 3000
    data = json.dumps([{"n": i, "s": "x\\/y %41 &amp; \\u00e9"} for i in range(items)]).encode()
    scanner = StreamLeakScanner(_needles())
    assert _stream(scanner, data, [size] * (len(data) // size)) == data


def test_scanner_holds_back_no_more_than_its_bound():
    scanner = StreamLeakScanner(_needles())
    data = bytes(32 + b % 95 for b in random.Random(2).randbytes(1 << 20))
    fed = released = 0
    for i in range(0, len(data), 65536):
        chunk = data[i:i + 65536]
        fed += len(chunk)
        released += len(scanner.feed(chunk))
        assert fed - released <= scanner.hold
    assert released + len(scanner.finish()) == len(data)


@pytest.mark.parametrize("spelling", [KEY, b"".join(rb"\u%04x" % c for c in KEY),
                                      b"".join(b"%%25%02x" % c for c in KEY)])
@pytest.mark.parametrize("size", [1, 5, 4096])
def test_scanner_raises_before_releasing_any_byte_of_the_occurrence(spelling, size):
    prefix = b"." * 50_000
    data = prefix + spelling + b"." * 1000
    scanner = StreamLeakScanner(_needles())
    released = 0
    with pytest.raises(LeakFound) as info:
        for i in range(0, len(data), size):
            released += len(scanner.feed(data[i:i + size]))
            assert released <= len(prefix)
        scanner.finish()
    assert info.value.secret_ids == ("openai",) and KEY.decode() not in str(info.value)
    with pytest.raises(LeakFound):            # stays failed
        scanner.feed(b"more")


def test_scanner_decodes_like_the_whole_body_would():
    """The parse of escapes depends on everything before (here: the parity of a run of
    backslashes); a window that started mid-run would decode it differently."""
    spelled = b"\\" * 40001 + b"".join(rb"\u%04x" % c for c in KEY)
    assert _needles().find(spelled) == {"openai"}
    scanner = StreamLeakScanner(_needles())
    with pytest.raises(LeakFound):
        _stream(scanner, spelled, [997] * 60)
    for run in (40000, 40001):
        spelled = b"\\" * run + b"".join(rb"\u%04x" % c for c in KEY)
        with pytest.raises(LeakFound):
            _stream(StreamLeakScanner(_needles()), spelled, [997] * 60)


def test_scanner_with_no_needles_is_a_pass_through():
    scanner = StreamLeakScanner(Needles([]))
    assert scanner.feed(KEY) == KEY and scanner.finish() == b""


@pytest.mark.parametrize("size", [1, 3, 100, 1 << 20])
def test_scrubber_replaces_every_form_like_scrub_does(size):
    forms = value_forms(KEY)
    body = b" | ".join([KEY, base64.b64encode(KEY), KEY.hex().encode(), base64.b64encode(b"bot:" + KEY),
                        KEY.replace(b"/", rb"\/"), quote(KEY.decode(), safe="").encode(), b"plain"]) * 20
    out = _stream(StreamScrubber(forms), body, [size] * (len(body) // size))
    assert out == scrub(body, forms)
    assert not any(f in out for f in forms) and b"Basic" not in out and out.count(REDACTED) == 120


def test_scrubber_replaces_longest_first():
    token = base64.b64encode(b"bot:" + KEY)
    forms = value_forms(KEY, (token,))
    out = _stream(StreamScrubber(forms), b"Authorization: Basic " + token, [1] * 100)
    assert out == b"Authorization: Basic " + REDACTED


@pytest.mark.parametrize("obfuscated", [
    b"".join(rb"\u%04x" % c for c in KEY),                  # every char \u00XX
    KEY[:5] + b"%%%02x" % KEY[5] + KEY[6:],                 # one byte percent-encoded
    b"".join(b"&#%d;" % c for c in KEY),
    base64.b64encode(b"user:" + KEY).replace(b"saXZl", rb"sa\u0058Zl"),   # one char escaped
])
def test_scrubber_refuses_what_it_cannot_replace(obfuscated):
    scrubber = StreamScrubber(value_forms(KEY))
    with pytest.raises(Unscrubbable) as info:
        _stream(scrubber, b"x" * 10_000 + obfuscated + b"y" * 10, [333] * 40)
    assert KEY.decode() not in str(info.value)


def test_scrubber_passes_clean_data_through():
    body = b"nothing secret here, just %41 and \\u0041 and &amp;" * 1000
    assert _stream(StreamScrubber(value_forms(KEY)), body, [10] * 5000) == body


# -- what a stream holds back ------------------------------------------------------------
def _sse(text: str) -> bytes:
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


SSE_EVENTS = [_sse(t) for t in ["Hello", " w\u00f6rld", " \"quoted\"", " 100%", " a&b", " &amp; %41 x\\/y",
                                  " path/to/file", " line\nbreak", " caf\u00e9 \U0001f600", " sk", " done"]] + [
    b"event: ping\ndata: {}\n\n", b": keep-alive\n\n", b"data: [DONE]\n\n"]


@pytest.mark.parametrize("make", [lambda: StreamLeakScanner(_needles()), lambda: StreamScrubber(value_forms(KEY))],
                         ids=["scanner", "scrubber"])
def test_sse_events_are_released_as_they_are_fed(make):
    stream = make()
    for event in SSE_EVENTS:
        assert stream.feed(event) == event
        assert stream.held == 0
    assert stream.finish() == b""


@pytest.mark.parametrize("make", [lambda: StreamLeakScanner(_needles()), lambda: StreamScrubber(value_forms(KEY))],
                         ids=["scanner", "scrubber"])
def test_only_a_suffix_that_is_a_needle_prefix_is_held(make):
    stream = make()
    first = _sse(" the key is ")[:-2] + b" " + KEY[:9]            # an event cut right inside the key
    assert stream.feed(first) == first[:-9] and stream.held == 9
    assert stream.feed(b"x" + KEY[10:12] + b'"') == KEY[:9] + b"x" + KEY[10:12] + b'"'   # diverged: all goes
    assert stream.held == 0
    assert stream.feed(b"\n\n") == b"\n\n" and stream.finish() == b""


def test_a_needle_prefix_completed_later_is_never_released():
    scanner = StreamLeakScanner(_needles())
    head = _sse("ok")
    assert scanner.feed(head) == head
    assert scanner.feed(b'data: {"k": "' + KEY[:5]) == b'data: {"k": "'
    assert scanner.feed(KEY[5:12]) == b""
    with pytest.raises(LeakFound):
        scanner.feed(KEY[12:] + b'"}\n\n')


def test_the_scrubber_replaces_a_key_split_across_events():
    scrubber = StreamScrubber(value_forms(KEY))
    out = scrubber.feed(_sse("a")) + scrubber.feed(b'data: {"k": "' + KEY[:11])
    assert KEY[:11] not in out and out.endswith(b'data: {"k": "')
    out += scrubber.feed(KEY[11:] + b'"}\n\n') + scrubber.finish()
    assert out == _sse("a") + b'data: {"k": "' + REDACTED + b'"}\n\n'


@pytest.mark.parametrize("tail, held", [
    (b"%", 1), (b"%4", 2), (b"\\", 1), (b"\\u", 2), (b"\\u00", 4), (b"\\ud83d", 6), (b"\\ud83d\\ude0", 11),
    (b"&", 1), (b"&#", 2), (b"&#5", 3), (b"&#12345", 7), (b"&#x4", 4), (b"&am", 3), (b"&amp", 4),
    (b"%!", 0), (b"&#123456;", 0), (b"%20!", 0), (b"\\u0022;", 0), (b"&#59; ", 0),
    # an escape at the very end: held until the next byte (it may pair with an escaped value byte)
    (b"&#59;", 5), (b"&lt;", 4), (b"%20", 3), (b"\\u0022", 6),
    # escapes whose decoding is an escape starter, or one cut short: open in the next round
    (b"%25", 3), (b"&amp;", 5), (b"\\\\", 2), (b"%252", 4), (b"&#37;2", 6), (b"\\u00255", 7),
    # decoding to a base64 character: held as the start of a possible base64 form
    (b"\\u0041", 6), (b"&#51;", 5), (b"%G", 1),
])
def test_an_escape_cut_short_is_held_and_nothing_else(tail, held):
    scanner = StreamLeakScanner(_needles())
    data = b'data: {"t": " ' + tail
    assert scanner.feed(data) == data[:len(data) - held] and scanner.held == held
    rest = b' "}\n\n'
    assert scanner.feed(rest) == data[len(data) - held:] + rest and scanner.held == 0


def test_a_partial_occurrence_nested_three_deep_is_held_whole_and_within_the_bound():
    def widest(text: bytes) -> bytes:
        return b"".join(b"&#%05d;" % b for b in text)
    spelled = widest(widest(widest(KEY[:20])))                          # 20 bytes of the key, 512 bytes each
    scanner = StreamLeakScanner(_needles())
    out = scanner.feed(b"." * 100 + b" " + spelled)
    assert out == b"." * 100 + b" " and scanner.held == len(spelled) <= scanner.hold
    with pytest.raises(LeakFound):
        scanner.feed(widest(widest(widest(KEY[20:]))))


def test_a_base64_string_is_held_from_its_start():
    """An aligned base64 form begins a few characters into the string (after the encoding of
    what precedes the value, e.g. 'user:'): the string's start is held with it."""
    scanner = StreamLeakScanner(_needles())
    token = base64.b64encode(b"user:" + KEY)
    assert scanner.feed(b"Authorization: Basic " + token[:12]) == b"Authorization: Basic "
    with pytest.raises(LeakFound):
        scanner.feed(token[12:])
