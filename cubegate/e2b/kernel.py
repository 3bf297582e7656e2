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
import ast, io, json, os, sys, traceback
MARK = sys.argv[1]
_out = sys.__stdout__

def emit(d):
    _out.write(MARK + json.dumps(d) + "\n")
    _out.flush()

class Stream(io.TextIOBase):
    """Whole lines out (print() writes the text and its newline separately)."""
    def __init__(self, kind):
        self.kind, self.buf = kind, ""
    def writable(self):
        return True
    def write(self, text):
        self.buf += text
        cut = self.buf.rfind("\n") + 1 if len(self.buf) < 65536 else len(self.buf)
        if cut:
            emit({"type": self.kind, "text": self.buf[:cut]})
            self.buf = self.buf[cut:]
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
    try:
        tree = ast.parse(req.get("code", ""), "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), ns)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), ns)
            if value is not None:
                emit({"type": "result", "text": repr(value), "is_main_result": True})
    except BaseException as e:
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        emit({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": "".join(tb)})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        os.environ.clear()
        os.environ.update(saved_env)
        emit({"type": "done", "execution_count": count})
'''


def new_marker() -> str:
    return "\x1e" + secrets.token_hex(8) + ":"


class KernelSession:
    """One execution at a time; events come from the kernel process's stdout lines."""

    def __init__(self, proc, marker: str):
        self.proc, self.marker = proc, marker
        self.lock = threading.Lock()

    def execute(self, code: str, env: dict, emit, timeout: float | None) -> None:
        """Send one cell; call emit(dict) for each output until done (or raise TimeoutError)."""
        cond = threading.Condition()
        lines: list[dict] = []
        state = {"buf": b"", "done": False, "ended": False}

        def on_event(kind, data):
            with cond:
                if kind == "end":
                    state["ended"] = True
                elif kind == "stdout":
                    state["buf"] += data
                    *complete, state["buf"] = state["buf"].split(b"\n")
                    for raw in complete:
                        lines.append(self._parse(raw.decode("utf-8", "replace")))
                elif kind == "stderr":
                    lines.append({"type": "stderr", "text": data.decode("utf-8", "replace")})
                cond.notify()

        with self.lock:
            _, unsubscribe = self.proc.subscribe(on_event)   # past output belongs to earlier cells
            try:
                self.proc.send_stdin(json.dumps({"code": code, "env": env or {}}).encode() + b"\n")
                deadline = None if timeout is None else time.monotonic() + timeout
                while True:
                    with cond:
                        while not lines and not state["ended"]:
                            left = None if deadline is None else deadline - time.monotonic()
                            if left is not None and left <= 0:
                                raise TimeoutError("execution timed out")
                            cond.wait(left if left is not None else 1.0)
                        batch, lines[:] = list(lines), []
                        ended = state["ended"]
                    for item in batch:
                        if item["type"] == "done":
                            emit({"type": "number_of_executions", "execution_count": item["execution_count"]})
                            return
                        emit(item)
                    if ended:
                        raise RuntimeError("the kernel exited")
            finally:
                unsubscribe()

    def _parse(self, line: str) -> dict:
        if line.startswith(self.marker):
            try:
                doc = json.loads(line[len(self.marker):])
                if isinstance(doc, dict) and "type" in doc:
                    return doc
            except ValueError:
                pass
        return {"type": "stdout", "text": line + "\n"}
