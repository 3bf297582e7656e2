"""run_code: a small long-lived Python kernel inside the sandbox, and the daemon's side of it.

The kernel reads one JSON request per line on stdin and answers with lines on stdout
that start with a per-kernel marker (so output of the user's own subprocesses, which
also lands on fd 1, stays ordinary stdout). One global namespace per kernel: state
is kept between calls. The value of a last expression statement is the result.
"""
from __future__ import annotations

import json
import secrets
import threading
import time

KERNEL_PATH = "/tmp/.cubegate-kernel.py"
KERNEL_TAG = "cubegate-kernel"

KERNEL_SOURCE = r'''
import ast, io, json, os, signal, sys, traceback
MARK = sys.argv[1]
_out = sys.__stdout__
PIECE = 65536                 # characters per output line: the daemon bounds its line buffer
MAX_TEXT = 1 << 20            # a result or a traceback longer than this is cut (said so)
state = {"in_cell": False}

def _interrupt(signum, frame):
    # the daemon interrupts a cell it gave up on (timeout, client gone, output over its bound);
    # between cells the signal is ignored, so the kernel itself never dies of it
    if state["in_cell"]:
        raise KeyboardInterrupt
signal.signal(signal.SIGINT, _interrupt)

def emit(d):
    _out.write(MARK + json.dumps(d) + "\n")
    _out.flush()

def cut(text):
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "\n[cubegate: cut at 1 MiB]"

class Stream(io.TextIOBase):
    # Whole lines out (print() writes the text and its newline separately), in pieces
    def __init__(self, kind):
        self.kind, self.buf = kind, ""
    def writable(self):
        return True
    def write(self, text):
        self.buf += text
        while len(self.buf) >= PIECE:
            emit({"type": self.kind, "text": self.buf[:PIECE]})
            self.buf = self.buf[PIECE:]
        cut_at = self.buf.rfind("\n") + 1
        if cut_at:
            emit({"type": self.kind, "text": self.buf[:cut_at]})
            self.buf = self.buf[cut_at:]
        return len(text)
    def flush(self):
        if self.buf:
            emit({"type": self.kind, "text": self.buf})
            self.buf = ""

ns = {"__name__": "__main__", "__builtins__": __builtins__}
count = 0
for line in sys.stdin:
    try:
        req = json.loads(line)
    except ValueError:
        continue
    count += 1
    saved_env = dict(os.environ)
    os.environ.update(req.get("env") or {})
    sys.stdout, sys.stderr = Stream("stdout"), Stream("stderr")
    error = None
    try:
        state["in_cell"] = True
        try:
            tree = ast.parse(req.get("code", ""), "<cell>", "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<cell>", "exec"), ns)
            if last is not None:
                value = eval(compile(last, "<cell>", "eval"), ns)
                if value is not None:
                    emit({"type": "result", "text": cut(repr(value)), "is_main_result": True})
        except BaseException as e:
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            error = {"type": "error", "name": type(e).__name__, "value": cut(str(e)), "traceback": cut("".join(tb))}
        finally:
            state["in_cell"] = False
    except KeyboardInterrupt:     # the interrupt landed between two statements above
        error = {"type": "error", "name": "KeyboardInterrupt", "value": "", "traceback": ""}
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    if error is not None:
        emit(error)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    os.environ.clear()
    os.environ.update(saved_env)
    emit({"type": "done", "execution_count": count})
'''


def new_marker() -> str:
    return "\x1e" + secrets.token_hex(8) + ":"


class KernelBusy(RuntimeError):
    """Another cell of this sandbox holds the kernel past the wait bound."""


class Cancelled(RuntimeError):
    """The caller went away (its client disconnected)."""


class OutputLimit(RuntimeError):
    """The cell wrote more than MAX_CELL_OUTPUT."""


MAX_CELL_OUTPUT = 16 << 20     # bytes of output one cell may send (the kernel lives on: per cell, not per life)
MAX_LINE = 8 << 20             # a kernel line longer than this is passed on as raw output, in pieces
BUSY_WAIT_S = 30.0             # how long a cell waits for the kernel another cell holds
DRAIN_S = 5.0                  # after an interrupt, how long the next cell waits for the old one's end


