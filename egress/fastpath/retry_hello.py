"""Passthrough TLS: the ClientHello a server acts on names what the gateway decided.

A TLS 1.3 server that answers the first ClientHello with a HelloRetryRequest reads a second one
and takes its server_name (RFC 8446 4.1.2 says the client must not change it; a server need not
check, and one IP serves many names behind a CDN). The gateway decided on the first hello, so:
until the server's first handshake message is known, every client byte after the first hello is
held (a client can send the second hello before the retry request arrives); after a retry
request, the second hello must be readable and name the same server; then bytes flow unwatched.

Pure: fed bytes, it says what may go upstream now and whether the connection is refused.
"""
from __future__ import annotations

from typing import Callable

from egress import mitm_internals

# RFC 8446 4.1.3: a ServerHello with this random is a HelloRetryRequest
HRR_RANDOM = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")
MAX_HELD = 64 * 1024          # client bytes held while the server's answer is not known (0-RTT data)
_HANDSHAKE, _CCS = 0x16, 0x14
_SERVER_HEAD = 5 + 4 + 2 + 32  # record header, handshake header, legacy_version, random


def first_hello_end(data: bytes) -> int | None:
    """Where the record carrying the first handshake message's last byte ends; None when the
    bytes are not whole handshake records up to there, or that record carries more than it."""
    i, hs = 0, bytearray()
    while i + 5 <= len(data):
        if data[i] != _HANDSHAKE:
            return None
        n = int.from_bytes(data[i + 3:i + 5], "big")
        if i + 5 + n > len(data):
            return None
        hs += data[i + 5:i + 5 + n]
        i += 5 + n
        if len(hs) >= 4:
            want = 4 + int.from_bytes(hs[1:4], "big")
            if len(hs) >= want:
                return i if len(hs) == want else None
    return None


class RetryHelloCheck:
    """One passthrough connection's watch. `decided`: the server name the first hello named (or, with
    none, the destination decided); `first_named`: whether the first hello named one;
    `normalize`: the gate's host normalisation (raises ValueError)."""

    def __init__(self, decided: str, first_named: bool, normalize: Callable[[str], str]) -> None:
        self.decided, self.first_named, self.normalize = decided, first_named, normalize
        self.state = "first"        # first → server → (second →) done | refused
        self.reason: str | None = None
        self._held = bytearray()
        self._server = bytearray()

    @property
    def watching(self) -> bool:
        return self.state not in ("done", "refused")

    def first_flight(self, data: bytes) -> bytes:
        """The bytes read before the relay: the first hello goes upstream, the rest is held."""
        end = first_hello_end(data)
        if end is None:
            self._refuse("tls_handshake_unreadable")
            return b""
        self.state = "server"
        self._held += data[end:]
        return data[:end] if self._check_held() else b""

    def from_client(self, data: bytes) -> bytes:
        """What of the client's bytes may go upstream now."""
        if self.state == "done":
            return data
        if self.state == "refused":
            return b""
        self._held += data
        if not self._check_held():
            return b""
        return self._second() if self.state == "second" else b""

    def from_upstream(self, data: bytes) -> bytes:
        """Fed the server's bytes (they go to the client as they are); the client bytes released now."""
        if self.state != "server":
            return b""
        self._server += data[:_SERVER_HEAD - len(self._server)]
        s = self._server
        if len(s) < 5:
            return b""
        if s[0] != _HANDSHAKE:
            return self._done()                 # an alert or the like: the server acts on no hello
        if int.from_bytes(s[3:5], "big") < _SERVER_HEAD - 5:
            self._refuse("tls_handshake_unreadable")   # a first record too short to classify: fail closed
            return b""
        if len(s) < _SERVER_HEAD:
            return b""
        if s[5] != 0x02 or bytes(s[11:43]) != HRR_RANDOM:
            return self._done()
        self.state = "second"
        return self._second()

    # ------------------------------------------------------------------ inside
    def _check_held(self) -> bool:
        if len(self._held) > MAX_HELD:
            self._refuse("tls_handshake_held_too_long")
            return False
        return True

    def _second(self) -> bytes:
        data = bytes(self._held)
        i = 0
        while i + 5 <= len(data) and data[i] == _CCS:     # middlebox compatibility CCS before it
            i += 5 + int.from_bytes(data[i + 3:i + 5], "big")
        if i + 5 > len(data):
            return b""
        rest = data[i:]
        try:
            hello = mitm_internals.parse_client_hello(rest)
        except ValueError:
            self._refuse("tls_handshake_unreadable")
            return b""
        if hello is None:
            if rest[0] != _HANDSHAKE:
                self._refuse("tls_handshake_unreadable")
            return b""
        if mitm_internals.unread_server_name(hello) or not self._same_server(hello.sni):
            self._refuse("sni_changed_on_retry")
            return b""
        return self._done()

    def _same_server(self, sni: str | None) -> bool:
        if not sni:
            return not self.first_named
        try:
            return self.normalize(sni) == self.decided
        except ValueError:
            return False

    def _done(self) -> bytes:
        self.state = "done"
        out = bytes(self._held)
        self._held.clear()
        return out

    def _refuse(self, reason: str) -> None:
        self.state, self.reason = "refused", reason
        self._held.clear()
