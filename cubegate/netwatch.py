"""Switch observability in the gateway: per-sandbox datapath counters on /metrics
and drop events (eBPF ring buffer) into the audit log as `net_drop` records.

The switch is owned by whoever attached the sandboxes; the gateway only reopens
it from the cubevs state dir (pinned maps, registry) to read counters and drain
events. No switch in the state dir → nothing is started ("no switch").
"""
from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

from egress.audit.record import make_record

log = logging.getLogger("cubegate.netwatch")

POLL_SECONDS = 0.5
MAX_EVENTS_PER_POLL = 1000


class SwitchCollector:
    """Prometheus collector reading Switch.counters() at scrape time."""

    def __init__(self, switch, lock: threading.Lock):
        self.switch = switch
        self.lock = lock
        self.events_dropped = 0
        self.events_audited = 0

    def describe(self):
        return []   # no registry-time collect(): the switch may be slow or gone

    def collect(self):
        pkts = CounterMetricFamily("cubegate_switch_packets", "Packets seen by the cubevs switch datapath",
                                   labels=["sandbox", "reason", "verdict"])
        byts = CounterMetricFamily("cubegate_switch_bytes", "L2 frame bytes seen by the cubevs switch datapath",
                                   labels=["sandbox", "reason", "verdict"])
        try:
            with self.lock:
                counters = self.switch.counters()
        except Exception as e:  # noqa: BLE001 - a scrape never fails because of the switch
            log.warning("switch counters unavailable: %s", e)
            counters = {}
        for (sandbox, reason, verdict), (p, b) in sorted(counters.items(), key=lambda kv: tuple(map(str, kv[0]))):
            labels = [sandbox or "-", str(reason), str(verdict)]
            pkts.add_metric(labels, p)
            byts.add_metric(labels, b)
        dropped = CounterMetricFamily("cubegate_switch_events_dropped",
                                      "Switch drop events not audited (over the per-poll limit)")
        dropped.add_metric([], self.events_dropped)
        audited = CounterMetricFamily("cubegate_switch_events_audited", "Switch drop events written as net_drop")
        audited.add_metric([], self.events_audited)
        return [pkts, byts, dropped, audited]


def drop_record(ev: dict) -> dict:
    return make_record(
        "net_drop", decision="deny", reason=str(ev.get("reason") or "unknown"),
        sandbox=ev.get("sandbox"), host=ev.get("dst"),
        port=ev.get("dport") if isinstance(ev.get("dport"), int) else None,
        client=ev.get("src"), extra={"proto": ev.get("proto")},
    )


class NetWatch:
    def __init__(self, switch, registry, audit, *, poll_seconds: float = POLL_SECONDS,
                 max_events: int = MAX_EVENTS_PER_POLL, l4_for=None, l4_key=None, owns_switch: bool = True):
        self.switch = switch
        self.owns_switch = owns_switch  # False: the sandbox runtime's switch, closed by the runtime
        self.l4_for = l4_for            # sandbox_id -> [(cidr, port, proto)] from the effective policy in force
        self.l4_key = l4_key            # () -> what the decision depends on (digest, expired grants): resync on change
        self._l4_synced: tuple | None = None
        self.audit = audit
        self.poll_seconds = poll_seconds
        self.max_events = max_events
        self._lock = threading.Lock()   # Switch maps/registry: scrape thread vs. drain thread
        self.collector = SwitchCollector(switch, self._lock)
        self._registry = registry
        registry.register(self.collector)
        self.task: asyncio.Task | None = None   # supervised by the daemon

    def start(self) -> None:
        self.task = asyncio.create_task(self._poll(), name="netwatch")

    def _drain(self) -> list[dict]:
        with self._lock:
            # One over the limit tells us whether events are left behind; the rest of the
            # backlog is drained in the same call and counted, never audited one by one.
            events = self.switch.drain_events(max=self.max_events + 1)
            extra = 0
            if len(events) > self.max_events:
                extra = len(events) - self.max_events
                events = events[: self.max_events]
                while True:
                    more = self.switch.drain_events(max=self.max_events)
                    extra += len(more)
                    if len(more) < self.max_events:
                        break
        self.collector.events_dropped += extra
        return events

    def _sync_l4(self) -> None:
        """Push each sandbox's L4 entries (from the effective decision: policy, grants, network
        options) into the switch when any of them or the sandbox set changed."""
        if self.l4_for is None:
            return
        with self._lock:
            ids = tuple(sorted(n.sandbox_id for n in self.switch.sandboxes()))
            key = (self.l4_key() if self.l4_key else None, ids)
            if key == self._l4_synced:
                return
            for sid in ids:
                try:
                    self.switch.set_l4_allow(sid, self.l4_for(sid))
                except Exception as e:  # noqa: BLE001 - one bad sandbox must not stop the others
                    log.warning("l4 sync for %s failed: %s", sid, e)
            self._l4_synced = key

    async def _poll(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self._sync_l4)
            except Exception:  # keep polling
                log.exception("l4 policy sync failed")
            try:
                events = await asyncio.to_thread(self._drain)
                for ev in events:
                    try:
                        self.audit.append(drop_record(ev))
                        self.collector.events_audited += 1
                    except (OSError, ValueError) as e:
                        self.collector.events_dropped += 1
                        log.warning("net_drop audit append failed: %s", e)
            except Exception:  # keep polling
                log.exception("switch event poll failed")
            await asyncio.sleep(self.poll_seconds)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        try:
            self._registry.unregister(self.collector)
        except KeyError:
            pass
        if not self.owns_switch:
            return
        with self._lock:
            try:
                self.switch.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing switch handle failed: %s", e)


def _reopen(state_dir: Path):
    from cubevs.registry import DB_NAME
    from cubevs.switch import Switch, SwitchError
    if not (Path(state_dir) / DB_NAME).exists():
        return None
    try:
        return Switch.reopen(state_dir)
    except SwitchError:
        return None


async def start_for(daemon) -> NetWatch | None:
    """Started by Daemon.start() in transparent mode; None when there is no switch."""
    s = daemon.settings
    if not s.proxy.transparent_port:
        return None
    state_dir = s.cubevs_state_dir
    runtime = getattr(daemon, "_runtime", None)
    try:
        # One Switch per daemon: the runtime's when it runs (it attaches the sandboxes);
        # else reopen (in a thread: pyroute2 runs its own event loop).
        switch = runtime.switch if runtime is not None else await asyncio.to_thread(_reopen, state_dir)
    except Exception as e:  # noqa: BLE001 - the gateway runs without switch observability
        log.warning("netwatch: cannot reopen cubevs switch in %s: %s", state_dir, e)
        return None
    if switch is None:
        log.info("netwatch: no switch in %s", state_dir)
        return None
    from cubegate.l4sync import l4_allow_for

    def l4_for(sandbox_id: str):
        ident = daemon.identities.get(sandbox_id)
        return l4_allow_for(daemon.policies.current, sandbox_id, ident.labels if ident else {},
                            guard=daemon.guard)

    def l4_key():
        # every change (policy, grant, network options) makes a new digest; a grant that
        # reaches its expiry before the sweep removes it changes the decision too
        current = daemon.policies.current
        return current.digest, current.expired_grants()

    nw = NetWatch(switch, daemon.metrics.registry, daemon.audit, l4_for=l4_for, l4_key=l4_key,
                  owns_switch=runtime is None)
    nw.start()
    log.info("netwatch: switch %s backend, counters on /metrics, drop events to audit", switch.backend)
    return nw


async def stop_for(nw: NetWatch | None) -> None:
    if nw is not None:
        await nw.close()
