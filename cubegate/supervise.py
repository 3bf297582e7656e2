"""Supervision of the daemon's long-running asyncio tasks.

A task that dies (raises, or returns although it should run until the daemon
stops) is logged once with its traceback and named on /readyz (check "tasks"),
which turns 503: a hot-reload loop that stopped must not go unnoticed while
the proxy keeps answering with a stale policy. Nothing is restarted: a task
that died on a bug would die again; an operator (or the orchestrator reading
/readyz) restarts the daemon.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("cubegate.supervise")


class Supervisor:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}
        self._dead: dict[str, str] = {}
        self._stopping = False

    def start(self, name: str, coro: Coroutine[Any, Any, Any], *, forever: bool = True) -> asyncio.Task:
        """Run `coro` as task `name`; `forever=False` for one-shot jobs (returning is success)."""
        return self.watch(name, asyncio.get_running_loop().create_task(coro, name=name), forever=forever)

    def watch(self, name: str, task: asyncio.Task, *, forever: bool = True) -> asyncio.Task:
        """Supervise a task someone else created."""
        if name in self._tasks:
            raise ValueError(f"task {name!r} is supervised already")
        self._tasks[name] = task
        task.add_done_callback(lambda t: self._ended(name, t, forever))
        return task

    def _ended(self, name: str, task: asyncio.Task, forever: bool) -> None:
        if self._stopping:
            return
        if task.cancelled():
            why = "cancelled"
        elif task.exception() is not None:
            exc = task.exception()
            why = f"{type(exc).__name__}: {exc}"
            log.error("daemon task %s died: %s", name, why, exc_info=(type(exc), exc, exc.__traceback__))
        elif forever:
            why = "returned"
        else:
            return
        if why in ("cancelled", "returned"):
            log.error("daemon task %s stopped (%s) while the daemon runs", name, why)
        self._dead[name] = why

    def check(self) -> tuple[bool, str]:
        """For Readiness: ok while no supervised task died."""
        if self._dead:
            return False, "died: " + "; ".join(f"{n} ({why})" for n, why in sorted(self._dead.items()))
        return True, f"{len(self._tasks)} task(s): " + ", ".join(sorted(self._tasks))

    @property
    def dead(self) -> dict[str, str]:
        return dict(self._dead)

    def begin_stop(self) -> None:
        """The daemon is stopping: tasks that end from now on have not died."""
        self._stopping = True

    async def stop(self) -> None:
        """Cancel every task and wait for them."""
        self.begin_stop()
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
