"""Authentication in the gateway's event loop reads the identity db's change mark once per loop
iteration: a removal or re-key by another connection is refused from the next iteration on,
and this store's own writes at once."""
from __future__ import annotations

import asyncio

from egress.identity import Identity, IdentityStore


def _in_loop(coro_fn):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


def test_another_connections_removal_and_rekey_are_refused_next_iteration(tmp_path):
    path = tmp_path / "identities.db"
    daemon, cli = IdentityStore(path), IdentityStore(path)

    async def scenario():
        token = cli.add("sb-1", {"team": "a"})
        await asyncio.sleep(0)
        assert daemon.authenticate("sb-1", token) == Identity("sb-1", {"team": "a"})
        new = cli.add("sb-1", {"team": "b"}, replace=True)
        await asyncio.sleep(0)
        assert daemon.authenticate("sb-1", token) is None
        assert daemon.authenticate("sb-1", new) == Identity("sb-1", {"team": "b"})
        assert cli.remove("sb-1")
        await asyncio.sleep(0)
        assert daemon.authenticate("sb-1", new) is None

    try:
        _in_loop(scenario)
    finally:
        cli.close()
        daemon.close()


def test_own_writes_are_seen_at_once(tmp_path):
    store = IdentityStore(tmp_path / "identities.db")

    async def scenario():
        token = store.add("sb-1")
        assert store.authenticate("sb-1", token) == Identity("sb-1", {})
        new = store.add("sb-1", {"team": "c"}, replace=True)
        assert store.authenticate("sb-1", token) is None
        assert store.authenticate("sb-1", new) == Identity("sb-1", {"team": "c"})
        assert store.remove("sb-1")
        assert store.authenticate("sb-1", new) is None

    try:
        _in_loop(scenario)
    finally:
        store.close()
