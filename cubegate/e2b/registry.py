"""The E2B view of a sandbox: template, metadata, start and end time, envd access token.

The SandboxManager owns the sandbox itself; this is what E2B adds to it, one JSON file
per sandbox (0600: it holds the sandbox's envd token) under <runtime_dir>/e2b, so a
daemon restart keeps it. Time is wall-clock (E2B reports RFC 3339 times).
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import os
import threading
import time
from pathlib import Path


@dataclasses.dataclass
class E2bSandbox:
    sandbox_id: str
    tenant: str
    template_id: str
    alias: str
    started_at: float
    end_at: float
    envd_token: str
    metadata: dict = dataclasses.field(default_factory=dict)
    cpus: float = 1.0
    memory_mb: int = 256
    disk_mb: int = 256
    kind: str = "base"

    def token_ok(self, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(self.envd_token.encode(), token.encode())


def expired(sandboxes: list[E2bSandbox], now: float, paused: set[str]) -> list[str]:
    """Ids whose end time has come (paused sandboxes do not run out: E2B keeps them)."""
    return [s.sandbox_id for s in sandboxes if s.end_at <= now and s.sandbox_id not in paused]


class Registry:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._items: dict[str, E2bSandbox] = {}
        for f in sorted(self.dir.glob("*.json")):
            try:
                rec = E2bSandbox(**json.loads(f.read_text()))
            except (OSError, ValueError, TypeError):
                continue
            self._items[rec.sandbox_id] = rec

    def put(self, rec: E2bSandbox) -> None:
        with self._lock:
            self._items[rec.sandbox_id] = rec
            path = self.dir / f"{rec.sandbox_id}.json"
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(dataclasses.asdict(rec), f)
            tmp.replace(path)

    def get(self, sandbox_id: str) -> E2bSandbox | None:
        with self._lock:
            return self._items.get(sandbox_id)

    def all(self) -> list[E2bSandbox]:
        with self._lock:
            return list(self._items.values())

    def delete(self, sandbox_id: str) -> None:
        with self._lock:
            self._items.pop(sandbox_id, None)
            (self.dir / f"{sandbox_id}.json").unlink(missing_ok=True)

    def set_end(self, sandbox_id: str, end_at: float) -> None:
        rec = self.get(sandbox_id)
        if rec is not None:
            self.put(dataclasses.replace(rec, end_at=end_at))


def rfc3339(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1e6):06d}Z"
