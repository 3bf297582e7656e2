"""The daemon-side process table: commands that outlive the request that started them.

A `Process` owns one agent exec connection (`agent.client.ExecStream`) and a reader
thread. Output is kept for readers that come later (reconnects) up to `REPLAY_BYTES`
(oldest dropped first, said once); any number of readers subscribe; the exit stays
after the process ended (the table keeps the last `KEEP_EXITED` per sandbox).
Readers get events through a callback run on the reader thread, so the table needs
no event loop of its own: an asyncio server hands them to its loop itself.

Events: ("stdout"|"stderr", bytes) · ("end", Exit).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Callable

from .agent.client import AgentError, ExecStream

log = logging.getLogger("cubegate.processes")

REPLAY_BYTES = 1 << 20      # output kept per process for later readers
KEEP_EXITED = 32            # ended processes remembered per sandbox (Connect after the end)
MAX_RUNNING = 64            # per sandbox
# Daemon-wide: replay kept by all processes together; past it, a process that writes keeps
# only its newest REPLAY_FLOOR bytes. So at most MAX_TOTAL_REPLAY + MAX_PROCESSES x REPLAY_FLOOR.
MAX_TOTAL_REPLAY = 256 << 20
REPLAY_FLOOR = 64 << 10
MAX_PROCESSES = 2048        # running + remembered, all sandboxes (the oldest ended ones go first)


class ReplayBudget:
    """Bytes of replay held by every process of one table (thread-safe counter)."""

    def __init__(self, total: int = MAX_TOTAL_REPLAY):
        self.total, self.used = total, 0
        self._lock = threading.Lock()

    def add(self, n: int) -> bool:
        """Account n more bytes; True when the table is over its total now."""
        with self._lock:
            self.used += n
            return self.used > self.total

    def over(self) -> bool:
        return self.used > self.total


class ProcessError(RuntimeError):
    """Safe to show: names a pid or a limit, never request data."""


class NoSuchProcess(ProcessError):
    pass


@dataclasses.dataclass(frozen=True)
class Exit:
    exit_code: int
    status: str                  # "exit status N" / "signal: killed" / an error
    error: str | None = None     # set when the agent connection broke


def exit_of(payload: bytes) -> Exit:
    parts = payload.split(b"\0")
    try:
        code, timed_out = int(parts[0]), parts[1] == b"1"
    except (ValueError, IndexError):
        return Exit(-1, "error", "malformed exit frame from the agent")
    # killed by a signal: -1 and "signal: <name>" (what Go's os.ProcessState says, as envd reports it)
    if timed_out:
        return Exit(-1, "signal: killed", "the command reached its time limit")
    if code < 0:
        name = {9: "killed", 15: "terminated", 2: "interrupt", 1: "hangup"}.get(-code, f"signal {-code}")
        return Exit(-1, f"signal: {name}")
    return Exit(code, f"exit status {code}")


Listener = Callable[[str, object], None]


class Process:
    def __init__(self, pid: int, stream: ExecStream | None, config: dict, tag: str | None,
                 budget: ReplayBudget | None = None):
        self.pid, self.config, self.tag = pid, config, tag
        self._budget = budget or ReplayBudget()
        self._stream = stream
        self._lock = threading.Lock()
        self._events: collections.deque[tuple[str, bytes]] = collections.deque()
        self._bytes = 0
        self._dropped = False
        self._listeners: list[Listener] = []
        self.exit: Exit | None = None

    # ------------------------------------------------------------ reader side
    def run_reader(self) -> None:
        assert self._stream is not None
        try:
            while True:
                kind, payload = self._stream.recv()
                if kind in (b"O", b"R"):
                    self._emit("stdout" if kind == b"O" else "stderr", payload)
                elif kind == b"X":
                    self._finish(exit_of(payload))
                    return
                elif kind == b"F":
                    self._finish(Exit(-1, "error", "the agent refused the command"))
                    return
        except AgentError:
            self._finish(Exit(-1, "error", "the connection to the sandbox's agent was lost"))
        finally:
            self._stream.close()

    def _emit(self, kind: str, data: bytes) -> None:
        with self._lock:
            self._events.append((kind, data))
            self._bytes += len(data)
            over = self._budget.add(len(data))
            keep = REPLAY_FLOOR if over else REPLAY_BYTES
            freed = 0
            while self._bytes > keep and len(self._events) > 1:
                _, old = self._events.popleft()
                self._bytes -= len(old)
                freed += len(old)
                self._dropped = True
            if over and self._bytes > keep:     # one large event: its newest bytes only
                k, whole = self._events[0]
                self._events[0] = (k, whole[-keep:])
                freed += len(whole) - keep
                self._bytes = keep
                self._dropped = True
            self._budget.add(-freed)
            listeners = list(self._listeners)
        for fn in listeners:
            fn(kind, data)

    def _finish(self, ex: Exit) -> None:
        with self._lock:
            if self.exit is not None:
                return
            self.exit = ex
            listeners, self._listeners = list(self._listeners), []
        for fn in listeners:
            fn("end", ex)

    # ------------------------------------------------------------ readers
    def subscribe(self, fn: Listener) -> tuple[list[tuple[str, object]], Callable[[], None]]:
        """(what happened so far, unsubscribe). Later events go to fn; the replay and the
        registration are one step, so nothing is missed or seen twice."""
        with self._lock:
            replay: list[tuple[str, object]] = []
            if self._dropped:
                replay.append(("stderr", b"[cubegate: earlier output of this process was dropped]\n"))
            replay += list(self._events)
            if self.exit is not None:
                replay.append(("end", self.exit))
            else:
                self._listeners.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)
        return replay, unsubscribe

    # ------------------------------------------------------------ input
    def send_stdin(self, data: bytes) -> None:
        if self._stream is None or self.exit is not None:
            raise ProcessError(f"process {self.pid} takes no input")
        try:
            self._stream.send_stdin(data)
        except AgentError as e:
            raise ProcessError(f"process {self.pid}: {e}") from None

    def close_stdin(self) -> None:
        if self._stream is not None:
            self._stream.close_stdin()

    def release(self) -> None:
        """The table forgot this process: its replay goes (readers still attached get live events)."""
        with self._lock:
            freed, self._bytes = self._bytes, 0
            self._events.clear()
            self._dropped = True
        self._budget.add(-freed)

    def kill_stream(self) -> None:
        """Drop the agent connection: the agent kills the command's group."""
        if self._stream is not None:
            self._stream.close()