class KernelSession:
    """One execution at a time. Every kernel line is read by one subscriber for the kernel's
    whole life and belongs to the cell whose `done` has not been seen yet (the kernel runs
    requests in order and numbers them), so a cell given up on (timeout, client gone, too
    much output) is interrupted and its late output never lands in the next cell."""

    def __init__(self, proc, marker: str, interrupt=None):
        self.proc, self.marker = proc, marker
        self.interrupt = interrupt or (lambda: None)   # SIGINT to the kernel (the daemon's agent call)
        self.lock = threading.Lock()
        self._cond = threading.Condition()
        self._sent = 0           # requests written to the kernel
        self._finished = 0       # highest `done` seen
        self._ended = False
        self._sink = None        # (cell number, list) of the cell being collected
        self._buf = b""
        _, self._unsubscribe = proc.subscribe(self._on_event)   # nothing was sent yet: no replay to read

    # ------------------------------------------------------------ kernel output (reader thread)
    def _on_event(self, kind, data) -> None:
        with self._cond:
            if kind == "end":
                self._ended = True
            elif kind == "stdout":
                self._buf += data
                *complete, self._buf = self._buf.split(b"\n")
                for raw in complete:
                    self._route(self._parse(raw.decode("utf-8", "replace")))
                while len(self._buf) > MAX_LINE:          # never a line buffer without a bound
                    piece, self._buf = self._buf[:MAX_LINE], self._buf[MAX_LINE:]
                    self._route({"type": "stdout", "text": piece.decode("utf-8", "replace")})
            elif kind == "stderr":
                self._route({"type": "stderr", "text": data.decode("utf-8", "replace")})
            self._cond.notify_all()

    def _route(self, item: dict) -> None:
        cell = self._finished + 1
        if item["type"] == "done":
            n = item.get("execution_count")
            if isinstance(n, int) and not isinstance(n, bool) and n < cell:
                return                   # a late or forged `done` of a cell already over
            self._finished = n if isinstance(n, int) and n <= self._sent else cell
        if self._sink is not None and self._sink[0] == cell:
            self._sink[1].append(item)   # else: a cell given up on, or noise between cells: dropped

    # ------------------------------------------------------------ one cell (a worker thread)
    def execute(self, code: str, env: dict, emit, timeout: float | None, cancel: threading.Event | None = None) -> None:
        """Send one cell; emit(dict) each output until done. TimeoutError, Cancelled,
        KernelBusy, OutputLimit (after an error item), RuntimeError (the kernel exited)."""
        cancel = cancel or threading.Event()
        deadline = None if timeout is None else time.monotonic() + timeout
        busy_until = time.monotonic() + (BUSY_WAIT_S if timeout is None else min(timeout, BUSY_WAIT_S))
        while not self.lock.acquire(timeout=0.2):
            if cancel.is_set():
                raise Cancelled("the client went away")
            if time.monotonic() >= busy_until:
                raise KernelBusy("the code interpreter is busy with another cell")
        try:
            self._wait_idle(cancel, min(busy_until, time.monotonic() + DRAIN_S)
                            if self._finished < self._sent else busy_until)
            items: list[dict] = []
            with self._cond:
                self._sent += 1
                self._sink = (self._sent, items)
            self.proc.send_stdin(json.dumps({"code": code, "env": env or {}}).encode() + b"\n")
            self._collect(items, emit, deadline, cancel)
        finally:
            with self._cond:
                self._sink = None
            self.lock.release()

    def _wait_idle(self, cancel: threading.Event, until: float) -> None:
        """The cell before (given up on and interrupted) must have ended first."""
        with self._cond:
            while self._finished < self._sent and not self._ended:
                if cancel.is_set():
                    raise Cancelled("the client went away")
                left = until - time.monotonic()
                if left <= 0:
                    self.interrupt()
                    raise KernelBusy("the code interpreter is still busy with an earlier cell")
                self._cond.wait(min(left, 0.2))

    def _collect(self, items: list[dict], emit, deadline: float | None, cancel: threading.Event) -> None:
        sent_bytes = 0
        while True:
            with self._cond:
                while not items and not self._ended:
                    if cancel.is_set():
                        self.interrupt()
                        raise Cancelled("the client went away")
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self.interrupt()
                        raise TimeoutError("execution timed out")
                    self._cond.wait(0.2 if left is None else min(left, 0.2))
                batch, items[:] = list(items), []
                ended = self._ended
            for item in batch:
                if item["type"] == "done":
                    emit({"type": "number_of_executions", "execution_count": item["execution_count"]})
                    return
                sent_bytes += len(item.get("text") or "")
                if sent_bytes > MAX_CELL_OUTPUT:
                    self.interrupt()
                    emit({"type": "error", "name": "OutputLimitExceeded",
                          "value": f"the cell wrote more than {MAX_CELL_OUTPUT >> 20} MiB of output; "
                                   "it was interrupted",
                          "traceback": ""})
                    raise OutputLimit("cell output over its bound")
                emit(item)
            if ended:
                raise RuntimeError("the kernel exited")

    def close(self) -> None:
        self._unsubscribe()

    def _parse(self, line: str) -> dict:
        if line.startswith(self.marker):
            try:
                doc = json.loads(line[len(self.marker):])
                if isinstance(doc, dict) and "type" in doc:
                    return doc
            except ValueError:
                pass
        return {"type": "stdout", "text": line + "\n"}
