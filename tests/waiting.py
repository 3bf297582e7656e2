"""One bounded poll for tests: wait for a condition instead of sleeping a fixed time and hoping.

A fixed sleep is either too short on a loaded machine (a flake) or longer than needed on an idle
one (time lost); a poll with a generous deadline is neither.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """cond()'s first truthy value; AssertionError naming `what` (and the last value) after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        last = cond()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what} (last: {last!r:.500})")
        time.sleep(interval)
