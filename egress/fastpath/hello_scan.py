"""The SNI of a ClientHello in its common shape, without mitmproxy's object parser. Pure.

mitmproxy's parser (kaitai: a stream object, ~400 Python calls per hello) is what decides what a
ClientHello means; this reads only the shape every client sends — the whole handshake in one
record, every length consistent, nothing left over — and answers None for anything else, which
then goes to mitmproxy's parser as before. So it is only ever narrower than mitmproxy's, never
different: on the hellos it answers, the SNI and the unread-server-name flag are the ones
mitmproxy's ClientHello.sni and egress.mitm_internals.unread_server_name give
(tests/gateway/test_hello_scan.py compares the two on real and generated hellos).
"""
from __future__ import annotations

from mitmproxy.net.check import is_valid_host    # the same validity test as ClientHello.sni

_SERVER_NAME, _ALPN = 0, 16


def scan_hello(data: bytes) -> tuple[str | None, bool] | None:
    """(sni, sni_unread) of a complete ClientHello that is exactly one TLS record's body, or None:
    not that shape (incomplete, several records, inconsistent lengths): ask mitmproxy's parser.
    Bytes after the record (the client's next ones) are not looked at, as mitmproxy does not."""
    n = len(data)
    if n < 9 or data[0] != 0x16 or data[1] != 0x03 or data[2] > 0x03 or data[5] != 0x01:
        return None
    record_end = 5 + (data[3] << 8 | data[4])
    body_end = 9 + (data[6] << 16 | data[7] << 8 | data[8])
    if record_end > n or body_end != record_end:
        return None                      # incomplete, spanning records, or sharing its record
    p = 9 + 34                           # version, random
    if p >= body_end:
        return None
    p += 1 + data[p]                     # session id
    if p + 2 > body_end:
        return None
    suites = data[p] << 8 | data[p + 1]
    if suites & 1:
        return None                      # mitmproxy reads len // 2 suites: an odd length shifts the rest
    p += 2 + suites
    if p >= body_end:
        return None
    p += 1 + data[p]                     # compression methods
    if p == body_end:
        return None, False               # no extensions
    if p + 2 > body_end or p + 2 + (data[p] << 8 | data[p + 1]) != body_end:
        return None
    p += 2
    names = 0
    sni = None
    while p < body_end:
        if p + 4 > body_end:
            return None
        ext_type, ext_len = data[p] << 8 | data[p + 1], data[p + 2] << 8 | data[p + 3]
        start, p = p + 4, p + 4 + ext_len
        if p > body_end:
            return None
        if ext_type == _SERVER_NAME:
            names += 1
            entries = _entries(data, start, p, 2)
            if entries is None:
                return None
            if sni is None and len(entries) == 1 and data[entries[0][0] - 3] == 0:
                name = data[entries[0][0]:entries[0][1]]
                if is_valid_host(name):
                    sni = name.decode("ascii")
        elif ext_type == _ALPN:
            if _entries(data, start, p, 1) is None:
                return None              # mitmproxy's parser refuses a malformed ALPN list
    return sni, names > 1 or (names == 1 and sni is None)


def _entries(data: bytes, start: int, end: int, length_bytes: int) -> list[tuple[int, int]] | None:
    """An extension body that is a u16 list length (equal to what follows) and entries of a
    [u8 name type, for server names] + u8/u16 length + bytes, filling it exactly: the (start, end)
    of each entry's bytes; None otherwise."""
    if start + 2 > end or (data[start] << 8 | data[start + 1]) != end - start - 2:
        return None
    p, out = start + 2, []
    while p < end:
        if length_bytes == 2:            # server_name: type (1 byte), length (2 bytes)
            if p + 3 > end:
                return None
            first, p = p + 3, p + 3 + (data[p + 1] << 8 | data[p + 2])
        else:                            # ALPN protocol: length (1 byte)
            first, p = p + 1, p + 1 + data[p]
        if p > end:
            return None
        out.append((first, p))
    return out
