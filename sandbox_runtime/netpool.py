"""A pool of ready network slots: namespace + veth + address + map entries prepared ahead,
so a sandbox start does not pay the ~30 ms switch attach.

- A slot is prepared under a random one-use token (cubevs Switch.prepare_slot) and
  handed out at most once: `take` pops it under a lock and the switch renames its
  registry row atomically (claim_slot); a slot whose claim fails is destroyed, never
  put back.
- A destroyed sandbox's network is torn down, never returned: no address, MAC,
  counter or conntrack state of one sandbox reaches another (the address may be
  reused later like any freed address, its datapath number never is).
- Refilled by one background thread (refill.RefillPool); an empty pool falls back to attaching inline.
  A slot costs ~12 ms of CPU to prepare, about as much as the rest of a start: during
  a burst of starts the refill waits (until no start has been under way for `quiet_s`,
  or the pool is down to `low_water`), so the burst gets the CPU and the refill the
  pause after. A start is under way from `take` until the caller's `start_done`.
- Slots left by a previous daemon are destroyed at start (`discard_leftovers`).
"""
from __future__ import annotations

import logging

from sandbox_runtime.refill import RefillPool

log = logging.getLogger("cubegate.runtime.pool")


class SlotPool(RefillPool[str]):
    name = "slot-pool"

    def __init__(self, switch, size: int, *, retry_s: float = 1.0, quiet_s: float = 0.2,
                 low_water: int | None = None):
        super().__init__(size, quiet_s=quiet_s, low_water=low_water, retry_s=retry_s, log=log)
        self.switch = switch

    def discard_leftovers(self) -> int:
        n = 0
        for token in self.switch.slots():
            if self._has(token):
                continue
            self._discard(token)
            n += 1
        return n

    # ------------------------------------------------------------ use
    def take(self, sandbox_id: str, *, l4_allow=()):
        """The sandbox's network: a prepared slot if one is ready, else attached now.
        The caller calls start_done() once the start is over (whatever its outcome)."""
        first = True
        while True:
            token = self._pop_for_start(count=first)
            first = False
            if token is None:
                self.misses += 1
                return self.switch.attach_sandbox(sandbox_id, l4_allow=l4_allow)
            try:
                net = self.switch.claim_slot(token, sandbox_id, l4_allow=l4_allow)
            except Exception as e:  # noqa: BLE001 - a bad slot is destroyed, the next one tried
                log.warning("pool: slot claim failed (%s); discarding it", e)
                self._discard(token)
                if self.switch.sandbox(sandbox_id) is not None:
                    raise                       # the id is taken: not the slot's fault
                continue
            self.hits += 1
            return net

    # ------------------------------------------------------------ refill
    def _prepare(self) -> str:
        return self.switch.prepare_slot().sandbox_id   # address pool full, netlink error: retried later

    def _discard(self, token: str) -> None:
        try:
            self.switch.detach_sandbox(token)
        except Exception as e:  # noqa: BLE001
            log.error("pool: cannot remove slot %s: %s", token, e)