class ProcessTable:
    def __init__(self, *, max_total_replay: int = MAX_TOTAL_REPLAY, max_processes: int = MAX_PROCESSES) -> None:
        self._lock = threading.Lock()
        self._by_sandbox: dict[str, dict[int, Process]] = {}
        self.budget = ReplayBudget(max_total_replay)
        self.max_processes = max_processes

    def _count(self) -> int:
        return sum(len(t) for t in self._by_sandbox.values())

    def _make_room(self) -> None:
        """Under self._lock: forget ended processes (oldest first, any sandbox) until one more fits."""
        if self._count() < self.max_processes:
            return
        ended = [(sid, pid) for sid, t in self._by_sandbox.items() for pid, p in t.items() if p.exit is not None]
        for sid, pid in ended[: self._count() - self.max_processes + 1]:
            self._by_sandbox[sid].pop(pid).release()
        if self._count() >= self.max_processes:
            raise ProcessError(f"the daemon runs {self.max_processes} commands already")

    def start(self, sandbox_id: str, open_stream: Callable[[], ExecStream], config: dict, *,
              tag: str | None = None, stdin: bool = False) -> Process:
        """open_stream() starts the command (AgentError/SandboxError propagate)."""
        with self._lock:
            running = [p for p in self._by_sandbox.get(sandbox_id, {}).values() if p.exit is None]
            if len(running) >= MAX_RUNNING:
                raise ProcessError(f"sandbox runs {MAX_RUNNING} commands already")
            self._make_room()
        stream = open_stream()
        if not stdin:
            stream.close_stdin()
        proc = Process(stream.pid, stream, config, tag, self.budget)
        with self._lock:
            table = self._by_sandbox.setdefault(sandbox_id, {})
            self._put(table, proc)      # a reused pid replaces an ended process
            self._trim(table)
        threading.Thread(target=proc.run_reader, name=f"proc-{sandbox_id[:12]}-{proc.pid}", daemon=True).start()
        return proc

    def add_finished(self, sandbox_id: str, pid: int, config: dict, out: bytes, err: bytes, ex: Exit) -> Process:
        """A command run without a stream (a serial agent): its whole output at once."""
        with self._lock:
            self._make_room()
        proc = Process(pid, None, config, None, self.budget)
        if out:
            proc._emit("stdout", out)
        if err:
            proc._emit("stderr", err)
        proc._finish(ex)
        with self._lock:
            table = self._by_sandbox.setdefault(sandbox_id, {})
            self._put(table, proc)
            self._trim(table)
        return proc

    @staticmethod
    def _put(table: dict[int, Process], proc: Process) -> None:
        old = table.get(proc.pid)
        table[proc.pid] = proc
        if old is not None and old is not proc:
            old.release()

    @staticmethod
    def _trim(table: dict[int, Process]) -> None:
        ended = [pid for pid, p in table.items() if p.exit is not None]
        for pid in ended[:max(0, len(ended) - KEEP_EXITED)]:
            table.pop(pid).release()

    def get(self, sandbox_id: str, pid: int | None = None, tag: str | None = None) -> Process:
        with self._lock:
            table = self._by_sandbox.get(sandbox_id, {})
            if pid is not None and pid in table:
                return table[pid]
            if tag is not None:
                for p in table.values():
                    if p.tag == tag and p.exit is None:
                        return p
        raise NoSuchProcess(f"process with pid {pid} not found" if pid is not None else f"process tag {tag!r} not found")

    def running(self, sandbox_id: str) -> list[Process]:
        with self._lock:
            return [p for p in self._by_sandbox.get(sandbox_id, {}).values() if p.exit is None]

    def drop_sandbox(self, sandbox_id: str) -> None:
        with self._lock:
            table = self._by_sandbox.pop(sandbox_id, {})
        for p in table.values():
            p.kill_stream()
            p.release()
