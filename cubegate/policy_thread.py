"""The daemon's one policy thread: every policy parse and swap (an API change, a file reload)
runs here, one at a time, never on the daemon's event loop, which also answers the APIs,
/readyz and the sandbox resolver: parsing takes seconds at the size limits. The swap's
listeners run here too (the daemon's tells the workers through call_soon_threadsafe)."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-parse")


async def off_loop(fn, *args, **kw):
    return await asyncio.get_running_loop().run_in_executor(_PARSER, lambda: fn(*args, **kw))
