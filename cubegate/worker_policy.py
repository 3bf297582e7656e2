"""A worker's policy reloads, off its event loop: the files and the store are parsed and
compiled on one thread (seconds at 2,000 rules: on the loop, every connection of the
worker would wait for them), and the compiled set is swapped in, and the change callbacks
(the gate's revocation) run, on the loop, between two of its callbacks: a decision sees
all of the old set or all of the new one.

Reloads coalesce: at most one runs and one waits; a request made while one waits joins it
(a SIGHUP joining a poll's makes it a full reload), so a storm of signals costs two parses.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from egress.log_redact import where
from egress.policy.live import LivePolicies
from egress.policy.reload import ReloadResult

log = logging.getLogger("cubegate.worker")


def on_loop(loop: asyncio.AbstractEventLoop) -> Callable[[Callable[[], None]], None]:
    """run(fn): fn on `loop`, returning once it ran (at once when called on the loop itself)."""
    def run(fn: Callable[[], None]) -> None:
        try:
            if asyncio.get_running_loop() is loop:
                return fn()
        except RuntimeError:   # no loop in this thread: the policy thread
            pass
        done: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            try:
                done.set_result(fn())
            except BaseException as e:   # noqa: BLE001 - handed to the waiting thread
                done.set_exception(e)
        loop.call_soon_threadsafe(call)   # RuntimeError once the loop is closed: the old set stays
        done.result()
    return run


class PolicyFollower:
    """The worker's one way to reload: request() from the loop; the work runs on the thread."""

    def __init__(self, policies: LivePolicies, slot: int,
                 count_reload: Callable[[ReloadResult], None]) -> None:
        self.policies = policies
        self.slot = slot
        self._count_reload = count_reload
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"policy-w{slot}")
        self._pending: tuple[bool, asyncio.Future] | None = None   # (files now?, done when it ran)
        self._task: asyncio.Task | None = None
        policies.swap_through(on_loop(asyncio.get_running_loop()))

    def request(self, *, files_now: bool = False) -> asyncio.Future:
        """files_now (SIGHUP): reload the files whatever their stats say, then the store; else
        (the daemon's word, the poll): files that changed and settled, then the store.
        Returns a future done once a reload covering this request has run."""
        if self._pending is None:
            self._pending = (files_now, asyncio.get_running_loop().create_future())
        else:
            self._pending = (self._pending[0] or files_now, self._pending[1])
        done = self._pending[1]
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending is not None:
                files_now, done = self._pending
                self._pending = None
                try:
                    res = await loop.run_in_executor(self._thread, self._reload, files_now)
                    if res is not None:
                        self._count_reload(res)
                except Exception as e:   # keep the old policy in force; the next poll tries again
                    log.error("worker %d: policy refresh failed: %s at %s", self.slot, type(e).__name__, where(e))
                finally:
                    if not done.done():
                        done.set_result(None)
        finally:
            self._task = None

    def _reload(self, files_now: bool) -> ReloadResult | None:
        """On the policy thread; the swaps it makes run on the loop (swap_through)."""
        res = self.policies.reload() if files_now else None   # an invalid file keeps the old set
        self.policies.refresh(settle=True)
        return res

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
