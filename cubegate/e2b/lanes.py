"""Blocking calls of the E2B API in a shared thread pool, with a bound per sandbox and per
tenant, so that one sandbox (or one tenant) can never hold every worker.

A call first takes a slot in each of its lanes (its sandbox's, then its tenant's: always
that order, so two calls never wait on each other) — waiting on the event loop, holding no
thread — then runs in the pool. A lane whose slots and waiting room are full answers at
once (LaneFull → 429), a wait ends when the client goes away (Gone) or after `max_wait`
(LaneFull). Idle lanes are dropped: memory grows with the calls in flight, not with ids.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor


class LaneFull(Exception):
    """Too many calls of one sandbox or tenant in flight: the caller should retry later."""


class Gone(Exception):
    """The client went away while its call waited for a slot."""


class _Lane:
    __slots__ = ("sem", "users")

    def __init__(self, slots: int):
        self.sem, self.users = asyncio.Semaphore(slots), 0


class Lanes:
    def __init__(self, pool: Executor, limits: dict[str, int], *, max_waiting: int = 64, max_wait: float = 60.0):
        self.pool, self.limits, self.max_waiting, self.max_wait = pool, dict(limits), max_waiting, max_wait
        self._lanes: dict[tuple[str, str], _Lane] = {}

    def in_flight(self, kind: str, key: str) -> int:
        lane = self._lanes.get((kind, key))
        return lane.users if lane is not None else 0

    async def run(self, keys: list[tuple[str, str]], fn, *, gone: asyncio.Event | None = None):
        """Run fn() in the pool once a slot of every (kind, key) lane is held."""
        taken: list[_Lane] = []
        joined: list[tuple[tuple[str, str], _Lane]] = []
        try:
            for kind, key in keys:
                lane = self._lanes.get((kind, key))
                if lane is None:
                    lane = self._lanes[(kind, key)] = _Lane(self.limits[kind])
                if lane.users >= self.limits[kind] + self.max_waiting:
                    raise LaneFull(f"too many calls in flight for this {kind}; retry later")
                lane.users += 1
                joined.append(((kind, key), lane))
                await self._acquire(lane, kind, gone)
                taken.append(lane)
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn)
        finally:
            for lane in taken:
                lane.sem.release()
            for k, lane in joined:
                lane.users -= 1
                if lane.users == 0 and self._lanes.get(k) is lane:
                    del self._lanes[k]

    async def _acquire(self, lane: _Lane, kind: str, gone: asyncio.Event | None) -> None:
        if not lane.sem.locked():
            await lane.sem.acquire()
            return
        acquiring = asyncio.ensure_future(lane.sem.acquire())
        waits = {acquiring}
        watcher = asyncio.ensure_future(gone.wait()) if gone is not None else None
        if watcher is not None:
            waits.add(watcher)
        try:
            done, _ = await asyncio.wait(waits, timeout=self.max_wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watcher is not None:
                watcher.cancel()
        if acquiring in done:
            return
        acquiring.cancel()
        try:
            await acquiring            # it may have been granted just now: then give it back
            lane.sem.release()
        except asyncio.CancelledError:
            pass
        if watcher is not None and watcher in done:
            raise Gone("the client went away")
        raise LaneFull(f"waited {self.max_wait:.0f} s for a free slot of this {kind}; retry later")
