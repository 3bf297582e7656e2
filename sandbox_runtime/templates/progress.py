"""Build progress: mmdebstrap's `I:` lines → numbered phases, shown on one line.

Pure parsing (`phase_of`) and a small renderer that writes `\\r`-updated text on
a terminal and one line per phase otherwise (CI logs).
"""
from __future__ import annotations

import sys
import time

# (substring of mmdebstrap's info line, label); order = the build's order
PHASES = (
    ("running apt-get update", "resolving packages"),
    ("downloading packages", "downloading packages"),
    ("extracting archives", "unpacking essential packages"),
    ("installing essential packages", "installing essential packages"),
    ("installing remaining packages", "installing packages"),
    ("cleaning package lists", "cleaning up"),
    ("creating tarball", "writing the image"),
)
EXTRA = ("extracting the image", "checking the image")   # ours, after mmdebstrap
TOTAL = len(PHASES) + len(EXTRA)


def phase_of(line: str) -> tuple[int, str] | None:
    """(1-based phase number, label) for a line that starts a phase, else None."""
    if not line.startswith("I: "):
        return None
    for i, (needle, label) in enumerate(PHASES, 1):
        if needle in line:
            return i, label
    return None


def extra_phase(label: str) -> tuple[int, str]:
    return len(PHASES) + EXTRA.index(label) + 1, label


class Progress:
    def __init__(self, name: str, out=None, clock=time.monotonic):
        self.name, self.out, self.clock = name, out if out is not None else sys.stderr, clock
        self.t0 = clock()
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.current: tuple[int, str] | None = None

    def phase(self, p: tuple[int, str]) -> None:
        if self.current and p[0] <= self.current[0]:
            return
        self.current = p
        text = f"template {self.name}: [{p[0]}/{TOTAL}] {p[1]} ({self.clock() - self.t0:.0f}s)"
        self.out.write(("\r\033[K" + text) if self.tty else text + "\n")
        self.out.flush()

    def line(self, raw: str) -> None:
        p = phase_of(raw)
        if p:
            self.phase(p)

    def done(self, what: str) -> None:
        text = f"template {self.name}: {what} in {self.clock() - self.t0:.1f}s"
        self.out.write(("\r\033[K" + text + "\n") if self.tty else text + "\n")
        self.out.flush()
