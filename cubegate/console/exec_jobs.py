"""Exec console jobs: one command in a sandbox, its output kept (bounded) for the browser's stream.

The command runs in a worker thread (SandboxManager.exec, blocking); the agent's output
frames arrive through its on_output hook and are handed to the event loop, where the
job's server-sent-events stream picks them up. Bounded: at most MAX_JOBS jobs (a new one
replaces the oldest finished one), at most MAX_OUTPUT characters kept per job, finished
jobs forgotten after KEEP_SECONDS. A job
belongs to the session that started it; no other session can read it.
"""
from __future__ import annotations

import asyncio
import codecs
import secrets
import time
from typing import Any, Callable

MAX_JOBS = 32
MAX_OUTPUT = 1 << 20
KEEP_SECONDS = 600.0
TRUNCATED = "\n[cubegate console: output truncated at 1 MiB; the command keeps running]\n"


class ExecJob:
    def __init__(self, job_id: str, sandbox: str, owner: str, loop: asyncio.AbstractEventLoop):
        self.id, self.sandbox, self.owner, self.loop = job_id, sandbox, owner, loop
        self.created = time.monotonic()
        self.finished: float | None = None
        self.chunks: list[tuple[str, str]] = []     # (stdout|stderr, text)
        self.size = 0
        self.truncated = False
        self.result: dict | None = None             # exit_code, timed_out, duration_s
        self.error: str | None = None
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
        self._waiters: list[asyncio.Future] = []

    # -- worker thread side ------------------------------------------------------
    def output_hook(self, stream: str, data: bytes) -> None:
        self.loop.call_soon_threadsafe(self._append, stream, data)

    # -- event loop side -------------------------------------------------------------
    def _append(self, stream: str, data: bytes) -> None:
        if self.truncated:
            return
        text = self._decoders[stream].decode(data)
        if not text:
            return
        room = MAX_OUTPUT - self.size
        if len(text) > room:
            text, self.truncated = text[:room] + TRUNCATED, True
        self.chunks.append((stream, text))
        self.size += len(text)
        self._changed()

    def finish(self, result: dict | None = None, error: str | None = None) -> None:
        for stream, dec in self._decoders.items():
            tail = dec.decode(b"", final=True)
            if tail and not self.truncated:
                self.chunks.append((stream, tail))
        self.result, self.error, self.finished = result, error, time.monotonic()
        self._changed()

    @property
    def done(self) -> bool:
        return self.finished is not None

    def _changed(self) -> None:
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    async def wait_change(self, timeout: float) -> None:
        f = self.loop.create_future()
        self._waiters.append(f)
        try:
            await asyncio.wait_for(f, timeout)
        except TimeoutError:
            pass

    def text(self, stream: str | None = None) -> str:
        return "".join(t for s, t in self.chunks if stream is None or s == stream)


class ExecJobs:
    def __init__(self, describe_error: Callable[[BaseException], str]) -> None:
        """describe_error: the message a failed exec shows (never an unexpected exception's text)."""
        self._jobs: dict[str, ExecJob] = {}
        self._describe = describe_error

    def start(self, sandbox: str, owner: str, run: Callable[[ExecJob], Any]) -> ExecJob:
        """`run(job)` is a coroutine function doing the exec; the job is finished with its result."""
        self._forget_old()
        if len(self._jobs) >= MAX_JOBS:   # the oldest finished job makes room (its output goes)
            finished = sorted((j for j in self._jobs.values() if j.done), key=lambda j: j.finished)
            if finished:
                del self._jobs[finished[0].id]
        if len(self._jobs) >= MAX_JOBS:
            raise OverflowError(f"{MAX_JOBS} exec jobs are running; try again when one has finished")
        job = ExecJob(secrets.token_urlsafe(12), sandbox, owner, asyncio.get_running_loop())
        self._jobs[job.id] = job

        async def go() -> None:
            try:
                job.finish(result=await run(job))
            except Exception as e:  # the message of a known error; the caller maps it
                job.finish(error=self._describe(e))
        job.task = asyncio.get_running_loop().create_task(go(), name=f"console-exec-{job.id}")
        return job

    def get(self, job_id: str, owner: str) -> ExecJob | None:
        job = self._jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    def _forget_old(self) -> None:
        now = time.monotonic()
        for jid in [j.id for j in self._jobs.values() if j.done and now - j.finished > KEEP_SECONDS]:
            del self._jobs[jid]

    def cancel_all(self) -> None:
        for job in self._jobs.values():
            task = getattr(job, "task", None)
            if task is not None:
                task.cancel()
