"""The vault in the gateway's event loop reads its change mark once per loop iteration: its own
writes are seen by the very next resolve, another connection's by the first resolve of the
next iteration."""
from __future__ import annotations

import asyncio

from vault import Vault

from vaulttest_helpers import SECRET2


def _resolve(v):
    return v.resolve("acme", scheme="https", host="api.openai.com", port=443, method="GET", path="/v1/models")


def _in_loop(coro_fn):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


def test_own_writes_are_seen_at_once_in_the_same_iteration(bound_vault):
    async def scenario():
        first = _resolve(bound_vault)
        bound_vault.rotate("acme", "openai", SECRET2)
        assert _resolve(bound_vault).version == first.version + 1

    _in_loop(scenario)


def test_another_connections_write_is_seen_in_the_next_iteration(bound_vault, vault_path, key_path):
    other = Vault.open(vault_path)
    other.unseal_with_key_file(key_path)

    async def scenario():
        first = _resolve(bound_vault)
        for i in range(3):
            other.rotate("acme", "openai", SECRET2 + str(i))
            await asyncio.sleep(0)
            assert _resolve(bound_vault).version == first.version + 1 + i

    try:
        _in_loop(scenario)
    finally:
        other.close()
