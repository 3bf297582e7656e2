"""Leftover weaknesses, second round (each test failed before its fix; the controls pin what must
keep working). Real gateway, cubevs switch and sandbox namespaces (tests/gateway/hostile_env.py).

1. A sandbox's explicit-proxy token is bound to the address the switch gave that sandbox.
"""
from __future__ import annotations

import socket

import pytest

from testbed import netns
from tests.gateway import rawclient
from tests.gateway.hostile_env import H, SANDBOX, SECOND, SINK, hostile_env
from tests.gateway.switchlab import HUB_IP

pytestmark = pytest.mark.netns

TPORT = 18098
THIEF = "sb-l2-thief"             # a second sandbox of the switch, holding SANDBOX's token


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    with hostile_env(lab, tmp_path_factory.mktemp("leftovers2"), tport=TPORT, prefix="l2") as e:
        e.thief = e.sw.attach_sandbox(THIEF)
        e.gw.tokens[THIEF] = e.gw.cli("identity", "add", THIEF).strip()
        yield e


def _from(ns: str, fn, *args, timeout: float = 15):
    return netns.call_in_netns(ns, fn, *args, timeout=timeout)


def _connect_status(addr: tuple[str, int], target: str, auth: str) -> tuple[int, bytes]:
    s = socket.create_connection(addr, timeout=5)
    try:
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n\r\n".encode())
        head = rawclient.read_head(s)
        return rawclient.connect_status(head), head
    finally:
        s.close()


def _plain_status(addr: tuple[str, int], host: str, path: str, auth: str) -> tuple[int, bytes]:
    s = socket.create_connection(addr, timeout=5)
    try:
        s.sendall(f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{auth}\r\nConnection: close\r\n\r\n".encode())
        head = rawclient.read_head(s)
        return rawclient.connect_status(head), head
    finally:
        s.close()


def _auth(env, sandbox: str) -> str:
    return rawclient.auth_header(sandbox, env.gw.tokens[sandbox])


# ------------------------------------------------------------------ 1. token bound to its sandbox's address
@pytest.mark.parametrize("target", [H, SINK], ids=["intercepted", "passthrough"])
def test_a_sandbox_token_is_refused_from_another_sandbox(env, target):
    """FINDING: explicit-proxy authentication read only the token: SANDBOX's token, taken out of it,
    worked from THIEF's namespace (THIEF's traffic decided and credential-injected as SANDBOX's).
    Now a 407 with its own reason, audited; the same token from SANDBOX's own address still works."""
    addr = (HUB_IP, env.gw.proxy_port)
    status, head = _from(env.thief.netns, _connect_status, addr, f"{target}:443", _auth(env, SANDBOX))
    assert status == 407 and b"proxy_auth_wrong_source" in head, head
    rec = env.gw.wait_record(lambda r: r.get("reason") == "proxy_auth_wrong_source"
                             and r.get("client", "").startswith(env.thief.ip + ":")
                             and (r.get("extra") or {}).get("target") == f"{target}:443")
    assert rec["decision"] == "deny" and rec["status"] == 407, rec
    status, head = _from(env.net.netns, _connect_status, addr, f"{target}:443", _auth(env, SANDBOX))
    assert status == 200, head


def test_a_sandbox_token_is_refused_from_the_host_and_for_plain_http(env):
    """The same binding on the gateway's own namespace (any address not the sandbox's) and on
    absolute-form plain HTTP, where every request authenticates."""
    loop = ("127.0.0.1", env.gw.proxy_port)
    status, head = _from(env.gw.lab.gw_ns, _connect_status, loop, f"{SINK}:443", _auth(env, SANDBOX))
    assert status == 407 and b"proxy_auth_wrong_source" in head, head
    status, head = _from(env.thief.netns, _plain_status, (HUB_IP, env.gw.proxy_port), SINK, "/l2-plain",
                         _auth(env, SANDBOX))
    assert status == 407 and b"proxy_auth_wrong_source" in head, head
    assert env.hostile.requests("/l2-plain") == []
    status, head = _from(env.net.netns, _plain_status, (HUB_IP, env.gw.proxy_port), SINK, "/l2-plain-own",
                         _auth(env, SANDBOX))
    assert status == 200, head


def test_an_identity_of_no_sandbox_works_from_anywhere(env):
    """Control: `identity add` for an agent that is no sandbox of the switch (SECOND) keeps working
    from the host and from inside a sandbox; a thief's own token works from its own address."""
    for ns, addr in ((env.gw.lab.gw_ns, ("127.0.0.1", env.gw.proxy_port)),
                     (env.thief.netns, (HUB_IP, env.gw.proxy_port))):
        status, head = _from(ns, _connect_status, addr, f"{SINK}:443", _auth(env, SECOND))
        assert status == 200, (ns, head)
    status, head = _from(env.thief.netns, _connect_status, (HUB_IP, env.gw.proxy_port), f"{SINK}:443",
                         _auth(env, THIEF))
    assert status == 200, head

