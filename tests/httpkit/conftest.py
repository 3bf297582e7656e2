import asyncio
import contextlib
import threading

import pytest


@contextlib.contextmanager
def served(start):
    """Run `start()` (returns an httpkit.Server) on a fresh event loop in a thread; yield the server."""
    loop = asyncio.new_event_loop()
    holder, ready = {}, threading.Event()

    def run():
        asyncio.set_event_loop(loop)

        async def go():
            holder["srv"] = start()
            ready.set()
        loop.run_until_complete(go())
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        yield holder["srv"]
    finally:
        loop.call_soon_threadsafe(holder["srv"].stop)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()


@pytest.fixture
def serve_in_thread():
    return served
