"""Attack pass 6 on the E2B API (and the runtime API, which shares httpkit's body budget).

The body budget of an httpkit server (2 x its largest body) was reserved from the declared
Content-Length as soon as the headers arrived, before any credential was looked at. Two idle
connections from anyone on loopback declaring two 256 MiB uploads held all of it until the
body timeout (300 s), and every other caller's request with a body (sandbox create, envd
calls, uploads) was answered 503: one unauthenticated client stopped every tenant. With
valid credentials (any tenant's sandbox's envd token) the same two connections still did."""
from __future__ import annotations

import select
import socket
import time
from contextlib import contextmanager

import httpx
import pytest

from tests.httpkit.conftest import served

UPLOAD_MB = 4               # e2b.max_upload_mb: the budget is twice that


@pytest.fixture
def e2b_api(tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    from cubegate.admin_tokens import ensure_token_file
    from cubegate.e2b import service
    from cubegate.e2b.core import E2bCore
    from cubegate.e2b.lanes import Lanes
    from cubegate.e2b.registry import E2bSandbox, Registry
    from cubegate.runtime_api import RUNTIME_TOKEN_PREFIX, TokenCheck
    from sandbox_runtime.backend import Limits
    from sandbox_runtime.capacity import default_budget
    from sandbox_runtime.manager import SandboxManager
    from sandbox_runtime.state import StateStore
    state = StateStore(tmp_path / "s.db")
    manager = SandboxManager(switch=None, backends={}, state=state, budget=default_budget(1024, 1.0, 4, 0))
    core = E2bCore(manager, Registry(tmp_path / "e2b"), templates={}, default_backend="namespace",
                   default_limits=Limits(), default_timeout=60, max_timeout=600, domain=None)
    core.registry.put(E2bSandbox("sb-1", "globex", "base", "base", 0.0, 1e12, "envd-token-of-sb-1"))
    token_file = tmp_path / "api.token"
    ensure_token_file(token_file, RUNTIME_TOKEN_PREFIX)
    tokens = TokenCheck(token_file)
    pool = ThreadPoolExecutor(max_workers=4)
    app = service.make_app(core, tokens, Lanes(pool, service.CONTROL_LIMITS), Lanes(pool, service.ENVD_LIMITS),
                           tenants={}, default_tenant="acme", domain=None)
    with served(lambda: service.listen(app, core, tokens, port=0, max_upload_mb=UPLOAD_MB, domain=None,
                                       tenants={}, default_tenant="acme")) as srv:
        yield srv, token_file.read_text().strip()
    pool.shutdown(wait=False, cancel_futures=True)
    state.close()


@contextmanager
def held_bodies(port: int, heads: list[bytes]):
    """Connections that send a request head declaring a body, then nothing."""
    socks = []
    try:
        for head in heads:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(head)
            socks.append(s)
        time.sleep(0.3)                       # the server has read every head
        yield socks
    finally:
        for s in socks:
            s.close()


def _upload_head(size: int, headers: str = "") -> bytes:
    return (f"POST /files?path=/x HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: sb-1\r\n{headers}"
            f"Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n\r\n").encode()


def _reply(s: socket.socket, wait: float = 5.0) -> bytes:
    s.settimeout(wait)
    try:
        return s.recv(4096)
    except (TimeoutError, OSError):
        return b""


def test_idle_unauthenticated_uploads_cannot_take_the_body_budget_from_everyone(e2b_api):
    srv, key = e2b_api
    big = UPLOAD_MB << 20
    with held_bodies(srv.port, [_upload_head(big), _upload_head(big),
                                _upload_head(big, "X-Access-Token: wrong\r\n"),
                                _upload_head(big, "X-API-Key: e2b_wrong\r\n")]) as socks:
        r = httpx.post(f"http://127.0.0.1:{srv.port}/sandboxes", headers={"X-API-Key": key},
                       content=b"{not json", timeout=10)
        assert r.status_code == 400, (r.status_code, r.text)     # reached the handler: before, 503 "busy"
        for s in socks:                      # before: they waited, holding 4 MiB each of the 8 MiB
            assert _reply(s).startswith(b"HTTP/1.1 401"), "an unauthenticated body was reserved"


def test_unauthenticated_small_bodies_still_get_the_handlers_401_and_cannot_block_keys(e2b_api):
    srv, key = e2b_api
    from httpkit.server import ANON_BUDGET, ANON_MAX_BODY
    n = ANON_BUDGET // ANON_MAX_BODY
    with held_bodies(srv.port, [_upload_head(ANON_MAX_BODY)] * n) as socks:
        one_more = httpx.post(f"http://127.0.0.1:{srv.port}/sandboxes", content=b"{}", timeout=10)
        # the small anonymous budget is full: the oldest idle body makes room (pass 7), not the newcomer
        assert one_more.status_code == 401, one_more.text
        # the oldest by the server's reading, which under load need not be the first sent
        dropped = [i for i, s in enumerate(socks) if _reply(s, 0.5 if i else 5.0).startswith(b"HTTP/1.1 503")]
        assert len(dropped) == 1, dropped
        r = httpx.post(f"http://127.0.0.1:{srv.port}/sandboxes", headers={"X-API-Key": key},
                       content=b"{not json", timeout=10)
        assert r.status_code == 400, (r.status_code, r.text)     # a valid key is not in that budget
    r = httpx.post(f"http://127.0.0.1:{srv.port}/sandboxes", content=b"{}", timeout=10)
    assert r.status_code == 401 and "X-API-Key" in r.text          # the handler's own answer


def test_a_valid_envd_token_may_still_send_a_large_upload_head(e2b_api):
    srv, _ = e2b_api
    with held_bodies(srv.port, [_upload_head(UPLOAD_MB << 20, "X-Access-Token: envd-token-of-sb-1\r\n")]) as socks:
        assert _reply(socks[0], 1.0) == b""               # admitted: the server waits for the body


def test_one_tenant_holds_at_most_half_of_the_body_budget(e2b_api):
    srv, key = e2b_api                       # the key is tenant acme's; sb-1 is globex's
    envd = "X-Access-Token: envd-token-of-sb-1\r\n"
    half = UPLOAD_MB << 20                   # the budget is two of these
    with held_bodies(srv.port, [_upload_head(half, envd), _upload_head(half, envd)]) as socks:
        # which head the server reads last is its business (a loaded run read them out of order):
        # one is refused at once (globex's share is full), the other is held, waiting for its body
        readable, _, _ = select.select(socks, [], [], 5)
        assert readable, "neither upload was refused: one tenant held the whole body budget"
        refused = readable[0]
        assert _reply(refused).startswith(b"HTTP/1.1 503")
        assert [_reply(s, 1.0) for s in socks if s is not refused] == [b""]
        r = httpx.post(f"http://127.0.0.1:{srv.port}/sandboxes", headers={"X-API-Key": key},
                       content=b"{not json", timeout=10)
        assert r.status_code == 400, (r.status_code, r.text)     # before: acme got 503 "busy" too
