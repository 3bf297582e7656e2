"""A daemon task that dies is logged with its traceback and named by /readyz (503).

The failure is the one from issue #12: a policy_poll_seconds that is not a
number killed the policy-watch task on its first sleep, and hot reload stopped
without a word. Settings now refuse such a value (tests/cubegate/test_settings.py),
so the test lets it slip past validation (model_copy does not validate) to
stand for any bug that kills a supervised task.
"""
from __future__ import annotations

import asyncio
import logging
import socket

import httpx

from cubegate.daemon import Daemon
from cubegate.settings import load_settings

POLICY = "name: t\ndefault: deny\nrules:\n  - name: a\n    action: allow\n    match: {hosts: [a.test]}\n"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _settings(tmp_path, **update):
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "p.yaml").write_text(POLICY)
    proxy, ops, vault = _free_ports(3)
    s = load_settings(None, environ={}, state_dir=str(tmp_path / "state"))
    s = s.model_copy(update={"policy_dir": str(tmp_path / "policies"),
                             "proxy": s.proxy.model_copy(update={"explicit_port": proxy}),
                             "ops": s.ops.model_copy(update={"port": ops}),
                             "vault": s.vault.model_copy(update={"api_port": vault}),
                             "audit": s.audit.model_copy(update={"fsync": "never"}), **update})
    return s


async def _readyz(port: int, until, timeout: float = 20.0) -> tuple[int, dict]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with httpx.AsyncClient() as c:
        while True:
            try:
                r = await c.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                last = (r.status_code, r.json())
                if until(*last):
                    return last
            except httpx.HTTPError as e:
                last = (0, {"error": str(e)})
            if loop.time() > deadline:
                raise AssertionError(f"/readyz never matched: {last}")
            await asyncio.sleep(0.1)


def _run(daemon: Daemon, scenario):
    async def main():
        runner = asyncio.create_task(daemon.run())
        try:
            return await scenario()
        finally:
            daemon._stop.set()
            await asyncio.wait_for(runner, 30)
    return asyncio.run(main())


def test_healthy_daemon_lists_its_supervised_tasks(tmp_path):
    d = Daemon(_settings(tmp_path))

    async def scenario():
        return await _readyz(d.settings.ops.port, lambda code, body: code == 200)
    code, body = _run(d, scenario)
    detail = body["checks"]["tasks"]["detail"]
    assert body["checks"]["tasks"]["ok"] and "policy-watch" in detail and "mitmproxy" in detail


def test_dead_task_turns_readyz_503_naming_it(tmp_path, caplog):
    """The sandbox resolver's UDP socket goes away under a running daemon: its task dies."""
    caplog.set_level(logging.ERROR, logger="cubegate.supervise")
    (dns_port,) = _free_ports(1)
    s = _settings(tmp_path)
    d = Daemon(s.model_copy(update={"dns": s.dns.model_copy(update={"listen_host": "127.0.0.1", "port": dns_port})}))

    async def scenario():
        await _readyz(s.ops.port, lambda code, body: code == 200)
        d._dns._transport.close()   # the socket is lost (what a failing interface or fd would do)
        return await _readyz(s.ops.port, lambda code, body: code == 503)
    code, body = _run(d, scenario)
    tasks = body["checks"]["tasks"]
    assert not tasks["ok"] and tasks["detail"].startswith("died: sandbox-dns (ConnectionError"), tasks
    # every other check still passes: the 503 is the dead task's
    assert all(c["ok"] for name, c in body["checks"].items() if name != "tasks"), body
    died = [r for r in caplog.records if "sandbox-dns" in r.getMessage()]
    assert died and died[0].exc_info is not None and died[0].exc_info[0] is ConnectionError


def test_task_dying_at_startup_stops_the_daemon_with_its_traceback(tmp_path, caplog):
    """Issue #12's case: a policy_poll_seconds that is not a number killed policy-watch on its
    first sleep and hot reload stopped without a word. Settings refuse it now (test_settings.py);
    here it slips past validation (model_copy does not validate) to stand for any bug that
    kills a task while the daemon starts: the daemon refuses to run, and says why."""
    caplog.set_level(logging.ERROR, logger="cubegate.supervise")
    d = Daemon(_settings(tmp_path, policy_poll_seconds="fast"))
    rc = asyncio.run(asyncio.wait_for(d.run(), 30))
    assert rc == 1
    died = [r for r in caplog.records if "policy-watch" in r.getMessage()]
    assert died and died[0].exc_info is not None and died[0].exc_info[0] is TypeError
    assert "_policy_watch" in caplog.text   # the traceback names the function that died
    assert d.supervisor.dead.keys() >= {"policy-watch", "mitmproxy"}
    with socket.socket() as probe:          # stopped in order: the proxy port is free again
        probe.bind(("127.0.0.1", d.settings.proxy.explicit_port))
