"""An in-process daemon on free loopback ports (explicit proxy, ops, vault API; no root)."""
from __future__ import annotations

import asyncio

import httpx

from cubegate.daemon import Daemon
from cubegate.settings import load_settings
from tests.ports import free_ports

__all__ = ["POLICY", "free_ports", "daemon_settings", "readyz", "run_daemon"]

POLICY = "name: t\ndefault: deny\nrules:\n  - name: a\n    action: allow\n    match: {hosts: [a.test]}\n"


def daemon_settings(tmp_path, **update):
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "p.yaml").write_text(POLICY)
    proxy, ops, vault, policy_api = free_ports(4)
    s = load_settings(None, environ={}, state_dir=str(tmp_path / "state"))
    s = s.model_copy(update={"policy_dir": str(tmp_path / "policies"),
                             "proxy": s.proxy.model_copy(update={"explicit_port": proxy}),
                             "ops": s.ops.model_copy(update={"port": ops}),
                             "vault": s.vault.model_copy(update={"api_port": vault}),
                             "policy_api": s.policy_api.model_copy(update={"port": policy_api}),
                             "audit": s.audit.model_copy(update={"fsync": "never"}), **update})
    return s


async def readyz(port: int, until, timeout: float = 20.0) -> tuple[int, dict]:
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


def run_daemon(daemon: Daemon, scenario):
    async def main():
        runner = asyncio.create_task(daemon.run())
        try:
            return await scenario()
        finally:
            daemon._stop.set()
            await asyncio.wait_for(runner, 30)
    return asyncio.run(main())
