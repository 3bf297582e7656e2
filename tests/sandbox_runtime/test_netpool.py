"""The pool of prepared network slots, on a real cubevs switch (eBPF) in a private hub
namespace: a slot goes to one sandbox only, destroyed sandboxes leave nothing, the
pool refills and drains."""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

if os.geteuid() != 0:
    pytest.skip("needs root", allow_module_level=True)

from cubevs import datapath, libbpf, netns  # noqa: E402
from cubevs.switch import Switch, SwitchError  # noqa: E402
from sandbox_runtime.netpool import SlotPool  # noqa: E402


@pytest.fixture
def switch():
    tag = "cp" + secrets.token_hex(3)
    tmp = Path(tempfile.mkdtemp(prefix=tag))
    netns.create(tag + "h")
    sw = None
    try:
        sw = Switch(hub_netns=tag + "h", state_dir=tmp / "cubevs", bpffs_dir=tmp / "bpf", netns_prefix=tag + "s")
        yield sw
    finally:
        if sw is not None:
            for sb in sw.sandboxes():
                with suppress(Exception):
                    sw.detach_sandbox(sb.sandbox_id)
            with suppress(Exception):
                sw.close()
        for name in os.listdir(netns.NETNS_RUN_DIR):
            if name.startswith(tag):
                netns.remove(name)
        if (tmp / "bpf").is_dir():
            with suppress(Exception):
                datapath.remove_pins(tmp / "bpf")
                libbpf.umount_bpffs(tmp / "bpf")
        shutil.rmtree(tmp, ignore_errors=True)


def _wait(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_a_slot_is_claimed_once(switch):
    slot = switch.prepare_slot()
    assert slot.sandbox_id.startswith(Switch.SLOT_PREFIX) and switch.slots() == [slot.sandbox_id]
    assert switch.lookup_by_ip(slot.ip) == slot.sandbox_id          # the gateway knows no such sandbox
    net = switch.claim_slot(slot.sandbox_id, "sb-a", l4_allow=[("10.9.0.0/24", 5432, "tcp")])
    assert (net.sandbox_id, net.ip, net.netns, net.ifindex) == ("sb-a", slot.ip, slot.netns, slot.ifindex)
    assert switch.lookup_by_ip(net.ip) == "sb-a" and switch.slots() == []
    with pytest.raises(SwitchError, match="no prepared slot"):
        switch.claim_slot(slot.sandbox_id, "sb-b")
    assert switch.lookup_by_ip(net.ip) == "sb-a"
    with pytest.raises(SwitchError):
        switch.claim_slot(switch.prepare_slot().sandbox_id, "sb-a")    # the id is taken
    with pytest.raises(SwitchError):
        switch.claim_slot("sb-a", "sb-c")                                # not a slot token


def test_concurrent_takes_never_share_a_slot_and_destroy_leaves_nothing(switch):
    pool = SlotPool(switch, 4).start()
    try:
        assert _wait(lambda: pool.ready() == 4)
        ids = [f"sb-{i}" for i in range(12)]
        barrier = threading.Barrier(len(ids))

        def take(sid):
            barrier.wait(timeout=10)
            return pool.take(sid)
        with ThreadPoolExecutor(len(ids)) as ex:
            nets = list(ex.map(take, ids))
        assert [n.sandbox_id for n in nets] == ids
        for attr in ("ip", "mac", "netns", "ifindex", "host_ifname", "sandbox_no"):
            assert len({getattr(n, attr) for n in nets}) == len(nets), attr
        assert pool.hits >= 4 and pool.hits + pool.misses == len(ids)
        for n in nets:
            assert switch.lookup_by_ip(n.ip) == n.sandbox_id
            pool.start_done()                             # the manager says so after each start
        assert _wait(lambda: pool.ready() == 4)           # refilled in the background
        # destroy: the network is torn down, never returned to the pool
        ready_before = set(switch.slots())
        for n in nets:
            switch.detach_sandbox(n.sandbox_id)
            assert not any(switch.has_trace(n).values()), (n, switch.has_trace(n))
        assert set(switch.slots()) == ready_before and len(ready_before) == 4
        assert not {n.netns for n in nets} & set(os.listdir(netns.NETNS_RUN_DIR))
    finally:
        pool.stop()
    assert switch.slots() == [] and switch.sandboxes() == []


def test_leftover_slots_of_a_previous_daemon_are_discarded(switch):
    old = [switch.prepare_slot() for _ in range(2)]
    pool = SlotPool(switch, 0).start()          # size 0: no refill, but leftovers go
    try:
        assert switch.slots() == []
        for s in old:
            assert not any(switch.has_trace(s).values())
        net = pool.take("sb-inline")              # empty pool: attached inline
        assert pool.misses == 1 and switch.lookup_by_ip(net.ip) == "sb-inline"
    finally:
        pool.stop()


def test_refill_waits_for_a_pause_in_starts(switch):
    pool = SlotPool(switch, 4, quiet_s=1.0, low_water=0).start()
    try:
        assert _wait(lambda: pool.ready() == 4)
        a, b = pool.take("sb-q1"), pool.take("sb-q2")
        assert pool.hits == 2 and pool.ready() == 2
        time.sleep(1.5)                     # both starts still under way: the refill waits
        assert pool.ready() == 2
        pool.start_done()
        time.sleep(0.5)                     # one still under way
        assert pool.ready() == 2
        pool.start_done()
        assert _wait(lambda: pool.ready() == 4)     # then it fills up in the pause
        assert {a.ip, b.ip}.isdisjoint({e.ip for e in switch.sandboxes() if e.sandbox_id in switch.slots()})
    finally:
        pool.stop()


def test_refill_delay_decision():
    pool = SlotPool(None, 8, quiet_s=1.0, low_water=2)      # never started: the decision only
    pool._ready.extend(["slot-1", "slot-2", "slot-3"])
    pool._last_start = 100.0
    assert pool._refill_delay(100.25) == pytest.approx(0.75)     # a start ended 0.25 s ago: wait
    assert pool._refill_delay(101.5) == 0.0                      # quiet for 1 s: refill
    pool._starting = 1
    assert pool._refill_delay(200.0) == 1.0                      # a start under way: wait
    pool._ready.pop()                                            # down to low_water: refill now
    assert pool._refill_delay(100.25) == 0.0
    assert SlotPool(None, 8).low_water == 2                      # default: a quarter of the size
