import asyncio
import threading
from types import SimpleNamespace

import pytest

from vault import Vault, create_key_file
from vault.api import serve

from vaulttest_helpers import SECRET, SECRET2, header_binding  # noqa: F401


@pytest.fixture
def key_path(tmp_path):
    path = tmp_path / "vault.key"
    create_key_file(path)
    return path


@pytest.fixture
def vault_path(tmp_path, key_path):
    from vault import load_key_file
    path = tmp_path / "vault.db"
    Vault.init(path, load_key_file(key_path)).close()
    return path


@pytest.fixture
def vault(vault_path, key_path):
    v = Vault.open(vault_path)
    v.unseal_with_key_file(key_path)
    yield v
    v.close()


@pytest.fixture
def bound_vault(vault):
    vault.put_secret("acme", "openai", SECRET, description="OpenAI key")
    vault.add_binding(header_binding())
    return vault


@pytest.fixture
def api(bound_vault):
    """Admin API on 127.0.0.1, ephemeral port, in its own thread and event loop."""
    records: list[dict] = []
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    def run():
        asyncio.set_event_loop(loop)

        async def start():
            holder["srv"] = serve(bound_vault, "127.0.0.1", 0, audit_hook=records.append)
            started.set()
        loop.run_until_complete(start())
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(10)
    _, admin = bound_vault.tokens.create("admin", 3600, "test admin")
    _, read = bound_vault.tokens.create("read", 3600, "test read")
    yield SimpleNamespace(url=f"http://127.0.0.1:{holder['srv'].port}", records=records, vault=bound_vault,
                          admin=admin, read=read)
    loop.call_soon_threadsafe(holder["srv"].stop)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)
