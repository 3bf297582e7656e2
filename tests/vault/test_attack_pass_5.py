"""Attack pass 5 on the vault admin API: the real API over HTTP on a real vault (SQLite)."""
from __future__ import annotations

import os

import httpx
import pytest


def test_unseal_from_a_fifo_is_a_prompt_400_not_a_stuck_thread(api, tmp_path):
    """FINDING: `POST /v1/unseal {"key_file": ...}` opened the server path with a blocking
    open(2): a FIFO (mode 0600, so the mode check passed) blocked the call and an executor thread
    forever, and each retry took another (the daemon's default executor, shared with its other
    blocking work). Now the open does not block: not a regular file, 400 at once."""
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo, 0o600)
    try:
        r = httpx.post(api.url + "/v1/unseal", headers={"Authorization": f"Bearer {api.admin}"},
                       json={"key_file": str(fifo)}, timeout=10)
        assert r.status_code == 400 and r.json()["error"] == "key_error", r.text
    except httpx.ReadTimeout:
        pytest.fail("unseal from a FIFO hung")
    finally:   # release a reader stuck in open(2), if any
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert not api.vault.sealed


def _send_head(url: str, path: str, length: int, body_part: bytes, token: str | None = None):
    import socket
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{auth}"
              f"Content-Length: {length}\r\n\r\n".encode() + body_part)
    return s


def _answer(s, timeout: float = 3.0) -> bytes:
    import socket
    s.settimeout(timeout)
    try:
        return s.recv(65536)
    except socket.timeout:
        return b""


def test_bodies_read_before_any_token_check_are_bounded_per_server(api):
    """FINDING: tornado reads a whole body before a handler (and its token check) runs, and each
    API bounded only one body: anyone on the host could open many connections each declaring a
    body just under the limit and trickle it (E2B API: 256 MiB each), and the daemon held them
    all. Now one server holds at most twice its body limit of bodies being read: the third
    900 KB body is answered 503 before it is read; the first two, once complete, reach the handler.
    (Attack pass 6: these bodies must carry a valid token to be held at all; without one, a
    body over 64 KiB is a 401 before it is read — see tests/e2b/test_attack_pass_6.py.)"""
    import select
    n = 900_000
    anonymous = _send_head(api.url, "/v1/secrets", n, b"{")
    assert _answer(anonymous).startswith(b"HTTP/1.1 401")
    anonymous.close()
    # three callers (one caller may hold at most half the budget: attack pass 6)
    tokens = [api.admin] + [api.vault.tokens.create("admin", 3600, f"caller {i}")[1] for i in range(2)]
    socks = [_send_head(api.url, "/v1/secrets", n, b"{", t) for t in tokens]
    try:
        # Which head the server reads last is its business (under load the order may differ from
        # ours): exactly one of the three is refused at once, the two it holds wait for their bodies.
        readable, _, _ = select.select(socks, [], [], 15)
        assert len(readable) >= 1, "no body was refused: three near-limit bodies held at once"
        refused = readable[0]
        got = _answer(refused)
        assert got.startswith(b"HTTP/1.1 503") and b'"busy"' in got, got[:200]
        held = [s for s in socks if s is not refused]
        assert not select.select(held, [], [], 0.5)[0], "a held body was answered before it was sent"
        for s in held:
            s.sendall(b" " * (n - 2) + b"}")
            assert _answer(s, 10).startswith(b"HTTP/1.1 400"), "a held body was not answered"
        after = _send_head(api.url, "/v1/secrets", n, b"{" + b" " * (n - 2) + b"}", tokens[0])   # room again
        assert _answer(after, 10).startswith(b"HTTP/1.1 400")
        after.close()
    finally:
        for s in socks:
            s.close()
