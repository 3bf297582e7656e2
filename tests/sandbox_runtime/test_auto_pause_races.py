"""Auto-pause against removal and failing pauses.

CI once saw the auto-pause task die: a sandbox was being removed while a round froze it,
its cgroup vanished, FileNotFoundError left the round, and from then on no sandbox was
ever paused again (and /readyz said a daemon task died). The manager parts run here with
a recording backend (the race is in the manager's locking, not in a backend); the cgroup
part runs on the real cgroup filesystem."""
from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest

from sandbox_runtime.backend import Handle, SandboxError
from sandbox_runtime.capacity import default_budget
from sandbox_runtime.manager import Conflict, SandboxManager
from sandbox_runtime.state import SandboxRecord, StateStore


class _Switch:
    def counters(self):
        return {}

    def detach_sandbox(self, sid):
        pass

    def sandbox(self, sid):
        return None


class _Backend:
    """Records pauses; pause of a sandbox in `broken` raises what a vanished cgroup raised;
    destroy of a sandbox in `slow` waits for `release`."""
    name = "rec"

    def __init__(self):
        self.paused: list[str] = []
        self.broken: set[str] = set()
        self.slow: set[str] = set()
        self.destroying = threading.Event()
        self.release = threading.Event()

    def available(self):
        return True, ""

    def pause(self, h):
        if h.sandbox_id in self.broken:
            raise FileNotFoundError(2, "No such file or directory", f"/sys/fs/cgroup/freezer/x/{h.sandbox_id}")
        self.paused.append(h.sandbox_id)

    def resume(self, h):
        pass

    def destroy(self, h):
        if h.sandbox_id in self.slow:
            self.destroying.set()
            assert self.release.wait(10)


def _manager(tmp_path, *sids: str) -> tuple[SandboxManager, _Backend]:
    now = [0.0]
    from sandbox_runtime.idle import Activity
    backend = _Backend()
    m = SandboxManager(switch=_Switch(), backends={"rec": backend}, state=StateStore(tmp_path / "s.db"),
                       budget=default_budget(4096, 2.0, 8, 0), auto_pause_seconds=1.0,
                       activity=Activity(clock=lambda: now[0]))
    for sid in sids:
        m.state.put(SandboxRecord(sid, "t", "rec", state="running", handle=Handle(sid, "rec", "ns")))
        m.activity.touch(sid)
    now[0] = 5.0            # every one idle for 5 s
    return m, backend


def test_a_pause_that_raises_anything_skips_that_sandbox_and_pauses_the_others(tmp_path):
    m, backend = _manager(tmp_path, "a", "b", "c")
    backend.broken.add("b")
    assert sorted(m.auto_pause_tick()) == ["a", "c"]
    assert m.get_record("b").state == "running"          # not paused: counted in full, still usable
    assert m.auto_pause_tick() == []                      # touched: not retried at every round


def test_a_sandbox_being_removed_is_never_paused_woken_or_used(tmp_path):
    m, backend = _manager(tmp_path, "gone", "idle")
    backend.slow.add("gone")
    t = threading.Thread(target=m.destroy, args=("gone",))
    t.start()
    try:
        assert backend.destroying.wait(10)               # the backend is tearing it down now
        assert m.auto_pause_tick() == ["idle"]            # the one being removed is left alone
        assert "gone" not in backend.paused
        for call in (m.pause, m.resume, m.destroy):
            with pytest.raises(Conflict, match="being removed"):
                call("gone")
        with pytest.raises(Conflict, match="being removed"):
            with m._use("gone"):
                pass
    finally:
        backend.release.set()
        t.join(10)
    assert not t.is_alive() and m.state.get("gone") is None


def test_a_failed_removal_can_be_retried(tmp_path):
    m, backend = _manager(tmp_path, "x")

    def fail(h):
        raise SandboxError("busy")
    backend.destroy = fail
    with pytest.raises(SandboxError):
        m.destroy("x")
    backend.destroy = lambda h: None
    m.destroy("x")                                        # not stuck "being removed"
    assert m.state.get("x") is None


def test_the_auto_pause_loop_outlives_a_round_that_raises():
    from cubegate.runtime_service import auto_pause_loop

    class _Manager:
        rounds = 0

        def auto_pause_tick(self):
            self.rounds += 1
            if self.rounds == 1:
                raise FileNotFoundError(2, "No such file or directory")
            return []
    m = _Manager()

    async def run():
        task = asyncio.create_task(auto_pause_loop(m, 1.0))     # a round every 0.25 s
        for _ in range(40):
            await asyncio.sleep(0.05)
            if m.rounds >= 3:
                break
        assert not task.done(), task
        task.cancel()
    asyncio.run(run())
    assert m.rounds >= 3


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroup filesystem)")
def test_freezing_a_cgroup_that_was_removed_is_a_sandbox_error():
    from sandbox_runtime.cgroups import SandboxCgroups, detect
    if detect()[0] is None:
        pytest.skip("no usable cgroup hierarchy")
    group = f"apr{uuid.uuid4().hex[:6]}"
    cg = SandboxCgroups.create(f"apr-{uuid.uuid4().hex[:6]}", None, group=group)
    try:
        if not cg.can_freeze():
            pytest.skip("no freezer")
        assert cg.remove()
        with pytest.raises(SandboxError, match="cgroup gone"):
            cg.freeze()
        with pytest.raises(SandboxError, match="cgroup gone"):
            cg.thaw()
    finally:
        cg.remove()
        for c in ("memory", "pids", "cpu", "cpuacct", "freezer", ""):
            try:
                os.rmdir(f"/sys/fs/cgroup/{c}/cubegate/{group}".replace("//", "/"))
            except OSError:
                pass
