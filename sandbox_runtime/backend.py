"""The one interface every sandbox backend implements.

The manager (sandbox_runtime/manager.py) owns admission, state, metrics and
the cubevs attachment; a backend only turns a SandboxSpec + an attached
network namespace into a running sandbox whose exec agent answers, and back.

Blocking calls: backends are synchronous; the daemon runs them in a thread
pool. Every call must be bounded in time (timeouts everywhere).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class SandboxError(RuntimeError):
    """A sandbox operation failed; the message is safe to show to the caller."""


class NotSupported(SandboxError):
    """The backend cannot do this (e.g. pause on a backend without a freezer)."""


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 256      # hard limit; the kernel OOM-kills inside the sandbox beyond it
    cpus: float = 1.0         # CFS quota in CPUs
    pids: int = 256           # max tasks (fork bombs stop here)
    disk_mb: int = 256        # writable workspace size (tmpfs / guest disk)


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str           # sandbox_runtime.ids, unique on the host
    tenant: str
    backend: str = "namespace"          # "namespace" | "microvm"
    limits: Limits = field(default_factory=Limits)
    env: dict[str, str] = field(default_factory=dict)     # placeholders only, never real secrets
    files: dict[str, bytes] = field(default_factory=dict)  # path relative to /workspace -> content
    template: str | None = None         # root filesystem: a built template (None: the host's /usr)
    seed_layer: str | None = None       # start from this snapshot's writable layer (clone, rollback)
    seed_uid: int | None = None         # host uid that owns the files in seed_layer
    seed_template_key: str | None = None    # the template build seed_layer sits on (must still be current)
    seed_tokens: dict[str, str] = field(default_factory=dict)   # replaced in seed_layer's files (placeholders)


@dataclass(frozen=True)
class ExecResult:
    exit_code: int            # -N when killed by signal N; 124 on timeout (like timeout(1))
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    duration_s: float = 0.0


@dataclass
class Handle:
    """What a backend needs to find a running sandbox again, also after a daemon
    restart: stored as JSON by the manager (so keep `data` JSON-serialisable)."""
    sandbox_id: str
    backend: str
    netns: str                # cubevs namespace name the sandbox lives in
    data: dict = field(default_factory=dict)   # backend-private: pids, socket paths, cgroup paths


class Backend(Protocol):
    name: str

    def available(self) -> tuple[bool, str]:
        """(usable on this host, reason if not) — e.g. bwrap missing, guest assets not built."""

    def create(self, spec: SandboxSpec, netns: str, *, ip: str, gateway_ip: str) -> Handle:
        """Start the sandbox inside the existing network namespace `netns` (made by cubevs,
        with its address `ip` and default route via `gateway_ip` already set) and return
        once its exec agent answered. On any failure: clean up everything, raise SandboxError."""

    def exec(self, h: Handle, argv: list[str], *, timeout: float = 30.0, env: dict[str, str] | None = None,
             stdin: bytes = b"", cwd: str = "/workspace", on_output=None) -> ExecResult:
        """on_output(stream, chunk), when given, is called with output as it arrives."""

    def write_file(self, h: Handle, path: str, data: bytes, mode: int = 0o644) -> None: ...

    def read_file(self, h: Handle, path: str, max_bytes: int = 16 << 20) -> bytes: ...

    def set_env(self, h: Handle, env: dict[str, str]) -> None:
        """Replace the sandbox's base environment for later execs (idempotent)."""

    def pause(self, h: Handle) -> None: ...

    def resume(self, h: Handle) -> None: ...

    def alive(self, h: Handle) -> bool:
        """The sandbox's processes still exist and its agent answers a ping."""

    def usage(self, h: Handle) -> dict:
        """Measured from the kernel: {"memory_bytes": int, "cpu_seconds": float, "pids": int}."""

    def destroy(self, h: Handle) -> None:
        """Kill everything, remove cgroups/sockets/files. Idempotent; never raises for 'already gone'."""

    def snapshot_layer(self, h: Handle, dest: Path) -> dict:
        """Copy the sandbox's writable layer (files, never processes) to `dest`, consistent
        (the sandbox is frozen while it is copied). Returns {"template", "template_key",
        "layer_uid"}. NotSupported where the backend cannot."""

    def rollback(self, h: Handle, *, seed_layer: str, seed_uid: int | None, seed_template_key: str | None,
                 seed_tokens: dict[str, str], limits: Limits) -> Handle:
        """Stop the sandbox, replace its writable layer by a copy of `seed_layer`, start it
        again: same id, network, host uid and env; new processes. Returns the new handle."""
