"""Sample a Python process tree with py-spy while a bench row runs, and summarise it.

py-spy is a tool, not a dependency: `pip install py-spy` into the venv to use
--profile. Raw (collapsed) output, one line per distinct stack:
    process 123:"cmd";func (/path/file.py:10);func2 (/path/x.py:5) 42
"""
from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["available", "Recorder", "summarise"]

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):\d+\)$")


def _exe() -> str | None:
    near = Path(sys.executable).parent / "py-spy"
    return str(near) if near.exists() else shutil.which("py-spy")


def available() -> bool:
    return _exe() is not None


class Recorder:
    """``with Recorder(pid, out):`` samples ``pid`` and its children until the block ends."""

    def __init__(self, pid: int, out: Path, rate: int = 200) -> None:
        self.pid, self.out, self.rate = pid, Path(out), rate
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Recorder":
        exe = _exe()
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy into the venv)")
        self.proc = subprocess.Popen([exe, "record", "-p", str(self.pid), "--subprocesses", "--nonblocking",
                                      "--full-filenames", "-r", str(self.rate), "-f", "raw", "-o", str(self.out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # attached before the load starts
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _where(path: str) -> str:
    """A short owner for a source file: the package after site-packages, ours, or stdlib."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    for ours in ("egress", "cubegate", "vault", "cubevs", "testbed"):
        if f"/{ours}/" in path:
            return ours
    if "/lib/python3" in path:
        return "stdlib:" + Path(path).stem
    return Path(path).stem


def summarise(raw: str, top: int = 12) -> dict:
    """Samples by the leaf frame's owner and function, and inclusive shares of a few layers."""
    total = 0
    by_owner: collections.Counter[str] = collections.Counter()
    by_func: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    markers = {"mitmproxy proxy layers": "mitmproxy/proxy/layers/", "mitmproxy proxy server": "mitmproxy/proxy/server",
               "asyncio event loop": "asyncio/", "ssl / OpenSSL": "/ssl.py", "egress (ours)": "/egress/",
               "audit log": "/egress/audit/"}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [m for f in stack.split(";") if (m := _FRAME.match(f))]
        if not frames:
            continue
        total += n
        leaf = frames[-1]
        by_owner[_where(leaf["file"])] += n
        by_func[f"{leaf['func']} ({_where(leaf['file'])}:{Path(leaf['file']).name})"] += n
        for name, needle in markers.items():
            if any(needle in f["file"] for f in frames):
                inclusive[name] += n

    def share(c: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(k, round(100 * v / total, 1)) for k, v in c.most_common(top)] if total else []

    return {"samples": total, "self_by_owner": share(by_owner), "self_by_function": share(by_func),
            "inclusive": share(inclusive)}
