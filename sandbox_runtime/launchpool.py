"""A pool of parked launchers (launcher.py), each already in cgroups of its own.

- Each launcher parks in its cgroups and its view (launcher.py): the cgroup migration and
  the copy of the host's mount table are paid here, off the start path.
- Each launcher gets fresh cgroups named `_launcher-<random token>` (never a sandbox id:
  ids have no '_'), created for it and never reused. `take` pops one under a lock: it
  is handed out once. The caller renames its cgroups to the sandbox's id and sets the
  sandbox's limits before it claims (namespace.py); anything failing there discards it.
- A launcher taken is the sandbox's (its bwrap, after the claim): destroying the sandbox
  kills it and removes its cgroups like any other, nothing goes back to the pool.
- A daemon that dies leaves nothing claimable: parked launchers read EOF and exit, the
  pool itself is memory only; their empty cgroups are removed at the next start
  (`discard_leftovers`).
- Refilled by one niced background thread like the slot pool (refill.RefillPool):
  a burst of starts gets the CPU, the refill the pause after.
- cgroup v1 only (v2 has no rename): elsewhere the pool stays empty and every start
  spawns its launcher in the sandbox's cgroups.
"""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from sandbox_runtime.backend import SandboxError
from sandbox_runtime.cgroups import SandboxCgroups, detect
from sandbox_runtime.launcher import Launcher, LauncherError
from sandbox_runtime.refill import RefillPool

log = logging.getLogger("cubegate.runtime.launchers")

PREFIX = "_launcher-"
PARK_TIMEOUT_S = 5.0


@dataclass
class Pooled:
    launcher: Launcher
    cgroups: SandboxCgroups       # named PREFIX + token until the taker renames them

    def discard(self) -> None:
        self.launcher.discard()
        if not self.cgroups.remove():
            self.cgroups.kill_all()
            self.cgroups.remove()


class LauncherPool(RefillPool[Pooled]):
    name = "launcher-pool"
    prepare_errors = (SandboxError, LauncherError)

    def __init__(self, agent_binary: Path, group: str, size: int, view: list[str], *, quiet_s: float = 0.2,
                 low_water: int | None = None, retry_s: float = 1.0):
        """view: the static view every launcher pivots into while parked (launcher.py)."""
        super().__init__(size if detect()[0] == "v1" else 0, quiet_s=quiet_s, low_water=low_water,
                         retry_s=retry_s, log=log)
        self.agent_binary, self.group, self.view = Path(agent_binary), group, list(view)

    def discard_leftovers(self) -> int:
        """Pooled cgroups of a previous daemon of this instance (their launchers exit on EOF)."""
        with self._lock:
            mine = {str(p) for it in self._ready for p in it.cgroups.paths.values()}
        n = 0
        for cg in SandboxCgroups.named(PREFIX, group=self.group):
            if mine & set(cg.paths.values()):
                continue
            cg.kill_all()
            cg.remove()
            n += 1
        return n

    # ------------------------------------------------------------ use
    def take(self) -> Pooled | None:
        """A parked launcher for one start, or None (the caller spawns one). The caller calls
        start_done() once the start is over, whatever its outcome."""
        item = self._pop_for_start()
        if item is None:
            self.misses += 1
        else:
            self.hits += 1
        return item

    # ------------------------------------------------------------ refill
    def _prepare(self) -> Pooled:
        cg = SandboxCgroups.create(PREFIX + secrets.token_hex(8), None, group=self.group)
        try:
            launcher = Launcher(self.agent_binary, cg.procs_files(), self.view)
        except (OSError, LauncherError) as e:
            cg.remove()
            raise SandboxError(f"cannot start a launcher: {e}") from None
        item = Pooled(launcher, cg)
        try:
            launcher.wait_parked(PARK_TIMEOUT_S)
        except LauncherError:
            item.discard()
            raise
        return item

    def _discard(self, item: Pooled) -> None:
        item.discard()
