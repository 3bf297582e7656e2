"""Attack pass 6 on the daemon's browser and admin APIs: a real `cubegate run` with the console,
the vault admin API and the policy API on.

Every httpkit server reserved its body budget (2 x its 1 MiB limit) from a declared
Content-Length before any credential was looked at: two idle connections from anyone on the
host held it for the body timeout (300 s), and meanwhile every logged-in operator's form post,
every unseal and every policy change was answered 503. Now only a request whose headers carry
valid credentials (a live session cookie, a valid bearer token) may declare more than 64 KiB;
others get a 401 before a byte of the body is read, and their small bodies (the login form)
have a budget of their own."""
from __future__ import annotations

import socket
import time

import httpx
import pytest
import yaml

from tests.console.consolekit import ConsoleDaemon, first_line as _first_line

MIB = 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = ConsoleDaemon(tmp_path_factory.mktemp("console-attack6")).start()
    try:
        yield d
    finally:
        d.stop()


def _heads(port: int, path: str, n: int, length: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n\r\n".encode())
        out.append(s)
    time.sleep(0.3)
    return out


def test_idle_anonymous_bodies_block_no_operator_of_the_console_vault_or_policy_api(daemon):
    ports = yaml.safe_load(daemon.settings_path.read_text())
    vault_port, policy_port = ports["vault"]["api_port"], ports["policy_api"]["port"]
    browser = daemon.login()
    socks = (_heads(daemon.port, "/logout", 2, MIB) + _heads(vault_port, "/v1/seal", 2, MIB)
             + _heads(policy_port, "/v1/decide", 2, MIB))
    try:
        # while they wait: before, each of these was 503 "too many request bodies"
        bearer = {"Authorization": f"Bearer {daemon.tokens['admin']}"}
        r = httpx.post(f"http://127.0.0.1:{vault_port}/v1/unseal", headers=bearer, json={"nope": 1}, timeout=10)
        assert r.status_code == 400, (r.status_code, r.text)
        r = httpx.post(f"http://127.0.0.1:{policy_port}/v1/decide", headers=bearer, json={"nope": 1}, timeout=10)
        assert r.status_code == 400, (r.status_code, r.text)
        r = browser.post("/logout")
        assert r.status_code == 303, (r.status_code, r.text[:300])
        for s in socks:
            assert _first_line(s) == b"HTTP/1.1 401 Unauthorized"
    finally:
        for s in socks:
            s.close()
    # a small anonymous body still reaches the handler (the login form works)
    assert daemon.login() is not None
